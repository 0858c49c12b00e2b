"""A step that may be undone: the record of a step whose gradients come in parts (:class:`OpenStep`, the overlapped
DDP hook's), and copies of the compressors' state taken before a step (:class:`StateCopy`: at once for
``sync.pack=all``, part by part through :meth:`OpenStep.save`), put back on every worker when any worker's gradient
was not finite (:func:`put_back`). :class:`~dgc.sync.GradientSync` decides when to take a copy and when to put it
back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dgc.comm import Traffic
from dgc.compressors import Compressor
from dgc.compressors.base import Item
from dgc.timing import Phases


@dataclass
class OpenStep:
    """A step whose gradients come in parts (:meth:`GradientSync.begin`): what its parts did so far."""

    phases: Phases
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    compressed: list[Item] = field(default_factory=list)
    control: int = 0
    dense_sent: int = 0
    traffic: Traffic = field(default_factory=Traffic)
    skipped: bool = False
    requests: set[str] = field(default_factory=set)
    #: the compression state before the step: :meth:`GradientSync.begin` hands each step the same kept copy (its
    #: buffers are reused from step to step), :meth:`save` adds each part's state to it
    before: StateCopy = field(default_factory=lambda: StateCopy())
    #: each part's agreement flags, reduced over the workers (by maximum, or averaged in a ``pack="all"`` message),
    #: left on the device until :meth:`GradientSync.end` reads them all at once
    agreed: list[torch.Tensor] = field(default_factory=list)

    def add(self, traffic: Traffic) -> None:
        self.traffic.sent += traffic.sent
        self.traffic.recv += traffic.recv
        self.traffic.collectives += traffic.collectives
        self.traffic.local_sent += traffic.local_sent

    def save(self, compressors: list[Compressor], names: list[str]) -> None:
        """Copy the state of ``names`` (before the part changes it) into :attr:`before`: one dispatch, into buffers
        kept from step to step."""
        self.before.add(compressors, names)

    def restore(self) -> None:
        """Put back the state saved before the parts, and the extra state :attr:`before` started with."""
        self.before.put_back()


def put_back(saved: list[tuple[Compressor, str, dict[str, torch.Tensor]]],
             extra: list[tuple[Compressor, dict[str, Any]]]) -> None:  # fmt: skip
    """Compressors' state as copied in ``saved`` (``(compressor, name, {key: copy})``) and ``extra`` (their extra
    state), in place (it may be a view of a compressor's flat bucket); state made since starts at zero again."""
    for c, name, before in saved:
        for key, t in c.state.get(name, {}).items():
            if key in before and before[key].shape == t.shape:
                t.copy_(before[key])
            else:
                t.zero_()
    for c, state in extra:
        c.load_extra_state(state)


class StateCopy:
    """A copy of compressors' per-tensor state and extra state, taken before a step that may be undone: at once
    (:meth:`take`, ``pack="all"``), or started with the extra state and added to part by part (:meth:`start`,
    :meth:`add`: the overlapped hook's buckets). Its buffers are kept from step to step, so each copy is one
    dispatch (no allocation after the first step); putting it back, in place, happens only when the step is undone."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str, str], torch.Tensor] = {}
        self._taken: list[tuple[Compressor, str, dict[str, torch.Tensor]]] = []
        self._extra: list[tuple[Compressor, dict[str, Any]]] = []

    def take(self, compressors: list[Compressor], names: list[str]) -> None:
        """Copy the extra state of ``compressors`` and the state of ``names``, forgetting any earlier copy."""
        self.start(compressors)
        self.add(compressors, names)

    def start(self, compressors: list[Compressor]) -> None:
        """Begin a new copy: forget the last, and copy the extra state of ``compressors`` (none: nothing to put
        back but what :meth:`add` copies)."""
        self._taken, self._extra = [], [(c, c.extra_state()) for c in compressors]

    def add(self, compressors: list[Compressor], names: list[str]) -> None:
        """Also copy the state of ``names`` (each name once a copy)."""
        sources, copies = [], []
        for i, c in enumerate(compressors):
            for name in names:
                kept = {}
                for key, t in c.state.get(name, {}).items():
                    buf = self._buffers.get((i, name, key))
                    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                        buf = self._buffers[(i, name, key)] = torch.empty_like(t)
                    sources.append(t)
                    copies.append(buf)
                    kept[key] = buf
                self._taken.append((c, name, kept))
        if sources:
            torch._foreach_copy_(copies, sources)

    def put_back(self) -> None:
        """The state as it was when copied (:func:`put_back`)."""
        put_back(self._taken, self._extra)


__all__ = ["OpenStep", "StateCopy", "put_back"]
