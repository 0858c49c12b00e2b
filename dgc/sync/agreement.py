"""The workers' agreement on each step: whether any worker's gradient is not finite, and what any worker requested.

Every worker puts a few flags (a byte each: non-finite, then one per :data:`REQUESTS`) into the step; their maximum
over the workers says whether every worker skips the step and what they all stop or checkpoint at, at the same step
boundary. The non-finite check rides on the gradient norms the step computes anyway for local clipping (one
``_foreach_norm``) and is read on the host together with the requests (one host read for both).

When the flags are read is one of three strategies, chosen when the :class:`~dgc.sync.GradientSync` is built:

* :class:`AgreeFirst` (the serial step): one small MAX allreduce (by machine under ``hierarchical``:
  :meth:`dgc.exchanges.Exchange.agree_max_`), read at once, before anything is compressed: a skipped step touches
  no compression state;
* :class:`AgreeLater` (the step in parts: the overlapped DDP hook): each part's allreduce is issued but not read;
  the step's end reads every part's at once. The compression state is copied before each part is compressed and
  put back when the step is skipped;
* :class:`AgreeInMessage` (``sync.pack=all``): the flags ride in the compressor's own message (:mod:`dgc.packing`),
  their mean read at the step's end, the state copied as for :class:`AgreeLater`; a part without a compressed
  tensor (no message) agrees by its fallback.

Each returns what it learnt as a value (:class:`Agreed`), never through an attribute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgc.comm import Comm

#: what a worker can ask all workers to do at the next step boundary (:meth:`GradientSync.request`): stop, write
#: a checkpoint, or end the run as diverged (local steps, where each worker skips its own non-finite steps)
REQUESTS = ("stop", "checkpoint", "diverged")
#: the bytes of the agreement's allreduce: a byte per flag (non-finite, then each of :data:`REQUESTS`); what the cost
#: models (:mod:`dgc.costmodel`, :mod:`dgc.repro.frontier_cost`) price before every exchange
AGREEMENT_BYTES = 1 + len(REQUESTS)


class Flags:
    """This worker's flags: the non-finite check of its gradients and the requests made since the last step."""

    def __init__(self, comm: Comm, check_finite: bool = True,
                 reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        self.comm = comm
        self.check_finite = check_finite
        #: the element-wise maximum over every worker, in place (one allreduce over ``comm`` by default; the
        #: exchange's own, :meth:`dgc.exchanges.Exchange.agree_max_`, under GradientSync)
        self.reduce_max = reduce_max or comm.allreduce_max_
        self._requested: set[str] = set()

    def request(self, what: str) -> None:
        """Ask every worker to see ``what`` at the next agreement. Safe to call from a signal handler."""
        if what not in REQUESTS:
            raise ValueError(f"unknown request {what!r}; valid: {', '.join(REQUESTS)}")
        self._requested.add(what)

    def not_finite(self, norms: list[torch.Tensor]) -> torch.Tensor | None:
        """Whether any of the gradients whose ``norms`` these are is not finite: a 0-d bool left on the device
        (None when unchecked). A norm is >= 0: not finite is not below inf, and NaN compares False."""
        if not self.check_finite or not norms:
            return None
        return (torch.stack(norms) < math.inf).logical_not_().any()

    def take(self, bad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """This worker's flags on ``device``: non-finite (``bad``), then one per request (uint8, 0 or 1); the requests
        are taken (the next flags start without them)."""
        requested = torch.tensor([r in self._requested for r in REQUESTS], dtype=torch.uint8, device=device)
        self._requested.clear()
        flag = torch.zeros(1, dtype=torch.uint8, device=device) if bad is None else bad.to(device, torch.uint8).view(1)
        return torch.cat([flag, requested])

    def reduce(self, bad: torch.Tensor | None) -> torch.Tensor:
        """Every worker's flags reduced by maximum (one small MAX), left on the device."""
        return self.reduce_max(self.take(bad, self.comm.device))


def read(agreed: torch.Tensor) -> tuple[bool, tuple[str, ...]]:
    """Whether any worker's gradient was not finite, and what any worker requested, from the workers' flags reduced
    by maximum or mean (a flag above 0: some worker raised it). One host read."""
    values = agreed.tolist()
    return values[0] > 0, tuple(r for r, f in zip(REQUESTS, values[1:]) if f > 0)


@dataclass
class Agreed:
    """What a part's agreement gave before its exchange: the flags to carry in the compressor's message (or None),
    the flags reduced over the workers and not yet read (or None), the outcome when it was read at once (``known``),
    and the control bytes it cost (not gradient traffic: reported apart)."""

    carry: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    known: tuple[bool, tuple[str, ...]] | None = None
    control: int = 0


class AgreeFirst:
    """The serial step's: one small allreduce, read before anything is compressed (nothing to undo)."""

    #: the step's compression state must be copied before compressing, to be put back if the step is skipped
    undoes = False

    def __init__(self, flags: Flags) -> None:
        self.flags = flags

    def open(self, bad: torch.Tensor | None, device: torch.device, carries: bool) -> Agreed:
        reduced = self._reduce(bad)
        return Agreed(known=read(reduced.pending), control=reduced.control)

    def _reduce(self, bad: torch.Tensor | None) -> Agreed:
        """Every worker's flags reduced by maximum, not read, with the bytes the allreduce sent."""
        sent = self.flags.comm.traffic.sent
        pending = self.flags.reduce(bad)
        return Agreed(pending=pending, control=self.flags.comm.traffic.sent - sent)


class AgreeLater(AgreeFirst):
    """The step in parts: each part's allreduce issued now, every part's read at the step's end."""

    undoes = True

    def open(self, bad: torch.Tensor | None, device: torch.device, carries: bool) -> Agreed:
        return self._reduce(bad)


class AgreeInMessage:
    """``sync.pack=all``: the flags ride in the compressor's message (``carries``), or, for a part without a
    compressed tensor, agree by ``fallback``."""

    undoes = True

    def __init__(self, flags: Flags, fallback: AgreeFirst, value_bytes: int) -> None:
        self.flags, self.fallback, self.value_bytes = flags, fallback, value_bytes

    def open(self, bad: torch.Tensor | None, device: torch.device, carries: bool) -> Agreed:
        if not carries:
            return self.fallback.open(bad, device, carries)
        carry = self.flags.take(bad, device)
        return Agreed(carry=carry, control=carry.numel() * self.value_bytes)


Agreement = AgreeFirst | AgreeInMessage


def build_agreement(flags: Flags, parts: bool, in_message: bool, value_bytes: int) -> Agreement:
    """The strategy for a step given whole (``parts`` False) or in parts, flags ``in_message`` or not."""
    own = AgreeLater(flags) if parts else AgreeFirst(flags)
    return AgreeInMessage(flags, own, value_bytes) if in_message else own


__all__ = ["AGREEMENT_BYTES", "REQUESTS", "AgreeFirst", "AgreeInMessage", "AgreeLater", "Agreed", "Flags", "read"]
