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

from dgc import kernels, wire
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, make_generator
from dgc.schedule import DensitySchedule
from dgc.select import (
    Candidates,
    Scratch,
    SelectInfo,
    adapt_threshold,
    candidate_capacity,
    exact_topk,
    finish,
    sampled_select,
    sampling_plan,
    target_count,
    threshold_select,
    use_kernel,
)
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
            message = wire.encode(values, positions, self.wire, [it.grad.numel() for it in items])
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
            self.decompress(items, rows, lengths, comm.world_size)

    def decompress(self, items: list[Item], rows: torch.Tensor, lengths: list[int], world_size: int) -> None:
        """Write the average of every worker's sparse message into the items' gradients.

        The gradients are zeroed and receive the scatter-add of all messages directly (no
        full-size temporary), entries of the same tensor in worker order, so duplicates sum in
        the same order as a per-worker scatter-add would.
        """
        device = items[0].grad.device
        numels = torch.tensor([it.grad.numel() for it in items], dtype=torch.int64, device=device)
        offsets = torch.cumsum(numels, 0) - numels
        decoded = [wire.decode(rows[r, : lengths[r]], offsets, self.wire) for r in range(rows.shape[0])]
        pos = torch.cat([p for p, _ in decoded]) if len(decoded) > 1 else decoded[0][0]
        val = torch.cat([v for _, v in decoded]) if len(decoded) > 1 else decoded[0][1]
        grads = [it.grad.view(-1) for it in items]
        torch._foreach_zero_(grads)
        if pos.numel() == 0:
            return
        val = val.to(grads[0].dtype).div_(world_size)
        tensor_of = torch.searchsorted(offsets, pos, right=True) - 1
        if len(decoded) > 1:
            order = torch.argsort(tensor_of, stable=True)
            pos, val, tensor_of = pos[order], val[order], tensor_of[order]
        counts = torch.bincount(tensor_of, minlength=len(items)).tolist()
        local = pos - offsets[tensor_of]
        start = 0
        for grad, c in zip(grads, counts):
            if c:
                grad.index_add_(0, local[start : start + c], val[start : start + c])
                start += c


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

    Threshold reuse (``reestimate_every``, ``upper_bound``): the threshold of a tensor is
    estimated by sampling (step 2) and then reused on the following steps, at most
    ``reestimate_every - 1`` of them, as long as the number of entries it lets through
    stays within ``[lower_bound * k, upper_bound * k]``; outside that range (and when the
    density changes) it is estimated again at once. The threshold carried to the next
    step is the exact k-th largest ``|v|`` of the step (the smallest value sent) whenever
    k values were sent, so a reused threshold follows slow drifts of the scale. Either way the sent entries are the
    m largest ``|v|`` with ``lower_bound * k <= m <= k`` (when more than k pass, the k
    largest of them are kept), the paper's guarantee, so reuse changes the cost and not
    what a selection may be. Reusing saves the sampling and, with the native kernel
    (:mod:`dgc.kernels`), lets steps 1 and 2 share one memory pass: the comparison with
    the reused threshold happens while ``v`` is updated. ``reestimate_every=1`` (the default)
    samples every step, as the paper and the authors' code do; Ok-Topk re-estimates every 32.

    Passes over memory per tensor and step, with the kernel: the sample of ``|v|`` is taken
    from the values step 1 is about to write (``u``, ``v`` and ``g`` at the sampled positions
    only), so that the comparison with the sampled threshold and the collection of the
    positions share step 1's single pass; only a threshold that lets too few entries through
    (a lowering, step 2) costs another read of ``v``. Without the kernel: step 1, then the
    sampled selection on ``v`` (PyTorch ops; same selections).
    """

    name: ClassVar[str] = "dgc"

    def __init__(
        self,
        density: float = 0.001,
        *,
        sample_ratio: float = 0.01,
        lower_bound: float = 0.8,
        upper_bound: float = 1.3,
        max_adaptations: int = 10,
        reestimate_every: int = 1,
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
        if not isinstance(upper_bound, (int, float)) or math.isnan(upper_bound) or not 1 <= upper_bound < math.inf:
            raise ValueError(f"upper_bound must be a finite number >= 1, got {upper_bound!r}")
        if not isinstance(max_adaptations, int) or max_adaptations < 0:
            raise ValueError(f"max_adaptations must be an integer >= 0, got {max_adaptations!r}")
        if isinstance(reestimate_every, bool) or not isinstance(reestimate_every, int) or reestimate_every < 1:
            raise ValueError(f"reestimate_every must be an integer >= 1, got {reestimate_every!r}")
        self.sample_ratio = float(sample_ratio)
        self.lower_bound = float(lower_bound)
        self.upper_bound = float(upper_bound)
        self.max_adaptations = max_adaptations
        self.reestimate_every = reestimate_every
        self.momentum_correction = bool(momentum_correction)
        self.momentum_masking = bool(momentum_masking)
        self.seed = int(seed)
        self.generator = make_generator(self.seed)
        self.scratch = Scratch()
        #: per tensor: [threshold, steps since it was sampled, density it was sampled for]
        self.thresholds: dict[str, list[float]] = {}

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

    def _fused_state(self, item: Item) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """``(g, u or None, v)`` when the native kernel handles this tensor, else None."""
        g = item.grad.view(-1)
        if not use_kernel(g):
            return None
        if self.momentum_correction:
            u, v = self.tensor_state(item, "u", "v")
        else:
            (v,) = self.tensor_state(item, "v")
            u = None
        if not kernels.usable(*([v] if u is None else [u, v])):
            return None
        return g, u, v

    def _mode(self, item: Item) -> int:
        if not self.momentum_correction:
            return kernels.ADD
        return kernels.NESTEROV if item.nesterov else kernels.MOMENTUM

    def accumulate_count(
        self, item: Item, threshold: torch.Tensor | float | None, capacity: int
    ) -> tuple[torch.Tensor, Candidates | None]:
        """Step 1 and, given a ``threshold``, the count of ``|v| >= threshold`` after it.

        With the native kernel both happen in one pass over ``g``, ``u`` and ``v``; without it,
        :meth:`accumulate` and then a separate count.
        """
        fused = self._fused_state(item)
        if fused is None:
            v = self.accumulate(item)
            return v, None if threshold is None else Candidates(v, threshold, capacity, self.scratch)
        g, u, v = fused
        count, positions = kernels.acc_select(
            v,
            math.inf if threshold is None else float(threshold),
            capacity,
            mode=self._mode(item),
            g=g,
            u=u,
            momentum=float(item.momentum),
            buffers=self.scratch.kernel,
        )
        if threshold is None:
            return v, None
        return v, Candidates.known(v, threshold, count, positions, self.scratch)

    def predicted_sample(self, item: Item, where: slice) -> torch.Tensor:
        """``|v[where]|`` as step 1 is about to make it, computed on the sampled entries only."""
        fused = self._fused_state(item)
        if fused is not None:
            g, u, v = fused
            return kernels.sample(v, where, mode=self._mode(item), g=g, u=u, momentum=float(item.momentum))
        g = item.grad.view(-1)[where]
        if not self.momentum_correction:
            (v,) = self.tensor_state(item, "v")
            return (v[where] + g).abs_()
        u, v = (t[where] for t in self.tensor_state(item, "u", "v"))
        if item.nesterov:
            u = (u + g) * item.momentum
            return ((v + u) + g).abs_()
        return (v + torch.add(g, u, alpha=item.momentum)).abs_()

    def _reusable(self, name: str, density: float) -> float | None:
        saved = self.thresholds.get(name)
        if saved is None or self.reestimate_every <= 1:
            return None
        threshold, age, sampled_for = saved
        if age + 1 >= self.reestimate_every or sampled_for != density:
            return None
        return threshold

    def _sample_select(self, v: torch.Tensor, density: float) -> tuple[torch.Tensor, SelectInfo]:
        """The paper's selection on an accumulator that is already up to date."""
        return sampled_select(
            v,
            density,
            sample_ratio=self.sample_ratio,
            lower_bound=self.lower_bound,
            max_adaptations=self.max_adaptations,
            generator=self.generator,
            scratch=self.scratch,
        )

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        n = item.grad.numel()
        k = target_count(n, density)
        plan = sampling_plan(n, density, self.sample_ratio)
        reuse = self._reusable(item.name, density) if plan is not None else None
        capacity = max(math.ceil(self.upper_bound * k) + 1, candidate_capacity(k))
        idx = info = None
        if reuse is not None:
            v, candidates = self.accumulate_count(item, reuse, capacity)
            assert candidates is not None
            idx, info = threshold_select(
                v,
                k,
                reuse,
                lower_bound=self.lower_bound,
                upper_bound=self.upper_bound,
                scratch=self.scratch,
                candidates=candidates,
            )
            if idx is not None:
                self.thresholds[item.name][1] += 1
                phases.counters["threshold_reused"] += 1
            else:  # out of bounds: sample again, on the updated v
                idx, info = self._sample_select(v, density)
        elif plan is not None and self._fused_state(item) is not None:
            # sample the entries step 1 is about to produce, so that the comparison with the
            # sampled threshold can share step 1's pass (the same selection as sampling after it).
            # (Collecting down to the once-lowered threshold in the same pass, to save the pass a
            # lowering costs, was tried: the accumulator piles up just below the threshold, since
            # what passes is sent and cleared, so 0.8 x the threshold lets tens of times k through.)
            start = plan.draw_start(self.generator)
            threshold = plan.threshold(self.predicted_sample(item, plan.positions(start)))
            v, first = self.accumulate_count(item, threshold, capacity)
            found, threshold, adaptations = adapt_threshold(
                v,
                k,
                threshold,
                lower_bound=self.lower_bound,
                max_adaptations=self.max_adaptations,
                scratch=self.scratch,
                first=first,
            )
            idx, info = finish(v, k, found, threshold, adaptations)
        else:
            v, _ = self.accumulate_count(item, None, capacity)
            idx, info = self._sample_select(v, density)
        assert idx is not None and info is not None
        if not info.reused:
            phases.counters["adaptations"] += info.adaptations
            phases.counters["threshold_sampled"] += 0 if info.exact else 1
            if info.threshold is None:
                self.thresholds.pop(item.name, None)
            else:
                self.thresholds[item.name] = [info.threshold, 0, density]
        if self.reestimate_every > 1 and item.name in self.thresholds and idx.numel() == k:
            # the next reuse starts from the exact k-th largest |v| of this step
            self.thresholds[item.name][0] = float(v[idx].abs().min())
        if self.momentum_correction and self.momentum_masking:
            self.state[item.name]["u"].index_fill_(0, idx, 0)
        return idx, v

    def extra_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "thresholds": {n: list(t) for n, t in self.thresholds.items()}}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        if "generator" in extra:
            self.generator.set_state(extra["generator"])
        self.thresholds = {n: list(t) for n, t in extra.get("thresholds", {}).items()}

    def __repr__(self) -> str:
        return (
            f"DGC(schedule={self.schedule}, sample_ratio={self.sample_ratio}, "
            f"bounds=({self.lower_bound}, {self.upper_bound}), reestimate_every={self.reestimate_every}, "
            f"momentum_correction={self.momentum_correction}, momentum_masking={self.momentum_masking}, "
            f"wire={self.wire})"
        )
