"""dgc: Deep Gradient Compression for PyTorch (Lin et al., ICLR 2018).

Library entry points: :func:`build_compressor`, :class:`GradientSync`, :class:`SGD`,
:func:`ddp_comm_hook`. The library never imports Hydra; ``python -m dgc.train`` does.
"""

from dgc.compressors import COMPRESSORS, build_compressor
from dgc.hook import ddp_comm_hook
from dgc.optim import SGD
from dgc.sync import GradientSync, Policy, StepStats

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "SGD",
    "GradientSync",
    "Policy",
    "StepStats",
    "build_compressor",
    "ddp_comm_hook",
]
