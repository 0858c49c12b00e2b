"""Train any task with any compressor.

One process::

    python -m dgc.train task=fmnist_resnet20 compression=dgc train.max_steps=200

Data parallel on one machine (gloo on CPU, NCCL on GPU)::

    torchrun --nproc_per_node=4 -m dgc.train task=cifar10_resnet110 compression=dgc data.root=~/data

Several nodes: ``launch/slurm/`` (srun + torchrun with c10d rendezvous). A sweep, one run
after another (never inside torchrun)::

    python -m dgc.train -m task=fmnist_resnet20 compression=none,topk,dgc

Common overrides: ``run_dir=PATH seed=N train.max_steps=N data.limit=N resume=true``;
``python -m dgc.train --cfg job`` prints the composed configuration.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields, is_dataclass
from typing import NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dgc.compressors import COMPRESSORS
from dgc.repro.config import Config

CONFIG_MODULE = "dgc.conf"
ConfigStore.instance().store(name="schema", node=Config)
# each compressor's config is the schema of its presets (conf/compression/*.yaml: /schema/compression/<name>)
for _name, _cls in COMPRESSORS.items():
    ConfigStore.instance().store(group="schema/compression", name=_name, node=_cls.config_class)


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _valid_keys(path: str, owner: object = None) -> str:
    """The keys valid next to ``path``: of ``owner`` (the dataclass that refused a key) when known."""
    if is_dataclass(owner):
        return ", ".join(f.name for f in fields(owner))
    node: object = Config
    for part in path.split(".")[:-1]:
        kinds = {f.name: f.type for f in fields(node)} if is_dataclass(node) else {}
        if part not in kinds:
            break
        node = {f.name: f.default_factory for f in fields(node)}.get(part)  # type: ignore[arg-type]
        node = node() if callable(node) else node
    return ", ".join(f.name for f in fields(node)) if is_dataclass(node) else ""


def precheck(overrides: list[str]) -> None:
    """Compose a single run's config once up front, so mistakes get one clear line."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from dgc.conf import options

    user = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "--", "-"))]
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            typed(compose("config", overrides=user))
    except MissingConfigException as exc:
        for group in ("task", "compression", "logger", "model", "data", "optim"):
            for o in user:
                if o.split("=", 1)[0].lstrip("+~") == group and o.split("=", 1)[1] not in options(group):
                    _fail(f"unknown {group} {o.split('=', 1)[1]!r}; valid: {', '.join(options(group))}")
        _fail(str(exc).splitlines()[0])
    except (ConfigCompositionException, OmegaConfBaseException) as exc:
        cause = exc.__cause__ or exc
        message = " ".join(str(cause).split("\n")[0].split())
        key = getattr(cause, "full_key", None) or ""
        valid = _valid_keys(key, getattr(cause, "object_type", None)) if key else ""
        if key and key not in message:
            message = f"{key}: {message}"
        _fail(f"{message}" + (f" (valid keys: {valid})" if valid and "not in" in message else ""))


def typed(cfg: DictConfig) -> Config:
    """The composed config as dataclasses; their checks (``__post_init__``) fail with one line."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, TypeError) as exc:
        _fail(str(exc).splitlines()[0])


@hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")
def _main(cfg: DictConfig) -> dict | None:
    from dgc.distributed import init_distributed, shutdown
    from dgc.repro import faults
    from dgc.repro.config import ConfigError
    from dgc.repro.trainer import Trainer

    config = typed(cfg)
    try:
        callbacks = faults.from_env()
    except ValueError as exc:
        _fail(str(exc))
    try:
        info = init_distributed(config.device)
    except ValueError as exc:  # e.g. device=cuda without CUDA
        _fail(str(exc).splitlines()[0])
    try:
        trainer = Trainer(config, info, callbacks=callbacks)
        summary = trainer.fit()
    except ConfigError as exc:
        shutdown(clean=False)
        _fail(str(exc).splitlines()[0])
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()
    return summary


def main() -> None:
    args = sys.argv[1:]
    multirun = any(a in ("-m", "--multirun") for a in args)
    if multirun and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail("a Hydra multirun (-m) inside torchrun would run the whole sweep on every rank; sweep outside torchrun")
    if not multirun and not any(a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c") for a in args):
        precheck(args)
    _main()


if __name__ == "__main__":
    main()
