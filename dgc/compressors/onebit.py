"""1-bit exchange with error feedback, for the small tensors a sparse compressor leaves dense.

At density 0.001 a sparse method sends one or two values of a BatchNorm or bias tensor per step,
while sending those tensors dense (ResNet-50: 54k values) costs more bytes than all the sparse
values together. :class:`OneBit` sends every value of them every step at one bit each: per tensor
the sign of ``x = g + e`` (``e``: what earlier steps did not send) and one scale, the mean of
``|x|`` (the scale that minimizes ``|x - s sign(x)|``); ``e`` becomes ``x - s sign(x)``, so nothing
is lost, only delayed (1-bit SGD, Seide et al. 2014; error feedback as in Karimireddy et al. 2019).

One message per worker: the scales (fp32, one per tensor) and the sign bits of all the tensors
packed 8 per byte (bit set: ``x >= 0``), the same size on every worker, exchanged with one
allgather; every worker decodes all messages and averages them. Selected by
``Policy(dense_values="1bit")`` in :class:`dgc.GradientSync`; not a compressor of its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dgc import bits
from dgc.bucket import Buckets
from dgc.collectives import Allgather, Steps
from dgc.compressors.base import Compressor, CompressorConfig, Item
from dgc.memory import Memory, Residual
from dgc.timing import Phases


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 per uint8 (:func:`dgc.bits.pack`)."""
    return bits.pack(x >= 0, 1)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``n`` signs of :func:`pack_signs` (of each row) as +1 / -1."""
    return bits.unpack(packed, n, 1).to(dtype).mul_(2).sub_(1)


class OneBit(Compressor):
    """Signs and one scale per tensor, with error feedback (see the module docstring)."""

    name: ClassVar[str] = "1bit"

    def __init__(self, config: CompressorConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.buckets = Buckets()

    def make_memory(self) -> Memory:
        return Residual()

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        sizes = [it.grad.numel() for it in items]
        with phases("compress"):
            bucket = self.buckets.of("1bit", items)
            bucket.adopt(self.state, self.memory.keys)
            x = self.memory.compensate(bucket.gather(items), bucket.buffers)  # g + e
            counts = torch.tensor(sizes, device=x.device)
            scales = torch.stack([p.abs().mean() for p in x.split(sizes)]).float()
            sent = torch.where(x >= 0, 1.0, -1.0).to(x.dtype).mul_(torch.repeat_interleave(scales, counts))
            self.memory.update(bucket.buffers, sent)  # e = g + e - sent: what was not sent
            message = torch.cat([scales.view(torch.uint8), pack_signs(sent)])
        rows = yield Allgather(message)
        with phases("decompress"):
            t = len(items)
            all_scales = rows[:, : 4 * t].reshape(-1).view(torch.float32).view(-1, t)  # [world, tensors]
            all_signs = unpack_signs(rows[:, 4 * t :], x.numel())  # [world, n]
            mean = (all_signs * torch.repeat_interleave(all_scales, counts, dim=1)).mean(0)
            bucket.scatter(items, mean)

    @staticmethod
    def message_bytes(numels: list[int]) -> int:
        """Bytes each worker sends for tensors of these sizes."""
        return 4 * len(numels) + (sum(numels) + 7) // 8
