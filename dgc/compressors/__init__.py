"""Compressors by name: ``build_compressor("dgc", density=0.001)``."""

from __future__ import annotations

import inspect
from typing import Any

from dgc.compressors.base import Compressor, Item
from dgc.compressors.dense import FP16, Dense
from dgc.compressors.powersgd import PowerSGD
from dgc.compressors.sparse import DGC, SparseCompressor, TopK
from dgc.compressors.terngrad import TernGrad

COMPRESSORS: dict[str, type[Compressor]] = {cls.name: cls for cls in (Dense, FP16, TopK, DGC, TernGrad, PowerSGD)}


def compressor_options(name: str) -> list[str]:
    """The keyword arguments compressor ``name`` accepts."""
    params = inspect.signature(get_compressor_class(name).__init__).parameters
    return [p for p in params if p != "self"]


def get_compressor_class(name: str) -> type[Compressor]:
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; valid: {', '.join(COMPRESSORS)}")
    return COMPRESSORS[name]


def build_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build a compressor by name; unknown names or options raise a ValueError naming the valid ones."""
    cls = get_compressor_class(name)
    valid = compressor_options(name)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"compressor {name!r} has no option {', '.join(unknown)}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**kwargs)


__all__ = [
    "COMPRESSORS",
    "DGC",
    "FP16",
    "Compressor",
    "Dense",
    "Item",
    "PowerSGD",
    "SparseCompressor",
    "TernGrad",
    "TopK",
    "build_compressor",
    "compressor_options",
    "get_compressor_class",
]
