"""Local steps: every H steps exchange the pseudo-gradient, not every step's gradient (DiLoCo, SparseLoCo).

What is exchanged and how it is compressed are two separate choices. Per-step training exchanges each step's
gradient through a :class:`~dgc.sync.GradientSync`; with local steps each worker instead runs ``every`` (H) steps
of its own optimizer (the *inner* one, the task's) on its own data, and then the workers exchange, through the very
same :class:`~dgc.sync.GradientSync` (its compressor, exchange, non-finite guard and byte accounting), the
pseudo-gradient

    delta = theta_synced - theta_local

(how far each worker moved from the weights they last agreed on). An *outer* SGD steps ``theta_synced`` with the
averaged ``delta`` as its gradient and every worker starts the next H steps from the result. So:

* **DiLoCo** (Douillard et al. 2023, arXiv 2311.08105) is local steps x a dense compressor (``none``; ``bf16`` or
  ``fp16`` for 16-bit pseudo-gradients), outer SGD with Nesterov momentum (lr 0.7, momentum 0.9: the paper's);
* **SparseLoCo** (Sarfi et al. 2025, arXiv 2508.15706) is local steps x the ``sparseloco`` compressor (decaying
  error feedback, chunk-wise top-k, 2-bit values), outer SGD without momentum (the decaying buffer is the momentum);
* any other compressor that does not keep the optimizer's momentum composes the same way (``topk``, ``powersgd``,
  ``qsgd``, ...). DGC with momentum correction is refused: its momentum and masking act on each step's gradient.

Usage (library path; the trainer does the same with ``local_steps.every=H``)::

    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = dgc.LocalSteps(sync, every=16, optimizer=inner)  # after every worker holds the same initial weights
    for batch in data:
        loss(model, batch).backward()
        local.step()        # the inner step (skipped on this worker's own non-finite gradient, nothing sent);
        inner.zero_grad()   # every 16th call also the exchange and the outer step

:meth:`LocalSteps.step` is :meth:`before_step`, the inner optimizer's step and :meth:`after_step`, the call
:class:`dgc.EveryStep` makes for per-step exchanges (one loop shape, :mod:`dgc.stepping`); the two halves stay
public for loops that step the inner optimizer themselves.

Between exchanges the workers' weights differ; :meth:`LocalSteps.synced` swaps the weights last agreed on in (for
evaluation). A checkpoint holds each worker's own weights and inner optimizer state besides :meth:`state_dict`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dgc.compressors.base import check_int, check_number
from dgc.stats import StepStats
from dgc.stepping import Stepped, update
from dgc.sync import GradientSync


@dataclass
class LocalStepsConfig:
    """The ``local_steps`` config: ``every`` 0 exchanges every step's gradient (no local steps)."""

    #: H: inner steps between exchanges of the pseudo-gradient (0: off, each step's gradient is exchanged)
    every: int = 0
    #: the outer SGD's learning rate (DiLoCo: 0.7)
    outer_lr: float = 0.7
    #: the outer SGD's momentum (DiLoCo: 0.9; SparseLoCo: 0)
    outer_momentum: float = 0.9
    #: Nesterov momentum in the outer SGD (DiLoCo: true; needs outer_momentum > 0)
    outer_nesterov: bool = True

    def __post_init__(self) -> None:
        check_int(self.every, "local_steps.every", 0)
        check_number(self.outer_lr, "local_steps.outer_lr", 0.0, 1e3)
        check_number(self.outer_momentum, "local_steps.outer_momentum", 0.0, 1.0, low_open=False, high_open=True)
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError("local_steps.outer_nesterov=true needs local_steps.outer_momentum > 0")

    def build(self, sync: GradientSync, optimizer: torch.optim.Optimizer | None = None) -> LocalSteps:
        return LocalSteps(sync, self.every, self.outer_lr, self.outer_momentum, self.outer_nesterov, optimizer)


