"""Sparse methods: exact top-k with a residual (Gradient Dropping) and DGC.

Both accumulate locally, select a few entries per tensor, and exchange the
selection of all their tensors as one message per worker (see :mod:`dgc.wire`):
one variable-length allgather per step, not one collective per tensor. Every
worker then scatter-adds all the messages and divides by the number of workers.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from dgc import wire
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, make_generator
from dgc.schedule import DensitySchedule
from dgc.select import Scratch, exact_topk, sampled_select, target_count
from dgc.timing import Phases


class SparseCompressor(Compressor):
    """Shared machinery: density schedule, wire format, the sparse exchange."""

    def __init__(
        self,
        density: float = 0.001,
        *,
        warmup_epochs: float = 0.0,
        warmup_densities: list[float] | None = None,
        warmup_coeff: float | None = None,
        wire_values: str = "fp32",
        wire_indices: str = "delta16",
    ):
        super().__init__()
        self.schedule = DensitySchedule(density, warmup_epochs, warmup_densities, warmup_coeff)
        self.wire = wire.WireFormat(wire_values, wire_indices)
        self._flat: torch.Tensor | None = None

    def density(self) -> float:
        return self.schedule(self.epoch)

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(ascending positions, accumulator)`` and leave the residual for the rest."""
        raise NotImplementedError

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        if not items:
            return
        density = self.density()
        value_dtype = self.wire.value_dtype
        with phases("compress"):
            values, positions, accumulators = [], [], []
            for it in items:
                idx, acc = self.select(it, density, phases)
                val = acc[idx]
                if value_dtype != torch.float32:
                    # fp16 overflows above 65504: send the largest finite value; the excess stays in the residual
                    limit = torch.finfo(value_dtype).max
                    val.clamp_(-limit, limit)
                positions.append(idx)
                values.append(val)
                accumulators.append(acc)
            message = wire.encode(values, positions, self.wire)
            for idx, val, acc in zip(positions, values, accumulators):
                if value_dtype != torch.float32:
                    # what was not sent (16-bit rounding error, clamped excess) stays in the residual
                    acc[idx] -= val.to(value_dtype).to(val.dtype)
                else:
                    acc[idx] = 0
            phases.counters["values_sent"] += sum(v.numel() for v in values)
            phases.counters["values_target"] += sum(target_count(it.grad.numel(), density) for it in items)
        rows, lengths = comm.allgather_bytes(message)
        with phases("decompress"):
            numels = torch.tensor([it.grad.numel() for it in items], dtype=torch.int64)
            offsets = torch.cumsum(numels, 0) - numels
            total = int(numels.sum())
            device = items[0].grad.device
            if self._flat is None or self._flat.numel() != total or self._flat.device != device:
                self._flat = torch.zeros(total, dtype=items[0].grad.dtype, device=device)
            else:
                self._flat.zero_()
            for r in range(rows.shape[0]):
                pos, val = wire.decode(rows[r, : lengths[r]], offsets.to(device), self.wire)
                self._flat.index_add_(0, pos, val.to(self._flat.dtype).div_(comm.world_size))
            start = 0
            for it in items:
                n = it.grad.numel()
                it.grad.view(-1).copy_(self._flat[start : start + n])
                start += n


class TopK(SparseCompressor):
    """Gradient Dropping (Aji & Heafield 2017): exact top-k of a local residual.

    No momentum correction: the optimizer applies momentum to the aggregated
    sparse gradient, as with dense SGD.
    """

    name: ClassVar[str] = "topk"

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        (residual,) = self.tensor_state(item, "residual")
        residual.add_(item.grad.view(-1))
        idx = exact_topk(residual, target_count(residual.numel(), density))
        return idx, residual

    def __repr__(self) -> str:
        return f"TopK(schedule={self.schedule}, wire={self.wire})"


