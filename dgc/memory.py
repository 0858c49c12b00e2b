"""Error feedback, written once: what a compressor did not send is kept and added to the next step's gradient.

A memory works on flat buffers of one shape: a tensor's own state or a bucket's (:mod:`dgc.bucket`), passed as
``buffers`` (a dict from the memory's :attr:`~Memory.keys` to tensors, which the compressor keeps per parameter
name for checkpoints). Around the encoding, two calls:

* :meth:`~Memory.compensate` before: the accumulator to encode, ``g + e``, made in place in the memory's buffer;
* after: :meth:`~Memory.sent` for a sparse selection (the sent values leave the accumulator at their positions;
  what the wire's value type could not carry stays), or :meth:`~Memory.update` for a dense approximation
  (``e = acc - sent``).

:class:`Residual` is the error feedback of Gradient Dropping (topk), 1-bit SGD and PowerSGD (Karimireddy et al.
2019); :class:`MomentumCorrection` is DGC's, where the accumulator ``v`` sums momentum ``u`` instead of the
gradient and momentum factor masking clears ``u`` where ``v`` was sent (Lin et al. 2018, eqs. 6-7).
"""

from __future__ import annotations

from typing import ClassVar

import torch

Buffers = dict[str, torch.Tensor]


class Memory:
    """Error feedback on the buffer ``keys[-1]`` (the accumulator). This base keeps no buffers (``keys`` is empty):
    it is the memory of the compressors without error feedback (dense, QSGD, TernGrad), which never call it."""

    keys: ClassVar[tuple[str, ...]] = ()

    def compensate(
        self, g: torch.Tensor, buffers: Buffers, momentum: float = 0.0, nesterov: bool = False
    ) -> torch.Tensor:
        """Fold the gradient ``g`` (flat) into the accumulator and return it (a view of ``buffers``)."""
        raise NotImplementedError

    def sent(self, buffers: Buffers, positions: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
        """The accumulator's values at ``positions``, as the wire carries them (``value_dtype``: 16-bit values are
        clamped to the largest finite one and rounded), which leave the accumulator: the rounding error and a
        clamped excess stay in it. Returned in the accumulator's dtype."""
        acc = buffers[self.keys[-1]]
        values = acc[positions]
        if value_dtype != torch.float32:
            limit = torch.finfo(value_dtype).max
            values.clamp_(-limit, limit)
            values = values.to(value_dtype).to(acc.dtype)
            acc[positions] -= values
        else:
            acc.index_fill_(0, positions, 0)
        return values

    def update(self, buffers: Buffers, sent: torch.Tensor) -> None:
        """What was sent (dense, the accumulator's shape) leaves the accumulator: ``e = acc - sent``."""
        buffers[self.keys[-1]].sub_(sent)


class Residual(Memory):
    """``e = decay * e + g`` before; the residual ``e`` (stored under ``key``) is the accumulator. ``decay`` 1 (the
    default) is plain error feedback; SparseLoCo's buffer decays (``beta``, e.g. 0.95), so what was never sent fades
    and the buffer doubles as the outer momentum."""

    def __init__(self, key: str = "residual", decay: float = 1.0) -> None:
        self.keys = (key,)  # type: ignore[misc]
        self.decay = decay

    def compensate(
        self, g: torch.Tensor, buffers: Buffers, momentum: float = 0.0, nesterov: bool = False
    ) -> torch.Tensor:
        e = buffers[self.keys[0]]
        if self.decay != 1.0:
            e.mul_(self.decay)
        return e.add_(g)


class MomentumCorrection(Memory):
    """DGC's: momentum ``u`` and accumulator ``v``. ``u = m u + g``, ``v += u`` (Nesterov: ``u = m (u + g)``,
    ``v += u + g``); with ``correction=False`` plain error feedback on ``v``. ``masking``: where ``v`` is sent,
    ``u`` is cleared too (momentum factor masking)."""

    def __init__(self, correction: bool = True, masking: bool = True) -> None:
        self.correction, self.masking = correction, masking
        self.keys = ("u", "v") if correction else ("v",)  # type: ignore[misc]

    def compensate(
        self, g: torch.Tensor, buffers: Buffers, momentum: float = 0.0, nesterov: bool = False
    ) -> torch.Tensor:
        v = buffers["v"]
        if not self.correction:
            return v.add_(g)
        u = buffers["u"]
        if nesterov:
            u.add_(g).mul_(momentum)
            v.add_(u).add_(g)
        else:
            torch.add(g, u, alpha=momentum, out=u)
            v.add_(u)
        return v

    def sent(self, buffers: Buffers, positions: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
        values = super().sent(buffers, positions, value_dtype)
        if self.correction and self.masking:
            buffers["u"].index_fill_(0, positions, 0)
        return values


__all__ = ["Memory", "MomentumCorrection", "Residual"]
