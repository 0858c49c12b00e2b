"""Typed configuration of a training run (plain dataclasses; Hydra registers them as schemas).

The entry point (:mod:`dgc.train`) composes YAML files from ``conf/`` on top of these schemas, so an
unknown key or a wrong type fails at compose time, and turns the result into these objects for the
trainer. ``compression`` is typed by the chosen compressor's own config dataclass
(:class:`dgc.compressors.CompressorConfig` subclasses), ``sync`` by :class:`dgc.sync.config.SyncConfig`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dgc.compressors import CompressorConfig
from dgc.localsteps import LocalStepsConfig
from dgc.sync.config import SyncConfig


def data_home() -> Path:
    """Where the data sets live: ``$DGC_DATA``; else the ``data/`` folder of a source checkout (where
    ``make data`` builds); else ``~/.cache/dgc/data``. The configs' ``${data_home:kjv}`` is a folder in it."""
    if os.environ.get("DGC_DATA"):
        return Path(os.environ["DGC_DATA"]).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "conf").is_dir():
        return checkout / "data"
    return Path.home() / ".cache" / "dgc" / "data"


def data_dir(sub: str = "", system: str = "") -> str:
    """``${data_home:sub}``: the folder ``sub`` of :func:`data_home`. ``${data_home:sub,SYSTEM}``: the same when
    that folder exists, else the system-wide copy ``SYSTEM`` (Debian's data packages)."""
    mine = data_home() / sub
    if system and not mine.is_dir():
        return system
    return str(mine)


OmegaConf.register_new_resolver("data_home", data_dir, replace=True)


@dataclass(frozen=True)
class Range:
    """Where a numeric setting may lie (``None``: unbounded on that side); finite always. Beside each field of the
    schema (:func:`ranged`), checked for every field at once by :func:`check_ranges`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, v: float) -> bool:
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or (v < self.high if self.high_open else v <= self.high)
        return math.isfinite(v) and above and below

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"
        low, high = _plain(self.low), _plain(self.high)
        if self.low is not None and self.high is not None:
            return f"{kind} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {high}"
        return f"a finite {kind[2:] if integer else 'number'}"


def _plain(x: float | None) -> str:
    """A bound as people write it: 1000000, not 1e+06."""
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e12 else f"{x:g}"


def ranged(default: Any, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Any:  # fmt: skip
    """A schema field with its :class:`Range` (of each element, for a list default)."""
    meta = {"range": Range(low, high, low_open, high_open)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Every :func:`ranged` field of the dataclass ``obj`` and of the dataclasses in it, at once: a value (or an element
    of a list) outside its range, not finite, or not a number is a ValueError with one line naming the setting, what
    it may be, and the value. ``None`` passes (the optional settings: ``null`` is off)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        rng = f.metadata.get("range")
        if rng is None:
            if is_dataclass(value):
                check_ranges(value, path + ".")
            continue
        kind = str(f.type)
        for v in value if isinstance(value, list | tuple) else [value]:
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if v is None or (number and rng.holds(float(v))):
                continue
            optional = " or null" if "None" in kind else ""
            each = "each of " if isinstance(value, list | tuple) else ""
            raise ValueError(f"{each}{path} must be {rng.describe(kind.startswith(('int', 'list[int')))}{optional}, "
                             f"got {value!r}")  # fmt: skip


def config_keys(obj: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a config's dataclasses (``optim.lr``, ``compression.density``, ...); a dict field
    (``model.args``) is a key whose every sub-key is allowed."""
    out: set[str] = set()
    for f in fields(obj):
        value = getattr(obj, f.name)
        out.add(prefix + f.name)
        if is_dataclass(value):
            out |= config_keys(value, f"{prefix}{f.name}.")
    return out


class ConfigError(ValueError):
    """A problem the user can fix (a bad setting, a run directory that cannot be used, a corrupt checkpoint,
    a full disk); the message is one line saying what is wrong and what to do. Exit status 2."""


#: exit statuses of ``python -m dgc.train``
EXIT_OK, EXIT_ERROR, EXIT_USER, EXIT_DIVERGED, EXIT_STALLED = 0, 1, 2, 3, 4
#: stopped at a step boundary on SIGTERM / SIGUSR1 after a checkpoint: run the same command again to continue
EXIT_INTERRUPTED = 75


@dataclass
class TaskConfig:
    name: str = "???"
    #: which task family runs it: image | language | speech | causal_lm
    kind: str = "image"
    #: DGC's density warm-up for this task, in epochs; used by the sparse compression presets
    compression_warmup_epochs: float = ranged(0.0, 0)
    #: DGC's local gradient clipping threshold for this task (null: off); used by compression/dgc.yaml
    local_clip_norm: float | None = ranged(None, 0, low_open=True)