class DGC(SparseCompressor):
    """Deep Gradient Compression (Lin et al., ICLR 2018).

    Per tensor and step, with g the (locally clipped) gradient plus weight decay:

    1. momentum correction: ``u = m u + g`` (Nesterov: ``u = m (u + g)``);
       ``v = v + u`` (Nesterov: ``v = v + u + g``). Without correction: ``v = v + g``;
    2. select about ``density`` of ``|v|`` by sampled threshold (:mod:`dgc.select`);
    3. send the selected ``v`` and clear them from ``v`` (the residual keeps the rest);
    4. momentum factor masking: clear ``u`` at the sent positions too.

    The momentum coefficient and Nesterov flag come from the optimizer (``dgc.SGD``)
    through the :class:`~dgc.sync.GradientSync`, which also applies local clipping
    and weight decay before step 1. With masking on, a coordinate that is sent every
    step keeps no momentum: at density 1.0 DGC reduces to plain SGD (Nesterov: SGD
    with the rate scaled by ``1 + m``). With masking off, density 1.0 is exactly
    momentum SGD.
    """

    name: ClassVar[str] = "dgc"

    def __init__(
        self,
        density: float = 0.001,
        *,
        sample_ratio: float = 0.01,
        lower_bound: float = 0.8,
        max_adaptations: int = 10,
        momentum_correction: bool = True,
        momentum_masking: bool = True,
        warmup_epochs: float = 0.0,
        warmup_densities: list[float] | None = None,
        warmup_coeff: float | None = None,
        wire_values: str = "fp32",
        wire_indices: str = "delta16",
        seed: int = 0,
    ):
        super().__init__(
            density,
            warmup_epochs=warmup_epochs,
            warmup_densities=warmup_densities,
            warmup_coeff=warmup_coeff,
            wire_values=wire_values,
            wire_indices=wire_indices,
        )
        if not isinstance(sample_ratio, (int, float)) or math.isnan(sample_ratio) or not 0 < sample_ratio <= 1:
            raise ValueError(f"sample_ratio must be a number in (0, 1], got {sample_ratio!r}")
        if not isinstance(lower_bound, (int, float)) or math.isnan(lower_bound) or not 0 < lower_bound <= 1:
            raise ValueError(f"lower_bound must be a number in (0, 1], got {lower_bound!r}")
        if not isinstance(max_adaptations, int) or max_adaptations < 0:
            raise ValueError(f"max_adaptations must be an integer >= 0, got {max_adaptations!r}")
        self.sample_ratio = float(sample_ratio)
        self.lower_bound = float(lower_bound)
        self.max_adaptations = max_adaptations
        self.momentum_correction = bool(momentum_correction)
        self.momentum_masking = bool(momentum_masking)
        self.seed = int(seed)
        self.generator = make_generator(self.seed)
        self.scratch = Scratch()

    def bind(self, comm: Comm) -> None:
        super().bind(comm)
        # independent sampling offsets per worker, reproducible per (seed, rank)
        self.generator = make_generator(self.seed * 1_000_003 + comm.rank)

    @property
    def owns_momentum(self) -> bool:
        return self.momentum_correction

    def accumulate(self, item: Item) -> torch.Tensor:
        """Step 1: fold the gradient into the accumulator ``v`` and return it."""
        g = item.grad.view(-1)
        if not self.momentum_correction:
            (v,) = self.tensor_state(item, "v")
            return v.add_(g)
        u, v = self.tensor_state(item, "u", "v")
        if item.nesterov:
            u.add_(g).mul_(item.momentum)
            v.add_(u).add_(g)
        else:
            torch.add(g, u, alpha=item.momentum, out=u)
            v.add_(u)
        return v

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.accumulate(item)
        idx, info = sampled_select(
            v,
            density,
            sample_ratio=self.sample_ratio,
            lower_bound=self.lower_bound,
            max_adaptations=self.max_adaptations,
            generator=self.generator,
            scratch=self.scratch,
        )
        phases.counters["adaptations"] += info.adaptations
        if self.momentum_correction and self.momentum_masking:
            self.state[item.name]["u"].index_fill_(0, idx, 0)
        return idx, v

    def extra_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        if "generator" in extra:
            self.generator.set_state(extra["generator"])

    def __repr__(self) -> str:
        return (
            f"DGC(schedule={self.schedule}, sample_ratio={self.sample_ratio}, "
            f"momentum_correction={self.momentum_correction}, momentum_masking={self.momentum_masking}, "
            f"wire={self.wire})"
        )
