"""dgc: Deep Gradient Compression for PyTorch (Lin et al., ICLR 2018).

The library: :func:`build_compressor`, :class:`GradientSync`, :class:`SGD`, :func:`ddp_comm_hook`,
:class:`LocalSteps` (DiLoCo-style local steps around any compressor).
The reproduction framework (trainer, run directories, sweeps, tables) is :mod:`dgc.repro`, run by
``python -m dgc.train``; the library never imports Hydra.
"""

import sys

try:
    from dgc.compressors import COMPRESSORS, CompressorConfig, build_compressor
    from dgc.hook import HookState, ddp_comm_hook
    from dgc.localsteps import LocalSteps, LocalStepsConfig
    from dgc.optim import SGD
    from dgc.policy import Policy
    from dgc.stats import StepStats
    from dgc.stepping import EveryStep, Stepped
    from dgc.sync import GradientSync
    from dgc.sync.config import SyncConfig
except ModuleNotFoundError as _missing:
    # ``python -m dgc.<command>`` (sys.argv[0] is "-m" while the package loads) with a Python that lacks the
    # project's environment: one line saying which, not a traceback; an ``import dgc`` gets the ImportError
    if sys.argv[:1] != ["-m"] or not _missing.name or _missing.name.startswith("dgc"):
        raise
    print(f"error: {_missing.name} is not installed for {sys.executable}: run `make install`, then use "
          ".venv/bin/python (or `source .venv/bin/activate`)", file=sys.stderr)  # fmt: skip
    raise SystemExit(2) from None

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "SGD",
    "CompressorConfig",
    "EveryStep",
    "GradientSync",
    "HookState",
    "LocalSteps",
    "LocalStepsConfig",
    "Policy",
    "StepStats",
    "Stepped",
    "SyncConfig",
    "build_compressor",
    "ddp_comm_hook",
]
