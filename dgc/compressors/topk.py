"""Gradient Dropping (Aji & Heafield 2017): exact top-k of a local residual, no momentum correction.

Every tensor sends its own ``k`` largest ``|residual|``. On a flat bucket (:mod:`dgc.bucket`) the tensors are laid
out by size, so that the tensors of one size are one ``[count, n]`` view: one ``topk`` along its rows and one sort
of their positions per size (ResNet-50's and ResNet-101's 54 and 105 weight tensors have 15 sizes each), not per
tensor. ``k`` is known from the sizes, so the message's size is too: one host read per step (whether a gap needs
an escape word, for ``delta16`` indices), none with ``int32`` indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgc import wire
from dgc.bucket import Bucket, Buckets
from dgc.collectives import AllgatherBytes, Steps
from dgc.compressors.base import Item, register
from dgc.compressors.sparse import SparseCompressor, SparseConfig
from dgc.memory import Memory, Residual
from dgc.select import exact_topk, target_count
from dgc.timing import Phases


@dataclass
class TopKConfig(SparseConfig):
    name: str = "topk"


@register
class TopK(SparseCompressor):
    """Exact top-k of a local residual. The optimizer applies momentum to the aggregated sparse
    gradient, as with dense SGD."""

    name: ClassVar[str] = "topk"
    config_class = TopKConfig
    #: False: always the per-tensor path (comparisons, tests)
    use_buckets: bool = True

    def __init__(self, config: TopKConfig | None = None, **options) -> None:  # noqa: ANN003
        super().__init__(config, **options)
        self.buckets = Buckets()

    def make_memory(self) -> Memory:
        return Residual()

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self.memory.compensate(item.grad.view(-1), self.memory_buffers(item))
        idx = exact_topk(residual, target_count(residual.numel(), density))
        return idx, residual

    # -- the bucketed path --------------------------------------------------------------------
    def bucketed(self, items: list[Item]) -> bool:
        """Whether ``items`` take the bucketed path: one dtype and device, an index format whose size the selection
        knows. Otherwise the per-tensor path, with the same result."""
        return (
            self.use_buckets
            and self.wire.indices in wire.KNOWN_FORMATS
            and len({(it.grad.dtype, it.grad.device) for it in items}) == 1
        )

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items or not self.bucketed(items):
            yield from super().steps(items, phases)
            return
        density = self.density()
        with phases("compress"):
            items = sorted(items, key=lambda it: it.grad.numel())  # stable: the tensors of one size side by side
            bucket = self.buckets.of("topk", items)
            bucket.adopt(self.state, self.memory.keys)
            acc = self.memory.compensate(bucket.gather(items), bucket.buffers)
            plan = bucket.plans.get(density)
            if plan is None:
                plan = bucket.plans[density] = _Plan(bucket, density)
            mag = acc.abs()
            parts = []
            for start, count, n, k, rows in plan.groups:
                if k >= n:
                    parts.append(rows)  # every entry: the positions themselves
                else:
                    top = mag[start : start + count * n].view(count, n).topk(k, dim=1, sorted=False).indices
                    parts.append(top.sort(dim=1).values.add_(rows).view(-1))
            positions = torch.cat(parts) if len(parts) > 1 else parts[0]
            # each entry's gap to the previous one of its tensor (the first: its local position + 1)
            gaps = positions - torch.where(plan.first, plan.before, positions.roll(1))
            words = plan.counts
            local = None
            if self.wire.indices == "int32":
                local = positions - plan.entry_offsets
            elif bool((gaps > wire.ESCAPE_GAP).any()):  # the host read: a gap needs escape words (rare)
                extra = torch.zeros(len(plan.counts), dtype=torch.int64, device=acc.device).index_add_(
                    0, plan.entry_tensor, torch.div(gaps - 1, wire.ESCAPE_GAP, rounding_mode="floor").clamp_(min=0)
                )
                words = [c + e for c, e in zip(plan.counts, extra.tolist())]
            values = self.memory.sent(bucket.buffers, positions, self.wire.value_dtype)
            phases.counters["values_sent"] += plan.total
            phases.counters["values_target"] += plan.total
            message = wire.encode_known(values, local, gaps, plan.counts, words, self.wire)
        rows, _ = yield AllgatherBytes(message)
        with phases("decompress"):
            self.decompress_bucket(rows, bucket, items)


class _Plan:
    """What the bucketed top-k derives from a bucket's sizes at one density, made once: per run of tensors of one
    size ``(start, count, n, k, rows)`` (``rows``: each tensor's start in the bucket as a ``[count, 1]`` column, or
    every position where ``k >= n``), and per sent entry its tensor, that tensor's start, whether it is the
    tensor's first entry, and the position before that tensor (for the gaps)."""

    def __init__(self, bucket: Bucket, density: float) -> None:
        layout, device = bucket.layout, bucket.layout.device
        self.counts = [target_count(n, density) for n in layout.numels]
        self.total = sum(self.counts)
        self.groups: list[tuple[int, int, int, int, torch.Tensor]] = []
        i = 0
        while i < len(layout.numels):
            n, j = layout.numels[i], i
            while j < len(layout.numels) and layout.numels[j] == n:
                j += 1
            start, count, k = layout.offsets[i], j - i, self.counts[i]
            if k >= n:
                rows = torch.arange(start, start + count * n, device=device)
            else:
                rows = torch.arange(count, device=device).mul_(n).add_(start).view(count, 1)
            self.groups.append((start, count, n, k, rows))
            i = j
        counts_t = torch.tensor(self.counts, dtype=torch.int64, device=device)
        self.entry_tensor = torch.repeat_interleave(torch.arange(len(self.counts), device=device), counts_t)
        self.entry_offsets = bucket.offsets_t[self.entry_tensor]
        self.first = torch.zeros(self.total, dtype=torch.bool, device=device)
        firsts = (torch.cumsum(counts_t, 0) - counts_t)[counts_t > 0]
        self.first[firsts] = True
        self.before = self.entry_offsets - 1
