"""Typed configuration of a training run (plain dataclasses; Hydra registers them as schemas).

The entry point (:mod:`dgc.train`) composes YAML files from ``conf/`` on top of these schemas, so an
unknown key or a wrong type fails at compose time, and turns the result into these objects for the
trainer. ``compression`` is typed by the chosen compressor's own config dataclass
(:class:`dgc.compressors.CompressorConfig` subclasses), ``sync`` by :class:`dgc.sync_config.SyncConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dgc.compressors import CompressorConfig
from dgc.localsteps import LocalStepsConfig
from dgc.sync_config import SyncConfig


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
    compression_warmup_epochs: float = 0.0
    #: DGC's local gradient clipping threshold for this task (null: off); used by compression/dgc.yaml
    local_clip_norm: float | None = None


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
    limit: int | None = None
    #: evaluate on only the first N evaluation examples
    eval_limit: int | None = None
    augment: bool = True
    #: image tasks: hold out this many training images as a validation split (0: none)
    validation: int = 0
    loader_workers: int = 0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    #: sgd (momentum SGD, :class:`dgc.SGD`: what DGC's momentum correction needs) | adamw (``torch.optim.AdamW``,
    #: decoupled weight decay; ``momentum`` and ``nesterov`` unused)
    name: str = "sgd"
    #: learning rate per worker; multiplied by the world size when ``scale_lr``
    lr: float = 0.1
    scale_lr: bool = True
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    #: no weight decay on BatchNorm parameters and biases (tensors with dim <= 1)
    no_decay_1d: bool = False
    #: adamw: the decay rates of the first and second moment estimates
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    #: adamw: added to the square root of the second moment
    eps: float = 1e-8
    #: cosine | multistep | constant
    schedule: str = "cosine"
    #: cosine: the rate at the end of the run, as a fraction of the peak rate (nanoGPT: 0.1)
    final_lr_ratio: float = 0.0
    #: epochs at which multistep multiplies the rate by ``gamma``
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1
    #: linear learning-rate warm-up, in epochs
    warmup_epochs: float = 0.0
    #: global gradient-norm clipping after aggregation (the dense baseline's clipping); null: off
    grad_clip: float | None = None


@dataclass
class TrainConfig:
    epochs: float = 1.0
    #: batch per worker (per micro-batch when accumulating)
    batch_size: int = 32
    eval_batch_size: int = 256
    #: micro-batches per optimizer step
    accumulate: int = 1
    #: stop after N optimizer steps, then evaluate and write the summary
    max_steps: int | None = None
    log_every: int = 10
    #: checkpoint every N steps (0: by time and at the end of each epoch and of the run only)
    checkpoint_every: int = 0
    #: and whenever this many minutes passed since the last checkpoint (0: never by time)
    checkpoint_minutes: float = 10.0
    #: end the run (exit status 3) after this many steps in a row with non-finite gradients (skipped)
    max_bad_steps: int = 5
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
    seed: int = 0
    #: continue the run in ``run_dir`` from its checkpoint: true (must), false (must not), auto (when there is one)
    resume: Any = False
    #: settings that may differ from the checkpoint's when resuming (e.g. [train.epochs]); others are refused
    resume_allow: list[str] = field(default_factory=list)
    #: how long a collective may wait for the other ranks before the run ends (exit status 4)
    timeout_s: float = 600.0
    #: auto | cpu | cuda
    device: str = "auto"


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
