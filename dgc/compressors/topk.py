"""Gradient Dropping (Aji & Heafield 2017): exact top-k of a local residual, no momentum correction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

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

    def make_memory(self) -> Memory:
        return Residual()

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self.memory.compensate(item.grad.view(-1), self.memory_buffers(item))
        idx = exact_topk(residual, target_count(residual.numel(), density))
        return idx, residual
