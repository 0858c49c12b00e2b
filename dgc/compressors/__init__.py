"""Compressors by name: ``build_compressor("dgc", density=0.001)``.

Every module of this package is imported here, and each compressor class in it registers itself
(:func:`~dgc.compressors.base.register`): a new method is one new module.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from dgc.compressors.base import (
    COMPRESSORS,
    Compressor,
    CompressorConfig,
    Item,
    compressor_class,
    compressor_options,
    config_class,
    make_config,
    register,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
# every registered class by its class name: ``from dgc.compressors import DGC``
globals().update({cls.__name__: cls for cls in COMPRESSORS.values()})


def build_compressor(name: str | CompressorConfig, **options: Any) -> Compressor:
    """A compressor by name and options, or from its config; bad names or options raise a ValueError
    naming the valid ones."""
    if isinstance(name, CompressorConfig):
        return compressor_class(name.name)(name, **options)
    return compressor_class(name)(make_config(name, **options))


__all__ = [
    "COMPRESSORS",
    "Compressor",
    "CompressorConfig",
    "Item",
    "build_compressor",
    "compressor_class",
    "compressor_options",
    "config_class",
    "make_config",
    "register",
    *(cls.__name__ for cls in COMPRESSORS.values()),
]
