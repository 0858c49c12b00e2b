"""One optimizer step with its exchange, the same call in every mode: :class:`EveryStep` and :class:`Stepped`.

Where the exchange happens differs by mode; what the training loop calls does not::

    stepper = dgc.EveryStep(sync, optimizer)              # the exchange before every update (library path)
    stepper = dgc.EveryStep(sync, optimizer, hooked=True) # DDP's comm hook exchanged during backward()
    stepper = dgc.LocalSteps(sync, every=16, optimizer=inner)  # DiLoCo / SparseLoCo: every 16th step
    for batch in data:
        loss(model, batch).backward()
        stepped = stepper.step()                          # the update is skipped when stepped.skipped
        optimizer.zero_grad()

``step(before_update=..., last=...)`` takes what runs between the exchange and the update (the dense baseline's
global clipping) and whether this is the run's last step (local steps then exchange early, so that the run ends on
weights every worker holds). A step the exchange skipped (a non-finite gradient) does not step the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgc.stats import StepStats
from dgc.sync import GradientSync


@dataclass(frozen=True)
class Stepped:
    """What one optimizer step exchanged: ``stats`` every step, ``outer`` on the steps that sent local steps'
    pseudo-gradient."""

    #: the step's exchange (with local steps: this worker's own non-finite check, nothing sent)
    stats: StepStats
    #: local steps: the exchange of the pseudo-gradient and the outer step (None on the other steps)
    outer: StepStats | None = None

    @property
    def skipped(self) -> bool:
        """The optimizer did not step: a non-finite gradient (some worker's, or with local steps this one's)."""
        return self.stats.skipped

    @property
    def outer_skipped(self) -> bool:
        """Local steps: the pseudo-gradient was not finite on some worker: every worker went back to the weights
        last agreed on."""
        return self.outer is not None and self.outer.skipped

    def _both(self) -> tuple[StepStats, ...]:
        return (self.stats,) if self.outer is None else (self.stats, self.outer)

    @property
    def sent_bytes(self) -> int:
        return sum(s.sent_bytes for s in self._both())

    @property
    def communicate_s(self) -> float:
        return sum(s.communicate_s for s in self._both())

    @property
    def exchange_s(self) -> float:
        """Compression, communication and decompression, both exchanges."""
        return sum(s.compress_s + s.communicate_s + s.decompress_s for s in self._both())

    @property
    def requests(self) -> tuple[str, ...]:
        """What any worker requested, agreed by all (with local steps: at the exchange)."""
        return tuple(sorted({r for s in self._both() for r in s.requests}))


class EveryStep:
    """The exchange of every step's gradient, then the optimizer's update (skipped when the exchange was).

    Args:
        sync: the exchange.
        optimizer: what steps on the averaged gradient.
        hooked: DDP's comm hook (:func:`dgc.ddp_comm_hook`) already exchanged during ``backward()``: read what it
            did (:attr:`GradientSync.last`) instead of exchanging again.
    """

    def __init__(self, sync: GradientSync, optimizer: torch.optim.Optimizer, hooked: bool = False) -> None:
        self.sync = sync
        self.optimizer = optimizer
        self.hooked = hooked

    def step(self, before_update: Callable[[], None] | None = None, last: bool = False) -> Stepped:
        """Exchange (or read the hook's exchange), then ``before_update()`` and the optimizer's step unless the
        exchange skipped the step. ``last`` changes nothing here (every step is an exchange)."""
        if self.hooked:
            stats = self.sync.last
            if stats is None:
                raise RuntimeError(
                    "EveryStep(hooked=True): no exchange ran in backward(): register the sync as the DDP model's comm "
                    "hook (net.register_comm_hook(sync, dgc.ddp_comm_hook))"
                )
        else:
            stats = self.sync.step()
        update(self.optimizer, stats.skipped, before_update)
        return Stepped(stats)


def update(optimizer: torch.optim.Optimizer, skipped: bool, before_update: Callable[[], None] | None) -> None:
    """The optimizer's step after an exchange: none when the exchange skipped it."""
    if skipped:
        return
    if before_update is not None:
        before_update()
    optimizer.step()


__all__ = ["EveryStep", "Stepped"]
