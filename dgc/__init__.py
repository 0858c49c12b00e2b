"""dgc: Deep Gradient Compression for PyTorch (Lin et al., ICLR 2018).

The library: :func:`build_compressor`, :class:`GradientSync`, :class:`SGD`, :func:`ddp_comm_hook`.
The reproduction framework (trainer, run directories, sweeps, tables) is :mod:`dgc.repro`, run by
``python -m dgc.train``; the library never imports Hydra.
"""

from dgc.compressors import COMPRESSORS, CompressorConfig, build_compressor
from dgc.hook import HookState, ddp_comm_hook
from dgc.optim import SGD
from dgc.sync import GradientSync, Policy, StepStats, SyncConfig

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "SGD",
    "CompressorConfig",
    "GradientSync",
    "HookState",
    "Policy",
    "StepStats",
    "SyncConfig",
    "build_compressor",
    "ddp_comm_hook",
]