@dataclass
class ModelConfig:
    #: model builder, see ``dgc.tasks.models``
    name: str = "???"
    #: keyword arguments of the builder (checked against its signature before the run starts)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    #: data source, see ``dgc.tasks``
    name: str = "???"
    #: where the data lives on disk
    root: str = "???"
    #: use only the first N training examples (quick runs)
    limit: int | None = ranged(None, 1)
    #: evaluate on only the first N evaluation examples
    eval_limit: int | None = ranged(None, 1)
    augment: bool = True
    #: image tasks: hold out this many training images as a validation split (0: none)
    validation: int = ranged(0, 0)
    loader_workers: int = ranged(0, 0)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    #: sgd (momentum SGD, :class:`dgc.SGD`: what DGC's momentum correction needs) | adamw (``torch.optim.AdamW``,
    #: decoupled weight decay; ``momentum`` and ``nesterov`` unused)
    name: str = "sgd"
    #: learning rate per worker; multiplied by the world size when ``scale_lr``
    lr: float = ranged(0.1, 0, low_open=True)
    scale_lr: bool = True
    momentum: float = ranged(0.9, 0, 1, high_open=True)
    nesterov: bool = False
    weight_decay: float = ranged(1e-4, 0)
    #: no weight decay on BatchNorm parameters and biases (tensors with dim <= 1)
    no_decay_1d: bool = False
    #: adamw: the decay rates of the first and second moment estimates
    betas: list[float] = ranged([0.9, 0.999], 0, 1, high_open=True)
    #: adamw: added to the square root of the second moment
    eps: float = ranged(1e-8, 0, 1, low_open=True)
    #: cosine | multistep | constant
    schedule: str = "cosine"
    #: cosine: the rate at the end of the run, as a fraction of the peak rate (nanoGPT: 0.1)
    final_lr_ratio: float = ranged(0.0, 0, 1)
    #: epochs at which multistep multiplies the rate by ``gamma``
    milestones: list[float] = ranged([], 0)
    gamma: float = ranged(0.1, 0, low_open=True)
    #: linear learning-rate warm-up, in epochs
    warmup_epochs: float = ranged(0.0, 0)
    #: global gradient-norm clipping after aggregation (the dense baseline's clipping); null: off
    grad_clip: float | None = ranged(None, 0, low_open=True)


@dataclass
class TrainConfig:
    epochs: float = ranged(1.0, 0, 1e6, low_open=True)
    #: batch per worker (per micro-batch when accumulating)
    batch_size: int = ranged(32, 1)
    eval_batch_size: int = ranged(256, 1)
    #: micro-batches per optimizer step
    accumulate: int = ranged(1, 1)
    #: stop after N optimizer steps, then evaluate and write the summary
    max_steps: int | None = ranged(None, 1)
    log_every: int = ranged(10, 1)
    #: checkpoint every N steps (0: by time and at the end of each epoch and of the run only)
    checkpoint_every: int = ranged(0, 0)
    #: and whenever this many minutes passed since the last checkpoint (0: never by time)
    checkpoint_minutes: float = ranged(10.0, 0)
    #: end the run (exit status 3) after this many steps in a row with non-finite gradients (skipped)
    max_bad_steps: int = ranged(5, 1)
    #: bf16 autocast (CUDA only)
    bf16: bool = False
    #: progress bar on rank 0
    progress: bool = True
    #: when the test split is evaluated: "every" evaluation, or only at the run's "end" (the evaluations before
    #: it read the validation split only, and none are made for a task without one): settings chosen on the
    #: validation curve, the test split read once; "never": the validation split only (choosing settings)
    test_eval: str = "every"


@dataclass
class LoggerConfig:
    #: also log to Weights & Biases (offline unless ``mode=online``)
    wandb: bool = False
    project: str = "dgc"
    mode: str = "offline"


@dataclass
class Config:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: the compressor and its options (conf/compression/<name>.yaml, typed by the compressor's config)
    compression: CompressorConfig = field(default_factory=CompressorConfig)
    #: local clipping, which tensors are compressed, the DDP hook
    sync: SyncConfig = field(default_factory=SyncConfig)
    #: every H steps the pseudo-gradient instead of every step's gradient (DiLoCo, SparseLoCo; dgc.localsteps)
    local_steps: LocalStepsConfig = field(default_factory=LocalStepsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    #: run directory shared by all ranks (default: runs/<task>/<compression>/<time>)
    run_dir: str | None = None
    seed: int = ranged(0, 0)
    #: continue the run in ``run_dir`` from its checkpoint: true (must), false (must not), auto (when there is one)
    resume: Any = False
    #: settings that may differ from the checkpoint's when resuming (e.g. [train.epochs]); others are refused
    resume_allow: list[str] = field(default_factory=list)
    #: how long a collective may wait for the other ranks before the run ends (exit status 4)
    timeout_s: float = ranged(600.0, 1, 1e6)
    #: auto | cpu | cuda
    device: str = "auto"

    def __post_init__(self) -> None:
        check_ranges(self)
        # resume_allow names settings (a key, or a group: optim, model.args.): one that is none would allow nothing
        keys = config_keys(self) | {"world_size"}
        dicts = tuple(f"{k}." for k in ("model.args", "data.args"))
        unknown = [k for k in self.resume_allow if str(k).rstrip(".") not in keys and not str(k).startswith(dicts)]
        if unknown:
            raise ValueError(f"resume_allow names no setting: {', '.join(map(str, unknown))}; give dotted keys such "
                             "as train.epochs or optim.lr, a group such as optim, or world_size")  # fmt: skip


def method_name(cfg: Config) -> str:
    """What a run is called: its compressor, and ``-local<H>`` with local steps (``none-local16``: DiLoCo)."""
    every = cfg.local_steps.every
    return cfg.compression.name if not every else f"{cfg.compression.name}-local{every}"


def config_from_dict(data: dict[str, Any]) -> Config:
    """A :class:`Config` from its plain form (a run's ``config.yaml``, a checkpoint's ``config``), typed and checked
    like a composed one: ``compression`` by its compressor's config class."""
    from omegaconf import OmegaConf

    from dgc.compressors import config_class

    schema = OmegaConf.structured(Config)
    name = (data.get("compression") or {}).get("name", "none")
    schema.compression = OmegaConf.structured(config_class(name))
    out = OmegaConf.to_object(OmegaConf.merge(schema, data))
    assert isinstance(out, Config)
    return out
