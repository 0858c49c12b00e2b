"""The optimizer side of DGC: momentum SGD that knows which momenta the compressor keeps.

With momentum correction, DGC keeps the momentum of each compressed tensor in
its own state on every worker and sends (a sparse part of) the accumulated
velocity. The averaged gradient of such a tensor is therefore already the
update direction, and the optimizer must only apply the learning rate:
``w -= lr * G``. Every other tensor (those sent dense, and all tensors of the
other compressors) gets ordinary ``torch.optim.SGD`` momentum, Nesterov and
weight decay, applied to the averaged gradient. Weight decay of compressed
tensors is added locally before compression by the :class:`~dgc.sync.GradientSync`;
the learning rate is always applied after aggregation, so schedules need no
special care.

Usage::

    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.001))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, weight_decay=1e-4)
    ...
    loss.backward(); sync.step(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from dgc.sync import GradientSync


class SGD(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        sync: GradientSync,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nesterov and momentum <= 0:
            raise ValueError("nesterov needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))
        self.sync = sync
        self._skipped_step = -1
        self._seen: object = None  # the sync's StepStats of the last step taken
        self._loaded = False  # load_state_dict ran: a resumed run
        sync.bind_optimizer(self)  # each step, the sync reads momentum, weight decay and lr from param_groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._loaded = True

    def _check_sync(self) -> None:
        """One line for the wirings that would otherwise train on silently, wrong."""
        last = self.sync.last
        has_grads = any(p.grad is not None for g in self.param_groups for p in g["params"])
        if has_grads and (last is None or last is self._seen):
            raise RuntimeError(
                "dgc.SGD.step: the gradient sync did not run for this step: call sync.step() after backward(), "
                "or register the hook on the DDP model: ddp.register_comm_hook(sync, dgc.ddp_comm_hook) "
                "(Lightning registers ddp_comm_hook only on CUDA; Accelerate's comm_hook takes only its own hooks)"
            )
        if self._seen is None and self._loaded and not self.sync.restored and self.sync.compressor.state:
            warnings.warn(
                "dgc.SGD: the optimizer's state was loaded (a resumed run), but the gradient sync's was not: "
                "its residuals and momenta start again from zero; save every rank's sync.state_dict() with the "
                "checkpoint and load it with sync.load_state_dict()",
                stacklevel=3,
            )
        if has_grads:
            self._seen = last

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_sync()
        last = self.sync.last
        if last is not None and last.skipped and last.step != self._skipped_step:
            # the exchange skipped this step (a worker's gradient was not finite): no update at all
            self._skipped_step = last.step
            return loss
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.sync.owns_momentum(p):
                    p.add_(p.grad, alpha=-lr)
                    continue
                d_p = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                if momentum:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d_p.detach().clone()
                    else:
                        buf.mul_(momentum).add_(d_p)
                    d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.add_(d_p, alpha=-lr)
        return loss
