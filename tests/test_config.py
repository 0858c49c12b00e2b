"""The Hydra configuration: every task with every compressor composes into a valid run; mistakes fail early."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dgc.conf import options
from dgc.tasks.models import MODELS
from dgc.tasks.tiny_data import write_fmnist
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import dgc
import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.repro import locate, presets
from dgc.repro.config import Config

TASKS = options("task")
COMPRESSORS = options("compression")


def compose_config(*overrides: str) -> Config:
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_groups_are_found():
    assert {"fmnist_resnet20", "cifar10_resnet20", "cifar10_resnet110", "imagenet_resnet50", "imagenet_alexnet"} <= set(
        TASKS
    )
    assert {"none", "fp16", "topk", "dgc", "terngrad", "powersgd"} <= set(COMPRESSORS)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("compression", COMPRESSORS)
def test_every_task_with_every_compressor(task, compression):
    cfg = compose_config(f"task={task}", f"compression={compression}")
    assert isinstance(cfg, Config)
    assert cfg.task.name == task
    # a preset is named after its compressor, or after it with a suffix (dgc_compact); a local-steps method after
    # the method (diloco: local steps around the dense compressors)
    assert cfg.compression.name in dgc.COMPRESSORS
    if cfg.local_steps.every:
        dgc.LocalStepsConfig(**vars(cfg.local_steps))
        assert compression.split("_")[0] in ("diloco", "sparseloco")
    else:
        assert cfg.compression.name == compression.split("_")[0]
    # the compressor builds from its options, and the model arguments are ones the builder takes
    compressor = dgc.build_compressor(cfg.compression)
    assert compressor.name == cfg.compression.name and compressor.config == cfg.compression
    assert isinstance(cfg.sync, dgc.SyncConfig) and isinstance(cfg.sync.policy, dgc.Policy)
    assert cfg.model.name in MODELS
    assert set(cfg.model.args) <= set(inspect.signature(MODELS[cfg.model.name]).parameters)
    assert cfg.train.epochs > 0 and cfg.train.batch_size >= 1 and cfg.optim.lr > 0


@pytest.mark.parametrize("name", COMPRESSORS)
def test_benchmarks_build_the_presets_hydra_composes(name):
    """dgc.repro.presets (benchmarks, demo) reads the same files: the same compressor and sync settings."""
    cfg = compose_config("task=cifar10_resnet20", f"compression={name}")  # a task that sets no sync option
    task = {"compression_warmup_epochs": cfg.task.compression_warmup_epochs, "local_clip_norm": 0.5}
    spec = presets.preset(name, task=task)
    assert spec.compression == cfg.compression
    assert spec.sync.policy == cfg.sync.policy and spec.sync.ddp_hook == cfg.sync.ddp_hook
    uses_task_clip = compose_config("task=cifar10_resnet20", f"compression={name}", "task.local_clip_norm=0.5")
    assert spec.sync.clip_norm == uses_task_clip.sync.clip_norm


def test_compact_presets():
    cfg = compose_config("task=fmnist_resnet20", "compression=dgc_compact")
    assert cfg.compression.name == "dgc" and cfg.compression.density == 0.001
    assert (cfg.compression.wire_values, cfg.compression.wire_indices) == ("fp16", "rice")
    assert cfg.sync.policy.dense_values == "1bit" and cfg.sync.policy.min_ndim == 2
    # everything else is the dgc preset's: the task's warm-up and local clipping still apply
    assert cfg.compression.warmup_epochs == cfg.task.compression_warmup_epochs
    assert cfg.sync.clip_norm == cfg.task.local_clip_norm
    every = compose_config("task=cifar10_resnet20", "compression=dgc_compact_all")
    assert every.sync.policy.min_ndim == 1 and every.compression.wire_indices == "rice"


@pytest.mark.parametrize("task", TASKS)
def test_dgc_takes_the_task_warmup(task):
    cfg = compose_config(f"task={task}", "compression=dgc")
    assert cfg.compression.warmup_epochs == cfg.task.compression_warmup_epochs
    assert cfg.sync.clip_norm == cfg.task.local_clip_norm
    compressor = dgc.build_compressor(cfg.compression)
    assert compressor.schedule.warmup_epochs == cfg.task.compression_warmup_epochs
    assert compressor.schedule.density == 0.001


def test_paper_warmups():
    assert compose_config("task=cifar10_resnet20", "compression=dgc").compression.warmup_epochs == 4
    assert compose_config("task=imagenet_resnet50", "compression=dgc").compression.warmup_epochs == 4
    # an override of the task's warm-up reaches the compressor (interpolation, not a copy)
    cfg = compose_config("task=cifar10_resnet20", "compression=dgc", "task.compression_warmup_epochs=2")
    assert cfg.compression.warmup_epochs == 2


def test_task_settings_reach_the_config():
    cfg = compose_config("task=fmnist_resnet20")
    assert cfg.model.args["in_channels"] == 1 and cfg.model.args["depth"] == 20
    assert cfg.data.name == "fmnist" and cfg.optim.lr == 0.025
    cfg = compose_config("task=imagenet_alexnet")
    assert cfg.model.args["arch"] == "alexnet" and cfg.optim.schedule == "multistep"
    assert cfg.optim.milestones == [30, 60]
    cfg = compose_config("task=cifar10_resnet110", "train.max_steps=7", "optim.lr=0.5")
    assert cfg.model.args["depth"] == 110 and cfg.train.max_steps == 7 and cfg.optim.lr == 0.5


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.max_step=3", "max_step"),  # a typo
        ("optim.lr=abc", "lr"),  # a wrong type
        ("train.batch_size=1.5", "batch_size"),
        ("compression.densty=0.1", "densty"),
    ],
)
def test_mistakes_fail_at_compose_time(override, key):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("task=fmnist_resnet20", override)
    assert key in str(info.value) + str(info.value.__cause__)


def test_unknown_group_option_fails():
    with pytest.raises(Exception, match="nope"):
        compose_config("compression=nope")


def test_the_default_run_dir_of_a_job_that_may_restart_is_the_same_in_every_attempt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "811bb351-c65e-498e-94b3-6228d79133b2")
    assert locate.default_run_dir("t", "dgc") == "runs/t/dgc/torchrun-811bb351"
    Path("runs/t/dgc/torchrun-811bb351").mkdir(parents=True)  # a restart finds it, not a fresh one
    assert locate.default_run_dir("t", "dgc") == "runs/t/dgc/torchrun-811bb351"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # a rendezvous without an id says nothing of the job
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert locate.default_run_dir("t", "dgc") == "runs/t/dgc/slurm-4242.3"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert locate.restart_count() == 2 and locate.job_id() == "slurm-4242.3"


def test_default_run_dirs_of_a_sweep_differ(tmp_path, monkeypatch):
    # the jobs of a sweep run in one process within the same second
    monkeypatch.chdir(tmp_path)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):  # (outside a job that may restart)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(locate.time, "strftime", lambda fmt: "20250101-000000")
    first = locate.default_run_dir("t", "dgc")
    assert first == f"runs/t/dgc/20250101-000000-{os.getpid()}"
    Path(first).mkdir(parents=True)
    second = locate.default_run_dir("t", "dgc")
    assert second != first
    Path(second).mkdir()
    assert len({first, second, locate.default_run_dir("t", "dgc")}) == 3


def test_multirun_sweep(tmp_path):
    data = write_fmnist(tmp_path / "fmnist", n_train=32, n_test=16)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "dgc.train",
        "-m",
        "task=fmnist_resnet20",
        "compression=none,dgc",
        "seed=0,1",  # two jobs per compressor: their default run dirs must not collide
        f"data.root={data}",
        "device=cpu",
        "train.max_steps=2",
        "train.batch_size=4",
        "train.eval_batch_size=16",
        "train.progress=false",
    ]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "error:" not in out.stderr
    summaries = sorted(cwd.glob("runs/fmnist_resnet20/*/*/summary.json"))
    assert len(summaries) == 4, summaries
    jobs = []
    for path in summaries:
        summary = json.loads(path.read_text())
        saved = OmegaConf.load(path.parent / "config.yaml")
        assert summary["compression"] == path.parent.parent.name == saved.compression.name
        assert summary["steps"] == 2 and summary["world_size"] == 1
        jobs.append((summary["compression"], saved.seed))
    assert sorted(jobs) == [("dgc", 0), ("dgc", 1), ("none", 0), ("none", 1)]
    # Hydra itself writes no job folders
    assert not (cwd / "outputs").exists() and not (cwd / "multirun").exists()
    assert not list(cwd.rglob(".hydra"))


# -- every value checked, from the schema (issue 56, item 4) --------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    ("optim.momentum=nan", "optim.momentum must be a number in [0, 1), got nan"),
    ("optim.momentum=2", "optim.momentum must be a number in [0, 1), got 2.0"),
    ("optim.momentum=-1", "optim.momentum must be a number in [0, 1), got -1.0"),
    ("optim.weight_decay=nan", "optim.weight_decay must be a number >= 0, got nan"),
    ("optim.weight_decay=-1", "optim.weight_decay must be a number >= 0, got -1.0"),
    ("optim.lr=inf", "optim.lr must be a number > 0, got inf"),
    ("optim.lr=0", "optim.lr must be a number > 0, got 0.0"),
    ("optim.warmup_epochs=nan", "optim.warmup_epochs must be a number >= 0, got nan"),
    ("optim.warmup_epochs=-1", "optim.warmup_epochs must be a number >= 0, got -1.0"),
    ("optim.gamma=nan", "optim.gamma must be a number > 0, got nan"),
    ("optim.milestones=[1,nan]", "each of optim.milestones must be a number >= 0, got [1.0, nan]"),
    ("data.eval_limit=0", "data.eval_limit must be an integer >= 1 or null, got 0"),
    ("data.eval_limit=-1", "data.eval_limit must be an integer >= 1 or null, got -1"),
    ("data.limit=-5", "data.limit must be an integer >= 1 or null, got -5"),
    ("data.loader_workers=-1", "data.loader_workers must be an integer >= 0, got -1"),
    ("train.epochs=inf", "train.epochs must be a number in (0, 1000000], got inf"),
    ("train.eval_batch_size=0", "train.eval_batch_size must be an integer >= 1, got 0"),
    ("timeout_s=inf", "timeout_s must be a number in [1, 1000000], got inf"),
    ("timeout_s=1e-9", "timeout_s must be a number in [1, 1000000], got 1e-09"),
    ("resume_allow=[nonsense]", "resume_allow names no setting: nonsense; give dotted keys such as train.epochs"),
])  # fmt: skip
def test_every_value_is_checked_against_its_range_in_the_schema(override, message):
    with pytest.raises(ValueError) as err:
        compose_config(override)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_ranges_sit_beside_the_fields_and_let_the_valid_values_through():
    from dataclasses import fields

    from dgc.repro.config import OptimConfig, Range, TrainConfig, check_ranges

    ranged = {f.name for cls in (OptimConfig, TrainConfig) for f in fields(cls) if isinstance(f.metadata.get("range"),
                                                                                              Range)}  # fmt: skip
    assert {"lr", "momentum", "weight_decay", "gamma", "warmup_epochs", "epochs", "batch_size"} <= ranged
    cfg = compose_config("resume_allow=[world_size,optim,train.epochs,model.args.depth]", "optim.momentum=0",
                         "data.eval_limit=null", "timeout_s=1")  # fmt: skip
    check_ranges(cfg)  # nothing raised: groups, world_size and dict keys are settings; null is off
    cfg.optim.lr = float("nan")  # changed after it was made: the trainer's check sees it
    with pytest.raises(ValueError, match="optim.lr must be a number > 0, got nan"):
        check_ranges(cfg)


def test_help_lists_the_launcher_flags_exit_statuses_and_examples_then_the_settings(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dgc.train", "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stderr == ""
    text = out.stdout
    assert text.startswith("usage: python -m dgc.train [--nproc N [--max-restarts K]] [-m] [key=value ...]")
    for needed in ("--nproc 4 task=cifar10_resnet110", "Exit status: 0 done; 2 a problem you can fix", "75 stopped",
                   "== Configuration groups ==", "task: an4_deepspeech", "kjv_gpt"):  # fmt: skip
        assert needed in text, needed
    assert text.index("Exit status") < text.index("== Configuration groups ==")
    assert list(tmp_path.iterdir()) == []
