"""Local gradient clipping (the paper's section 3.2), before anything is accumulated.

A residual keeps unsent gradient for hundreds of steps, so clipping the averaged gradient would come too late: each
worker clips its own, without waiting for the others. ``clip_norm`` is the dense run's clip of the *averaged*
gradient: N local gradients of norm ``c * sqrt(N)`` average to about ``c``, so each worker clips at
``clip_norm * N**0.5`` (the paper's ``N**-0.5`` scales a worker's share of a *summed* gradient; docs/design.md).

Scopes: ``step`` bounds the norm of the worker's whole gradient (the serial step, which holds every tensor);
``tensor`` clips each tensor to its share of the same bound, ``limit * (numel / total numel)**0.5``, so a gradient
whose every tensor is at its bound has exactly the whole-gradient bound (the overlapped hook, which sends each bucket
as it is ready).
"""

from __future__ import annotations

import torch


def clip_local(grads: list[torch.Tensor], norms: list[torch.Tensor], limit: float, scope: str,
               total_numel: int) -> None:  # fmt: skip
    """Scale ``grads`` in place to global norm at most ``limit`` (``scope="step"``), or each to its share of it
    (``"tensor"``). ``norms`` are the gradients' own, finite (a non-finite gradient skips the step first)."""
    if not grads:
        return
    if scope == "tensor":
        shares = torch.tensor([g.numel() / total_numel for g in grads], dtype=norms[0].dtype, device=norms[0].device)
        scales = torch.clamp(limit * shares.sqrt_() / (torch.stack(norms) + 1e-6), max=1.0)
        torch._foreach_mul_(grads, list(scales.to(grads[0].dtype).unbind()))
        return
    scale = torch.clamp(limit / (torch.linalg.vector_norm(torch.stack(norms)) + 1e-6), max=1.0)
    torch._foreach_mul_(grads, scale)
