"""Fault injection for tests: faults named in ``DGC_FAULTS`` fire at given steps of given ranks.

Only for testing how runs survive failures; nothing is installed unless the variable is set. The
entry point (:mod:`dgc.train`) passes :func:`from_env`'s callbacks to the trainer, which calls them
after each backward pass and each step; the training loop itself knows no fault.

``DGC_FAULTS`` is a comma-separated list of ``KIND@STEP`` or ``KIND@STEP:RANK`` (default: every rank):

* ``kill@5``: SIGKILL this process after step 5 (after its log line and periodic checkpoint).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

ENV = "DGC_FAULTS"
KINDS = ("kill",)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None

    def applies(self, trainer: Any) -> bool:
        return trainer.step == self.step and self.rank in (None, trainer.info.rank)

    def after_step(self, trainer: Any) -> None:
        if self.applies(trainer) and self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


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
    return parse(os.environ.get(ENV, ""))