class LocalSteps:
    """Inner steps, then the pseudo-gradient through ``sync`` and an outer SGD step (see the module docstring).

    Args:
        sync: the exchange of the pseudo-gradients, built on the model (its parameters' names key the state).
        every: H, inner steps between exchanges (>= 1).
        outer_lr, outer_momentum, outer_nesterov: the outer SGD's.
        optimizer: the inner optimizer :meth:`step` steps (each worker's own, on its own data).
    """

    def __init__(
        self,
        sync: GradientSync,
        every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        check_int(every, "local_steps.every", 1)
        compressor = sync.compressor
        if compressor.owns_momentum:
            raise ValueError(
                f"local steps exchange a pseudo-gradient, but compressor {compressor.name!r} keeps the optimizer's "
                "momentum (momentum correction acts on each step's gradient): use it with momentum_correction=false, "
                "or another compressor (none, bf16, sparseloco, topk, ...)"
            )
        if sync.clip_norm is not None:
            raise ValueError("local steps clip nothing across workers: set sync.clip_norm=null (clip the inner "
                             "optimizer's own gradient with optim.grad_clip)")  # fmt: skip
        if sync.accumulate != "gradients":
            raise ValueError("local steps exchange a pseudo-gradient (already a sum of rate-scaled updates): "
                             "set sync.accumulate=gradients")  # fmt: skip
        self.sync = sync
        self.every = every
        self.optimizer = optimizer
        self.params = [p for _, p in sync.params]
        with torch.no_grad():
            #: the weights the workers last agreed on (theta_synced): what the outer optimizer steps
            self.anchor = [p.detach().clone() for p in self.params]
        #: the pseudo-gradients, exchanged in place (the anchors' .grad for the outer step)
        self.delta = [torch.zeros_like(p) for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_nesterov)
        #: inner steps since the last exchange
        self.since = 0
        #: exchanges done
        self.rounds = 0

    def step(self, before_update: Callable[[], None] | None = None, last: bool = False) -> Stepped:
        """One inner step: this worker's own check, ``before_update()`` and the inner optimizer's step unless the
        check skipped it, then on the H-th step (or ``last``, the run's last step) the exchange and the outer step
        (:attr:`Stepped.outer`)."""
        if self.optimizer is None:
            raise ValueError(
                "LocalSteps.step() steps the inner optimizer: build it with LocalSteps(sync, every, optimizer=inner), "
                "or call before_step() and after_step() around your own step"
            )
        stats = self.before_step()
        update(self.optimizer, stats.skipped, before_update)
        return Stepped(stats, self.after_step(force=last))

    def before_step(self) -> StepStats:
        """Before the inner optimizer steps: this worker's own check, nothing sent (:meth:`GradientSync.check_local`):
        a non-finite gradient skips this worker's inner step only (the others step on their own data, as they do
        between exchanges anyway). Requests ("stop", "checkpoint") are agreed at the next exchange, the only
        collective of a round: between regions a per-step agreement would cost 2 (N-1) message latencies every
        step, what local steps exist to avoid."""
        return self.sync.check_local()

    def after_step(self, force: bool = False) -> StepStats | None:
        """After the inner optimizer stepped: the exchange and the outer step when this is the H-th step since the
        last one (or ``force``: e.g. the run's last step, so that it ends on weights every worker holds); None on the
        other steps."""
        self.since += 1
        if self.since < self.every and not force:
            return None
        return self.exchange()

    def exchange(self) -> StepStats:
        """Average the pseudo-gradients, step the outer optimizer and start every worker from its result. When the
        pseudo-gradient is not finite on some worker (:class:`StepStats.skipped`), the outer step is skipped and
        every worker goes back to the weights last agreed on."""
        with torch.no_grad():
            torch._foreach_copy_(self.delta, self.anchor)
            torch._foreach_sub_(self.delta, self.params)
        stats = self.sync.sync(list(zip(self.params, self.delta)))
        if not stats.skipped:
            for anchor, delta in zip(self.anchor, self.delta):
                anchor.grad = delta
            self.outer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.anchor)
        self.since = 0
        self.rounds += 1
        return stats

    @contextlib.contextmanager
    def synced(self) -> Iterator[None]:
        """The weights last agreed on in the model for the duration (evaluation between exchanges); this worker's
        own weights back afterwards."""
        if self.since == 0:
            yield
            return
        with torch.no_grad():
            mine = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, mine)

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The synced weights, the outer optimizer and the step count (the same on every worker); each worker's own
        weights and inner optimizer are the caller's to save."""
        names = [n for n, _ in self.sync.params]
        return {
            "anchor": {n: a.detach().clone() for n, a in zip(names, self.anchor)},
            "outer": self.outer.state_dict(),
            "since": self.since,
            "rounds": self.rounds,
            "every": self.every,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [n for n, _ in self.sync.params]
        missing = sorted(set(names) - set(state["anchor"]))
        if missing:
            raise ValueError(f"local steps state has no synced weights for {', '.join(missing[:3])}: saved from "
                             "another model")  # fmt: skip
        with torch.no_grad():
            for n, a in zip(names, self.anchor):
                a.copy_(state["anchor"][n])
        self.outer.load_state_dict(state["outer"])
        self.since, self.rounds = int(state["since"]), int(state["rounds"])


__all__ = ["LocalSteps", "LocalStepsConfig"]
