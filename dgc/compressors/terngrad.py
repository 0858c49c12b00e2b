"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternary gradients, 2 bits per value.

Per tensor: optionally clip g to ``clip_sigma`` standard deviations; the scale
``s`` is the maximum ``|g|`` over all workers (one small MAX allreduce, the
paper's scaler sharing); each entry becomes ``s * sign(g) * b`` with
``b ~ Bernoulli(|g| / s)``, an unbiased estimate. The ternary codes are packed
four to a byte (:mod:`dgc.bits`) and allgathered; every worker sums them and divides by N.

The tensors are laid end to end in one flat bucket (:mod:`dgc.bucket`), so a step is a fixed number of
operations whatever the number of tensors: the per-tensor statistics are segment reductions
(``torch.segment_reduce`` for the sums of the standard deviation, one ``_foreach_norm`` for the maxima),
expanded back over the bucket with ``repeat_interleave`` at a known output size (no host synchronization),
and one random draw, one packing and one unpacking serve every tensor. The codes of all tensors are packed
as one stream (padding only at its end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import bits
from dgc.bucket import Bucket, Buckets
from dgc.collectives import Allgather, AllreduceMax, Steps
from dgc.compressors.base import CompressorConfig, Item, Stochastic, register
from dgc.timing import Phases


@dataclass
class TernGradConfig(CompressorConfig):
    name: str = "terngrad"
    #: clip each tensor to this many standard deviations before quantizing (null: no clipping)
    clip_sigma: float | None = 2.5
    seed: int = 0

    def __post_init__(self) -> None:
        bad = isinstance(self.clip_sigma, bool) or not isinstance(self.clip_sigma, int | float | None)
        if bad or (self.clip_sigma is not None and (math.isnan(self.clip_sigma) or self.clip_sigma <= 0)):
            raise ValueError(f"clip_sigma must be a number > 0 or null, got {self.clip_sigma!r}")


@register
class TernGrad(Stochastic):
    name: ClassVar[str] = "terngrad"
    config_class = TernGradConfig
    config: TernGradConfig

    def __init__(self, config: TernGradConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.clip_sigma = self.config.clip_sigma
        self.buckets = Buckets()

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        with phases("compress"):
            bucket = self.buckets.of("terngrad", items)
            x = bucket.gather(items)
            if self.clip_sigma is not None:
                bound = _expand(self.clip_sigma * _segment_std(x, bucket), bucket)
                torch.clamp(x, -bound, bound, out=x)
            # per tensor max |g|: the inf-norm of each tensor, one dispatch
            scales = torch.stack(torch._foreach_norm(bucket.grad_views, float("inf"))).to(torch.float32)
        yield AllreduceMax(scales)
        with phases("compress"):
            prob = x.abs().div_(_expand(scales.clamp_min(1e-30).to(x.dtype), bucket))
            rand = torch.rand(x.numel(), generator=self.generator_on(x.device), device=x.device)
            codes = (torch.sign(x) * (rand < prob)).to(torch.int8).add_(1)
            message = bits.pack(codes, 2)
            phases.counters["values_sent"] += x.numel()
        rows = yield Allgather(message)
        with phases("decompress"):
            workers = rows.shape[0]
            # codes are t + 1: their sum over workers, less one per worker, is the sum of the ternary values
            total = bits.unpack(rows, x.numel(), 2).sum(0, dtype=x.dtype).sub_(workers)
            total.mul_(_expand((scales / workers).to(x.dtype), bucket))
            bucket.scatter(items, total)


def _expand(per_tensor: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """A value per tensor repeated over that tensor's part of the bucket."""
    return per_tensor.repeat_interleave(bucket.numels_t, output_size=bucket.layout.total)


def _segment_std(x: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """Each tensor's standard deviation (unbiased, two passes), ``inf`` for a tensor of one value (not clipped).

    Summed in float64: a segment reduction adds its values in order (on the CPU), and a float32 sum of a few
    million values in order is off by ~1e-4 of itself; in float64 the result is ``torch.std``'s to its rounding."""
    n = bucket.numels_t.to(torch.float64)
    x64 = x.to(torch.float64, copy=True)
    mean = torch.segment_reduce(x64, "sum", lengths=bucket.numels_t).div_(n)
    dev = x64.sub_(_expand(mean, bucket)).square_()
    var = torch.segment_reduce(dev, "sum", lengths=bucket.numels_t).div_(n - 1)
    return torch.where(bucket.numels_t > 1, var.sqrt_(), torch.inf).to(x.dtype)
