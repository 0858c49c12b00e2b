"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternary gradients, 2 bits per value.

Per tensor: optionally clip g to ``clip_sigma`` standard deviations; the scale
``s`` is the maximum ``|g|`` over all workers (one small MAX allreduce, the
paper's scaler sharing); each entry becomes ``s * sign(g) * b`` with
``b ~ Bernoulli(|g| / s)``, an unbiased estimate. The ternary codes are packed
four to a byte (:mod:`dgc.bits`) and allgathered; every worker sums them and divides by N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import bits
from dgc.comm import Comm
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

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        if not items:
            return
        with phases("compress"):
            grads = [it.grad.view(-1) for it in items]
            if self.clip_sigma is not None:
                for g in grads:
                    if g.numel() > 1:
                        bound = float(self.clip_sigma * g.std())
                        g.clamp_(-bound, bound)
            scales = torch.stack([g.abs().max() for g in grads]).to(torch.float32)
        comm.allreduce_max_(scales)
        with phases("compress"):
            packed = []
            for g, s in zip(grads, scales):
                prob = g.abs() / s.clamp_min(1e-30)
                rand = torch.rand(g.numel(), generator=self.generator_on(g.device), device=g.device)
                codes = (torch.sign(g) * (rand < prob)).to(torch.int8) + 1
                packed.append(bits.pack(codes, 2))
            message = torch.cat(packed)
            phases.counters["values_sent"] += sum(g.numel() for g in grads)
        rows = comm.allgather(message)
        with phases("decompress"):
            start = 0
            for g, s, p in zip(grads, scales, packed):
                codes = bits.unpack(rows[:, start : start + p.numel()], g.numel(), 2)
                total = codes.to(g.dtype).sum(0) - rows.shape[0]  # codes are t + 1
                g.copy_(total.mul_(s / rows.shape[0]))
                start += p.numel()
