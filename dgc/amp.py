"""fp16 mixed precision with ``torch.amp.GradScaler`` and a :class:`~dgc.sync.GradientSync`.

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    dgc.amp.unscale_(scaler, optimizer, sync)  # instead of scaler.unscale_(optimizer)
    sync.step()                                # DGC accumulates the unscaled gradients
    scaler.step(optimizer)                     # optimizer = dgc.SGD(model.parameters(), sync, ...)
    scaler.update()

Two things make the plain recipe wrong with DGC:

1. The exchange must see *unscaled* gradients: DGC's momentum and residual add up gradients over many
   steps, and a loss scale that changes between them (it grows every ``growth_interval`` steps and halves
   on an overflow) would weigh them differently. So the gradients are unscaled before ``sync.step()``.
2. ``GradScaler`` looks for inf/NaN on each rank alone. When one rank overflows, the others would step
   and grow their scale while it skips and backs off, and the ranks' scales, and then their models,
   part. :func:`unscale_` first agrees with every rank whether any rank's scaled gradient is not finite
   (one byte, the same MAX the sync's own check uses) and, if one is, makes it so on every rank; then
   every rank's ``scaler.unscale_`` finds it, every ``sync.step()`` skips the step before anything
   enters the momentum or the residual, every ``scaler.step`` skips, and every ``scaler.update`` backs
   off the same way.

bf16 autocast needs none of this (no loss scale): it stays the trainer's default on CUDA.
"""

from __future__ import annotations

import torch

from dgc.sync import GradientSync


def unscale_(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, sync: GradientSync) -> bool:
    """``scaler.unscale_(optimizer)`` with the overflow check agreed by every rank of ``sync``'s group.
    Returns whether the step overflowed on some rank (then every rank skips it)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    comm = sync.comm
    if grads:
        finite = torch.stack([g.isfinite().all() for g in grads]).all()
        flag = (~finite).to(torch.uint8).view(1)
    else:
        flag = torch.zeros(1, dtype=torch.uint8, device=comm.device)
    overflow = bool(comm.allreduce_max_(flag)[0])  # one host read per step, as GradScaler's own
    if overflow and grads and bool(finite):
        grads[0].view(-1)[0] = float("inf")  # another rank overflowed: so does this one
    scaler.unscale_(optimizer)
    return overflow
