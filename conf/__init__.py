"""Hydra configs of ``python -m dgc.train`` (installed as ``dgc.conf``).

Groups: ``task`` (picks model, data and optimizer and sets the paper's hyperparameters),
``model``, ``data``, ``optim``, ``compression`` (presets: a compressor, its options and the ``sync``
settings it needs; typed by the compressor's config dataclass), ``logger``.
The schema is :class:`dgc.repro.config.Config`.
"""

from pathlib import Path

_HERE = Path(__file__).parent


def options(group: str) -> list[str]:
    """The option names of a config group (file names without .yaml)."""
    return sorted(p.stem for p in (_HERE / group).glob("*.yaml"))
