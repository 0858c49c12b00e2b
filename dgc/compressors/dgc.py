"""Deep Gradient Compression (Lin et al., ICLR 2018)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import chunkselect, kernels, segselect, wire
from dgc.bucket import Bucket, Buckets
from dgc.collectives import Allgather, AllgatherBytes, Steps
from dgc.compressors.base import Item, Stochastic, check_int, check_number, register
from dgc.compressors.sparse import SparseCompressor, SparseConfig
from dgc.memory import MomentumCorrection
from dgc.select import (
    Candidates,
    Scratch,
    candidate_capacity,
    sampled_select,
    sampling_plan,
    target_count,
    threshold_select,
    use_kernel,
)
from dgc.timing import Phases

#: ``DGCConfig.selection``
SELECTIONS = ("sampled", "chunk")


@dataclass
class DGCConfig(SparseConfig):
    """DGC's options (the sparse ones, :class:`~dgc.compressors.sparse.SparseConfig`, come first)."""

    name: str = "dgc"
    #: fraction of each tensor sampled to estimate the threshold
    sample_ratio: float = 0.01
    #: fewer than lower_bound * k candidates: lower the threshold (x0.8), at most max_adaptations times
    lower_bound: float = 0.8
    #: a reused threshold is kept while it lets between lower_bound * k and upper_bound * k through
    upper_bound: float = 1.3
    max_adaptations: int = 10
    #: sample every step (1, the paper) or reuse the last threshold for up to R - 1 steps
    reestimate_every: int = 1
    momentum_correction: bool = True
    momentum_masking: bool = True
    #: seed of the sampling offsets (each worker draws its own stream from (seed, rank): :class:`Stochastic`)
    seed: int = 0
    #: sampled (the paper's: each tensor's own threshold, estimated from a sample) | chunk (the k largest |v| of
    #: every chunk_size consecutive values of the flattened tensors: a fixed-size message, no threshold, no host
    #: read; :mod:`dgc.chunkselect`)
    selection: str = "sampled"
    #: selection=chunk: values per chunk (k per chunk: density * chunk_size, at least 1)
    chunk_size: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.sample_ratio, "sample_ratio", 0, 1)
        check_number(self.lower_bound, "lower_bound", 0, 1)
        check_number(self.upper_bound, "upper_bound", 1, math.inf, low_open=False, high_open=True)
        check_int(self.max_adaptations, "max_adaptations", 0)
        check_int(self.reestimate_every, "reestimate_every", 1)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        check_int(self.chunk_size, "chunk_size", 2)
        if self.chunk_size > chunkselect.MAX_CHUNK:
            raise ValueError(f"chunk_size must be at most {chunkselect.MAX_CHUNK} (16-bit indices), "
                             f"got {self.chunk_size}")  # fmt: skip


