"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternary gradients, 2 bits per value.

Per tensor: optionally clip g to ``clip_sigma`` standard deviations; the scale
``s`` is the maximum ``|g|`` over all workers (one small MAX allreduce, the
paper's scaler sharing); each entry becomes ``s * sign(g) * b`` with
``b ~ Bernoulli(|g| / s)``, an unbiased estimate. The ternary codes are packed
four to a byte and allgathered; every worker sums them and divides by N.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, make_generator
from dgc.timing import Phases


def pack2(codes: torch.Tensor) -> torch.Tensor:
    """Pack values in {0, 1, 2, 3} (uint8) four to a byte."""
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    c = codes.view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack2(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack2` for a ``[..., bytes]`` tensor: ``[..., numel]`` uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.flatten(-2)[..., :numel]


class TernGrad(Compressor):
    name: ClassVar[str] = "terngrad"

    def __init__(self, *, clip_sigma: float | None = 2.5, seed: int = 0):
        super().__init__()
        if clip_sigma is not None and (math.isnan(clip_sigma) or clip_sigma <= 0):
            raise ValueError(f"clip_sigma must be a number > 0 or null, got {clip_sigma!r}")
        self.clip_sigma = clip_sigma
        self.seed = int(seed)
        self.generator = make_generator(self.seed)

    def bind(self, comm: Comm) -> None:
        super().bind(comm)
        self.generator = make_generator(self.seed * 1_000_003 + comm.rank)

    def _generator_on(self, device: torch.device) -> torch.Generator:
        # random numbers are drawn where the gradient lives: no host copies on CUDA
        if self.generator.device != device:
            state = self.generator.get_state() if self.generator.device.type == device.type else None
            gen = torch.Generator(device=device)
            if state is not None:
                gen.set_state(state)
            else:
                gen.manual_seed(self.seed * 1_000_003 + self.rank)
            self.generator = gen
        return self.generator

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
                rand = torch.rand(g.numel(), generator=self._generator_on(g.device), device=g.device)
                codes = (torch.sign(g) * (rand < prob)).to(torch.int8) + 1
                packed.append(pack2(codes.to(torch.uint8)))
            message = torch.cat(packed)
            phases.counters["values_sent"] += sum(g.numel() for g in grads)
        rows = comm.allgather(message)
        with phases("decompress"):
            start = 0
            for g, s, p in zip(grads, scales, packed):
                codes = unpack2(rows[:, start : start + p.numel()], g.numel())
                total = codes.to(g.dtype).sum(0) - rows.shape[0]  # codes are t + 1
                g.copy_(total.mul_(s / rows.shape[0]))
                start += p.numel()

    def extra_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        if "generator" in extra:
            self.generator.set_state(extra["generator"])
