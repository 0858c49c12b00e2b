"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation with error feedback.

Per matrix-shaped gradient M (viewed as ``shape[0] x rest``) and step:

1. ``M = g + e`` (error feedback);
2. ``P = M Q`` with Q from the previous step (warm start; random at first, the
   same on every worker);
3. allreduce-average all P at once; orthonormalize each P;
4. ``Q = M^T P``; allreduce-average all Q at once;
5. the update is ``P Q^T``; ``e = M - P Q^T``.

Tensors for which rank r would not save bytes (``r (n + m) >= n m``) are averaged
dense in the same allreduce as P. Two collectives per step, in the same order on
every worker (PyTorch's own PowerSGD hook chains them from future callbacks and
crashes under gloo).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import seeding
from dgc.comm import Comm
from dgc.compressors.base import Compressor, CompressorConfig, Item, check_int, register
from dgc.timing import Phases


@dataclass
class PowerSGDConfig(CompressorConfig):
    name: str = "powersgd"
    #: rank r of the approximation
    rank: int = 4
    error_feedback: bool = True
    #: start each step's power iteration from the last Q
    warm_start: bool = True
    #: seed of the first Q (the same on every worker)
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self.rank, "rank", 1)


def _matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    n = t.shape[0] if t.dim() > 0 else 1
    return n, t.numel() // max(n, 1)


@register
class PowerSGD(Compressor):
    name: ClassVar[str] = "powersgd"
    config_class = PowerSGDConfig
    config: PowerSGDConfig

    def __init__(self, config: PowerSGDConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.rank_r = self.config.rank
        self.error_feedback = bool(self.config.error_feedback)
        self.warm_start = bool(self.config.warm_start)
        self.seed = int(self.config.seed)

    def _low_rank(self, item: Item) -> bool:
        n, m = _matrix_shape(item.grad)
        r = min(self.rank_r, n, m)
        return item.grad.dim() > 1 and r * (n + m) < n * m

    def _initial_q(self, item: Item, m: int, r: int) -> torch.Tensor:
        # same seed on every worker, different per tensor
        gen = seeding.generator(self.seed, zlib.crc32(item.name.encode()))
        # drawn on the CPU from a CPU generator (the same numbers whatever the device), then moved there
        return torch.randn(m, r, generator=gen, device="cpu").to(item.grad.device, item.grad.dtype)

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        if not items:
            return
        low = [it for it in items if self._low_rank(it)]
        dense = [it for it in items if not self._low_rank(it)]
        with phases("compress"):
            mats, ps = [], []
            for it in low:
                n, m = _matrix_shape(it.grad)
                r = min(self.rank_r, n, m)
                matrix = it.grad.view(n, m)
                if self.error_feedback:
                    (err,) = self.tensor_state(it, "error")
                    matrix.add_(err.view(n, m))
                slot = self.state.setdefault(it.name, {})
                q = slot.get("q")
                if q is None or not self.warm_start or q.shape != (m, r):
                    q = self._initial_q(it, m, r)
                q = q.to(matrix.device)
                mats.append(matrix)
                ps.append(matrix @ q)
            first = torch.cat([p.view(-1) for p in ps] + [it.grad.view(-1) for it in dense])
        comm.allreduce_mean_(first)
        with phases("compress"):
            start, qs = 0, []
            for matrix, p in zip(mats, ps):
                p_avg = first[start : start + p.numel()].view_as(p)
                start += p.numel()
                p_orth = torch.linalg.qr(p_avg).Q
                qs.append((p_orth, matrix.t() @ p_orth))
            second = torch.cat([q.view(-1) for _, q in qs]) if qs else first.new_zeros(0)
        for it in dense:
            it.grad.view(-1).copy_(first[start : start + it.grad.numel()])
            start += it.grad.numel()
        if low:
            comm.allreduce_mean_(second)
        with phases("decompress"):
            start = 0
            for it, matrix, (p_orth, q) in zip(low, mats, qs):
                q_avg = second[start : start + q.numel()].view_as(q)
                start += q.numel()
                approx = p_orth @ q_avg.t()
                if self.error_feedback:
                    self.state[it.name]["error"].copy_((matrix - approx).view(-1))
                self.state[it.name]["q"] = q_avg.clone()
                matrix.copy_(approx)
            phases.counters["values_sent"] += sum(p.numel() + q.numel() for p, (_, q) in zip(ps, qs))
