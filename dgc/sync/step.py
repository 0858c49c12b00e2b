"""One step of a :class:`~dgc.sync.GradientSync`, given whole or in parts, and what it may have to undo.

:class:`OpenStep` is the record of a step from :meth:`GradientSync.begin` to :meth:`GradientSync.end`: its parts'
pairs, bytes and pending agreements, the agreement strategy it runs (:mod:`dgc.sync.agreement`) and the
optimizer's hyperparameters it runs with (:func:`hypers_of`: read once, as data, when the step begins).
:class:`StateCopy` holds copies of the compressors' state taken before the parts change it, put back on every
worker when any worker's gradient was not finite (:func:`put_back`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dgc.comm import Traffic
from dgc.compressors import Compressor
from dgc.compressors.base import Item
from dgc.stats import StepStats
from dgc.sync.agreement import REQUESTS, Agreement
from dgc.timing import Phases


class Hyper(NamedTuple):
    """One parameter's hyperparameters for the step: what momentum correction and ``accumulate="updates"`` need."""

    momentum: float
    nesterov: bool
    weight_decay: float
    lr: float


def hypers_of(param_groups: Iterable[dict[str, Any]]) -> dict[int, Hyper]:
    """Each parameter's :class:`Hyper` (keyed by ``id``) from an optimizer's ``param_groups``, as a scheduler left
    them; a key a group lacks (AdamW has no ``momentum``) reads 0."""
    out = {}
    for g in param_groups:
        hyper = Hyper(float(g.get("momentum", 0.0)), bool(g.get("nesterov", False)),
                      float(g.get("weight_decay", 0.0)), float(g.get("lr", 0.0)))  # fmt: skip
        for p in g["params"]:
            out[id(p)] = hyper
    return out


@dataclass
class OpenStep:
    """A step from :meth:`GradientSync.begin` to :meth:`GradientSync.end`: what its parts did so far."""

    phases: Phases
    #: how the workers agree on this step (:mod:`dgc.sync.agreement`; None: a step that sends nothing)
    agreement: Agreement | None = None
    #: the optimizer's hyperparameters of each parameter for this step (:func:`hypers_of`; empty: none bound)
    hypers: dict[int, Hyper] = field(default_factory=dict)
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
    #: each part's agreement flags not read yet, reduced over the workers (by maximum, or averaged in a
    #: ``pack="all"`` message), left on the device until :meth:`GradientSync.end` reads them all at once
    agreed: list[torch.Tensor] = field(default_factory=list)

    def add(self, traffic: Traffic) -> None:
        self.traffic.sent += traffic.sent
        self.traffic.recv += traffic.recv
        self.traffic.collectives += traffic.collectives
        self.traffic.local_sent += traffic.local_sent

    def stats(self, number: int, epoch: float, density: float) -> StepStats:
        """What the step did, as the sync's ``number``-th step (``epoch`` and ``density``: the compressor's)."""
        compressed, phases, traffic = [] if self.skipped else self.compressed, self.phases, self.traffic
        return StepStats(
            step=number,
            epoch=epoch,
            density=density,
            dense_bytes=sum(g.numel() for _, g in self.pairs) * 4,
            sent_bytes=traffic.sent,
            recv_bytes=traffic.recv,
            collectives=traffic.collectives,
            dense_sent_bytes=self.dense_sent,
            values_sent=phases.counters.get("values_sent", 0),
            compressed_numel=sum(it.grad.numel() for it in compressed),
            compress_s=phases.seconds["compress"],
            communicate_s=phases.seconds["communicate"],
            decompress_s=phases.seconds["decompress"],
            counters=dict(phases.counters),
            skipped=self.skipped,
            requests=tuple(r for r in REQUESTS if r in self.requests),
            control_bytes=self.control,
            local_bytes=traffic.local_sent,
        )

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


__all__ = ["Hyper", "OpenStep", "StateCopy", "hypers_of", "put_back"]
