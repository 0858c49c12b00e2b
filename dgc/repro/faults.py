"""Fault injection for tests: faults named in ``DGC_FAULTS`` fire at given steps of given ranks.

Only for testing how runs survive failures; nothing is installed unless the variable is set. The
entry point (:mod:`dgc.train`) passes :func:`from_env`'s callbacks to the trainer, which calls them
after each backward pass and each step; the training loop itself knows no fault.

``DGC_FAULTS`` is a comma-separated list of ``KIND@STEP`` or ``KIND@STEP:RANK`` (default: every rank):

* ``kill@5``: SIGKILL this process after step 5 (after its log line and periodic checkpoint);
* ``term@5``, ``usr1@5``: send this process SIGTERM / SIGUSR1 after step 5 (a preemption, Slurm's warning);
* ``stall@5``: SIGSTOP this process after step 5 (a hung rank: the others time out);
* ``nan@5``, ``inf@5``: put a NaN / an Inf into one gradient value of step 5, before the exchange;
* ``naninput@5``: put a NaN into one value of step 5's input (a corrupt sample: the forward pass turns the
  BatchNorm statistics NaN, then the gradient).

Steps count from 1: ``@5`` is the fifth optimizer step. Under torchrun, faults fire in the first attempt
only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted job runs clean.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

ENV = "DGC_FAULTS"
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "usr1": signal.SIGUSR1, "stall": signal.SIGSTOP}
VALUES = {"nan": float("nan"), "inf": float("inf")}
KINDS = (*SIGNALS, *VALUES, "naninput")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    #: the input's poison hook while its step runs (naninput)
    hooks: list = field(default_factory=list, compare=False, repr=False)

    def applies(self, trainer: Any, step: int) -> bool:
        return step == self.step and self.rank in (None, trainer.info.rank)

    def before_step(self, trainer: Any) -> None:
        if self.kind == "naninput" and self.applies(trainer, trainer.step + 1):

            def poison(module: Any, args: tuple) -> tuple:
                first = args[0].clone()
                first.view(-1)[0] = float("nan")
                return (first, *args[1:])

            self.hooks.append(trainer.model.register_forward_pre_hook(poison))

    def after_backward(self, trainer: Any) -> None:
        while self.hooks:
            self.hooks.pop().remove()
        # during step N the trainer's counter still says N - 1
        if self.kind in VALUES and self.applies(trainer, trainer.step + 1):
            grad = next(p.grad for p in trainer.model.parameters() if p.grad is not None)
            grad.view(-1)[0] = VALUES[self.kind]

    def after_step(self, trainer: Any) -> None:
        if self.kind in SIGNALS and self.applies(trainer, trainer.step):
            os.kill(os.getpid(), SIGNALS[self.kind])


def parse(text: str) -> list[Fault]:
    """The faults of a ``DGC_FAULTS`` value; a ValueError naming the valid form otherwise."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV}: bad fault {item!r}; the form is KIND@STEP[:RANK] with KIND one of {KINDS}")
        faults.append(Fault(kind, int(step), int(rank) if rank else None))
    return faults


def from_env() -> list[Fault]:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    return parse(os.environ.get(ENV, ""))
