"""The agreement before every step: whether any worker's gradient is not finite, and what any worker requested.

One small MAX allreduce (a byte per flag; under the hierarchical exchange, one inside the machine and one between
machines: :meth:`dgc.exchanges.Exchange.agree_max_`) settles both, so that every worker skips the same steps and
stops or checkpoints at the same step boundary; the non-finite check rides on the gradient norms the step computes
anyway for local clipping (one ``_foreach_norm``) and is read on the host together with the requests (one host
synchronization for both).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dgc.comm import Comm

#: what a worker can ask all workers to do at the next step boundary (:meth:`GradientSync.request`): stop, write
#: a checkpoint, or end the run as diverged (local steps, where each worker skips its own non-finite steps)
REQUESTS = ("stop", "checkpoint", "diverged")
#: the bytes of the agreement's allreduce: a byte per flag (non-finite, then each of :data:`REQUESTS`); what the cost
#: models (:mod:`dgc.costmodel`, :mod:`dgc.repro.frontier_cost`) price before every exchange
AGREEMENT_BYTES = 1 + len(REQUESTS)


class StepGuard:
    """Non-finite gradients and requests of one :class:`~dgc.sync.GradientSync` (see the module docstring)."""

    def __init__(self, comm: Comm, check_finite: bool = True,
                 reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        self.comm = comm
        self.check_finite = check_finite
        #: the agreement's collective: the element-wise maximum over every worker, in place (by default one allreduce
        #: over ``comm``; the exchange's own, :meth:`dgc.exchanges.Exchange.agree_max_`, under GradientSync)
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

    def flags(self, bad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """This worker's flags on ``device``: non-finite (``bad``), then one per request (uint8, 0 or 1); the requests
        are taken (the next flags start without them)."""
        requested = torch.tensor([r in self._requested for r in REQUESTS], dtype=torch.uint8, device=device)
        self._requested.clear()
        flag = torch.zeros(1, dtype=torch.uint8, device=device) if bad is None else bad.to(device, torch.uint8).view(1)
        return torch.cat([flag, requested])

    @staticmethod
    def read(agreed: torch.Tensor) -> tuple[bool, tuple[str, ...]]:
        """Whether any worker's gradient was not finite, and what any worker requested, from the workers' flags
        reduced by maximum or mean (a flag above 0: some worker raised it). One host read."""
        values = agreed.tolist()
        return values[0] > 0, tuple(r for r, f in zip(REQUESTS, values[1:]) if f > 0)

    def reduce(self, bad: torch.Tensor | None) -> torch.Tensor:
        """Every worker's flags reduced by maximum (one small MAX), left on the device: :meth:`read` says whether any
        worker's gradient was not finite and what any worker requested."""
        return self.reduce_max(self.flags(bad, self.comm.device))