@register
class DGC(Stochastic, SparseCompressor):
    """Deep Gradient Compression.

    Per tensor and step, with g the (locally clipped) gradient plus weight decay:

    1. momentum correction: ``u = m u + g`` (Nesterov: ``u = m (u + g)``);
       ``v = v + u`` (Nesterov: ``v = v + u + g``). Without correction: ``v = v + g``;
    2. select about ``density`` of ``|v|`` by sampled threshold (:mod:`dgc.select`);
    3. send the selected ``v`` and clear them from ``v`` (the residual keeps the rest);
    4. momentum factor masking: clear ``u`` at the sent positions too.

    The momentum coefficient and Nesterov flag come from the optimizer (``dgc.SGD``) through the
    :class:`~dgc.sync.GradientSync`, which also applies local clipping and weight decay before
    step 1. With masking on, a coordinate sent every step keeps no momentum: at density 1.0 DGC
    is plain SGD (Nesterov: SGD with the rate scaled by ``1 + m``); with masking off, density 1.0
    is exactly momentum SGD.

    Threshold reuse (``reestimate_every > 1``): a sampled threshold is reused on the next steps
    while the count it lets through stays in ``[lower_bound * k, upper_bound * k]``; it follows
    the exact k-th largest ``|v|`` of each step. The sent entries are always the m largest
    ``|v|`` with ``lower_bound * k <= m <= k``, so reuse changes the cost, not what a selection
    may be.

    With the native kernel (:mod:`dgc.kernels`) steps 1 and 2 share one memory pass: the sample
    is computed from the values step 1 is about to write, and the comparison with the threshold
    happens while ``v`` is updated.
    """

    name: ClassVar[str] = "dgc"
    config_class = DGCConfig
    config: DGCConfig
    #: False: always the per-tensor path (comparisons, tests)
    use_buckets: bool = True

    def __init__(self, config: DGCConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        c = self.config
        self.sample_ratio, self.lower_bound, self.upper_bound = c.sample_ratio, c.lower_bound, c.upper_bound
        self.max_adaptations, self.reestimate_every = c.max_adaptations, c.reestimate_every
        self.momentum_correction, self.momentum_masking = c.momentum_correction, c.momentum_masking
        self.scratch = Scratch()
        #: per tensor: [threshold, steps since it was sampled, density it was sampled for]
        self.thresholds: dict[str, list[float]] = {}
        #: the flat bucket of the bucketed path (:meth:`bucketed`)
        self.buckets = Buckets()

    @property
    def owns_momentum(self) -> bool:
        return self.momentum_correction

    def make_memory(self) -> MomentumCorrection:
        return MomentumCorrection(self.config.momentum_correction, self.config.momentum_masking)

    # -- step 1: accumulation ------------------------------------------------------------
    def accumulate(self, item: Item) -> torch.Tensor:
        """Fold the gradient into the accumulator ``v`` and return it."""
        return self.memory.compensate(item.grad.view(-1), self.memory_buffers(item), item.momentum, item.nesterov)

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
        """Step 1 and, given a ``threshold``, the count of ``|v| >= threshold`` after it (one pass with
        the native kernel)."""
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

    # -- step 2: selection ---------------------------------------------------------------
    def _reusable(self, name: str, density: float) -> float | None:
        saved = self.thresholds.get(name)
        if saved is None or self.reestimate_every <= 1:
            return None
        threshold, age, sampled_for = saved
        if age + 1 >= self.reestimate_every or sampled_for != density:
            return None
        return threshold

    def _sampled(self, v: torch.Tensor, density: float, **fused: Any):  # noqa: ANN202
        return sampled_select(
            v,
            density,
            sample_ratio=self.sample_ratio,
            lower_bound=self.lower_bound,
            max_adaptations=self.max_adaptations,
            generator=self.generator,
            scratch=self.scratch,
            **fused,
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
                idx, info = self._sampled(v, density)
        elif plan is not None and self._fused_state(item) is not None:
            v = self.tensor_state(item, "v")[0]
            idx, info = self._sampled(
                v,
                density,
                sample=lambda where: self.predicted_sample(item, where),
                first_count=lambda threshold: self.accumulate_count(item, threshold, capacity)[1],
            )
        else:
            v, _ = self.accumulate_count(item, None, capacity)
            idx, info = self._sampled(v, density)
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
        return idx, v  # the sent values leave v, and u is masked there, in pick (self.memory.sent)

    # -- the bucketed path --------------------------------------------------------------------
    def bucketed(self, items: list[Item]) -> bool:
        """Whether ``items`` take the bucketed path (:mod:`dgc.segselect`): the PyTorch path (no native kernel for
        these tensors: CUDA, or ``DGC_KERNELS=0``), one momentum for all, a threshold sampled every step, and
        an index format whose size the selection knows. Otherwise the per-tensor path, with the same result."""
        first = items[0].grad
        return (
            self.use_buckets
            and not kernels.usable(first)
            and self.reestimate_every == 1
            and self.wire.indices in wire.KNOWN_FORMATS
            and len({(it.momentum, it.nesterov, it.grad.dtype, it.grad.device) for it in items}) == 1
        )

    def _bucket_of(self, items: list[Item]) -> Bucket:
        bucket = self.buckets.of("dgc", items)
        bucket.adopt(self.state, self.memory.keys)
        return bucket

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if items and self.config.selection == "chunk":
            yield from self._chunk_steps(items, phases)
            return
        if not items or not self.bucketed(items):
            yield from super().steps(items, phases)
            return
        density = self.density()
        with phases("compress"):
            bucket = self._bucket_of(items)
            g = bucket.gather(items)
            v = self.memory.compensate(g, bucket.buffers, items[0].momentum, items[0].nesterov)
            plan = bucket.plans.get(density)
            if plan is None:
                plan = bucket.plans[density] = segselect.Plan(
                    bucket, density, self.sample_ratio, self.lower_bound, self.max_adaptations
                )
            sel = segselect.select(v, bucket, plan, self.generator)
            values = self.memory.sent(bucket.buffers, sel.positions, self.wire.value_dtype)
            for name, threshold in zip(bucket.layout.names, sel.thresholds):
                if threshold is None:
                    self.thresholds.pop(name, None)
                else:
                    self.thresholds[name] = [threshold, 0, density]
            phases.counters["adaptations"] += sum(sel.adaptations)
            phases.counters["threshold_sampled"] += plan.num_sampled
            phases.counters["selection_retries"] += sel.retries
            phases.counters["values_sent"] += sum(sel.counts)
            phases.counters["values_target"] += sum(plan.k)
            local = sel.positions - bucket.offsets_t[sel.tensors] if self.wire.indices == "int32" else None
            message = wire.encode_known(values, local, sel.gaps, sel.counts, sel.words, self.wire)
        rows, _ = yield AllgatherBytes(message)
        with phases("decompress"):
            self.decompress_bucket(rows, bucket, items)

    # -- selection=chunk ---------------------------------------------------------------------
    @property
    def picks_per_tensor(self) -> bool:
        return self.config.selection != "chunk"

    def _chunk_steps(self, items: list[Item], phases: Phases) -> Steps:
        """The k largest ``|v|`` of every chunk of the bucket (:mod:`dgc.chunkselect`): a message of a size every
        worker knows, one allgather, no host read."""
        if len({(it.momentum, it.nesterov, it.grad.dtype, it.grad.device) for it in items}) != 1:
            raise ValueError("compression.selection=chunk needs one momentum, dtype and device for every compressed "
                             "tensor (one flat bucket); use selection=sampled")  # fmt: skip
        chunk = self.config.chunk_size
        with phases("compress"):
            bucket = self.buckets.of("dgc-chunk", items, multiple=chunk)
            bucket.adopt(self.state, self.memory.keys)
            v = self.memory.compensate(bucket.gather(items), bucket.buffers, items[0].momentum, items[0].nesterov)
            k = chunkselect.per_chunk(self.density(), chunk)
            local, positions = chunkselect.select(v, chunk, k)
            values = self.memory.sent(bucket.buffers, positions, self.wire.value_dtype)
            phases.counters["values_sent"] += positions.numel()
            phases.counters["values_target"] += positions.numel()
            message = chunkselect.encode(values, local, self.wire.value_dtype)
        rows = yield Allgather(message)
        with phases("decompress"):
            chunkselect.decode_mean_into(bucket.grad, rows, chunk, k, self.wire.value_dtype)
            bucket.scatter(items)

    # -- state ---------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "thresholds": {n: list(t) for n, t in self.thresholds.items()}}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        super().load_extra_state(extra)
        self.thresholds = {n: list(t) for n, t in extra.get("thresholds", {}).items()}
