"""The compression presets of ``conf/compression/`` outside Hydra: what the benchmarks and the demo build.

``preset("dgc_compact")`` reads ``conf/compression/dgc_compact.yaml`` (and the presets it extends),
types it with the compressor's config dataclass and :class:`~dgc.sync.config.SyncConfig`, and returns both,
so a benchmark measures exactly what ``python -m dgc.train compression=dgc_compact`` trains with.
Overrides use the command line's syntax (``"compression.wire_indices=int32"``). A preset that takes a
setting from the task (``${task.compression_warmup_epochs}``) gets it from ``task`` (default: no
warm-up, no local clipping: the state after the warm-up, which is what the benchmarks measure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dgc.compressors import CompressorConfig, config_class
from dgc.localsteps import LocalStepsConfig
from dgc.sync.config import SyncConfig

#: the task settings presets may refer to, at the values the benchmarks use
BENCH_TASK = {"compression_warmup_epochs": 0.0, "local_clip_norm": None}
SCHEMA = "/schema/compression/"


@dataclass(frozen=True)
class Preset:
    name: str
    compression: CompressorConfig
    sync: SyncConfig
    #: every H steps a pseudo-gradient (diloco, sparseloco); ``every`` 0 for the per-step methods
    local_steps: LocalStepsConfig = field(default_factory=LocalStepsConfig)


def names() -> list[str]:
    """Every preset (the ``compression`` options of ``python -m dgc.train``)."""
    folder = resources.files("dgc.conf").joinpath("compression")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _load(name: str) -> tuple[str, DictConfig]:
    """``(compressor name, merged preset)`` of one preset file and the presets it extends."""
    if name not in names():
        raise ValueError(f"unknown compression preset {name!r}; valid: {', '.join(names())}")
    raw = OmegaConf.create(resources.files("dgc.conf").joinpath("compression", f"{name}.yaml").read_text())
    defaults = list(raw.pop("defaults", ["_self_"]))
    merged, compressor = OmegaConf.create(), None
    for entry in defaults:
        if entry == "_self_":
            merged = OmegaConf.merge(merged, raw)
        elif str(entry).startswith(SCHEMA):
            compressor = str(entry)[len(SCHEMA) :].split("@")[0]
        else:
            compressor, parent = _load(str(entry))
            merged = OmegaConf.merge(merged, parent)
    if compressor is None:
        raise ValueError(f"compression preset {name!r} names no schema ({SCHEMA}<compressor>)")
    return compressor, merged


def preset(name: str, overrides: Sequence[str] = (), task: Mapping[str, Any] = BENCH_TASK) -> Preset:
    """The compressor config and sync config of preset ``name`` with ``overrides`` applied."""
    compressor, merged = _load(name)
    context = OmegaConf.merge({"task": dict(task)}, merged, OmegaConf.from_dotlist(list(overrides)))
    OmegaConf.resolve(context)
    # typed through the dataclasses: an unknown key or a wrong type fails here, their checks run
    comp = OmegaConf.merge(OmegaConf.structured(config_class(compressor)), context.get("compression") or {})
    sync = OmegaConf.merge(OmegaConf.structured(SyncConfig), context.get("sync") or {})
    local = OmegaConf.merge(OmegaConf.structured(LocalStepsConfig), context.get("local_steps") or {})
    compression_cfg, sync_cfg = OmegaConf.to_object(comp), OmegaConf.to_object(sync)
    local_cfg = OmegaConf.to_object(local)
    assert isinstance(compression_cfg, CompressorConfig) and isinstance(sync_cfg, SyncConfig)
    assert isinstance(local_cfg, LocalStepsConfig)
    return Preset(name, compression_cfg, sync_cfg, local_cfg)
