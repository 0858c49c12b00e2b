"""``python -m dgc.train`` end to end: torchrun, crash and exact resume, bad overrides, run dirs, schedules, wandb.

The runs are tiny (Fashion-MNIST IDX files with a few dozen images written by the tests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from dgc.tasks.tiny_data import write_fmnist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.distributed import init_distributed
from dgc.repro import residual as residual_tool
from dgc.repro.config import Config, config_from_dict
from dgc.repro.trainer import ConfigError, Trainer, learning_rate
from tests.runs import TINY, assert_same_training, cli, load, records


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return write_fmnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=64, n_test=16)


# -- torchrun, two ranks -------------------------------------------------------------------

#: 48 images / (2 ranks x 4) = 6 steps per epoch; 8 steps cross an epoch end
TORCHRUN = [*TINY, "compression=dgc", "compression.density=0.05", "task.compression_warmup_epochs=0.34"]
TORCHRUN += ["data.limit=48", "train.max_steps=8", "train.checkpoint_every=2", "train.log_every=1"]


@pytest.fixture(scope="module")
def torchrun_run(fmnist, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("torchrun")
    out = cli([*TORCHRUN, f"data.root={fmnist}"], cwd, torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    return cwd, out


def test_torchrun_two_ranks(torchrun_run):
    cwd, out = torchrun_run
    # one run dir picked by rank 0 for both ranks, and nothing else written (no outputs/, .hydra, logs)
    assert sorted(os.listdir(cwd)) == ["runs"]
    run_dirs = list(cwd.glob("runs/*/*/*"))
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    assert run_dir.parent.name == "dgc" and run_dir.parent.parent.name == "fmnist_resnet20"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint.prev.pt",  # the last two checkpoints are kept
        "checkpoint.pt",
        "config.yaml",
        "env.json",
        "metrics.jsonl",
        "summary.json",
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["task"] == "fmnist_resnet20" and summary["compression"] == "dgc"
    assert 0 <= summary["metrics"]["top1"] <= summary["metrics"]["top5"] <= 100
    assert summary["wire_ratio"] > 5 and summary["bytes_per_step"] > 0
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 2
    # the evaluation after the epoch (step 6) and at the end (step 8), over both ranks' shards
    assert [r["step"] for r in records(run_dir, "eval")] == [6, 8]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 9))
    # the rate is scaled by the 2 workers and follows the warm-up of the fmnist task
    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    for r in records(run_dir, "train"):
        assert r["lr"] == pytest.approx(learning_rate(cfg, 2 * cfg.optim.lr, (r["step"] - 1) / 6), rel=1e-9)
    # one line of console output per rank-0 event, none from rank 1
    assert out.stdout.count("run dir ") == 1
    state = load(run_dir)
    assert state["world_size"] == 2 and [r["compression"]["rank"] for r in state["ranks"]] == [0, 1]
    residual = [r["compression"]["compressor"]["tensors"]["fc.weight"]["v"] for r in state["ranks"]]
    assert not torch.equal(*residual)  # each rank keeps its own residual


def test_the_residual_of_a_two_rank_run_can_be_inspected(torchrun_run, capsys):
    """python -m dgc.repro.residual reads both ranks' velocity and residual from the run's real checkpoint."""
    (run_dir,) = torchrun_run[0].glob("runs/*/*/*")
    residual_tool.main([str(run_dir)])
    out = capsys.readouterr().out
    rows, total = residual_tool.summarize(load(run_dir))
    assert "step 8, 2 ranks" in out and all(f"\n{r['tensor']} " in out for r in rows)
    assert rows and all(r["v"] > 0 and r["u"] > 0 and r["max_over_median"] >= 1 for r in rows if r["numel"] > 100)
    assert total["ranks"] == 2 and total["step"] == 8 and total["v_over_u"] > 0


def test_torchrun_crash_and_resume(torchrun_run, fmnist, tmp_path):
    cwd, _ = torchrun_run
    (reference,) = cwd.glob("runs/*/*/*")
    run_dir = tmp_path / "b"
    args = [*TORCHRUN, f"data.root={fmnist}", f"run_dir={run_dir}"]
    # both ranks kill themselves after step 3: after the checkpoint of step 2 and the log line of step 3
    out = cli(args, tmp_path, torchrun=True, env={"DGC_FAULTS": "kill@3"})
    assert out.returncode != 0
    assert not (run_dir / "summary.json").exists()
    assert load(run_dir)["counters"]["step"] == 2
    assert [r["step"] for r in records(run_dir, "train")] == [1, 2, 3]
    out = cli([*args, "resume=true"], tmp_path, torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resuming" in out.stdout and "at step 2" in out.stdout
    assert_same_training(reference, run_dir)


# -- crash and resume, one process ---------------------------------------------------------


def test_crash_and_resume(fmnist, tmp_path):
    # 32 images / 4 = 8 steps per epoch; the crash is mid-epoch and the run goes on past the epoch's end.
    # A small density after a short warm-up, so residuals and momenta matter.
    args = [*TINY, f"data.root={fmnist}", "compression=dgc", "compression.density=0.05"]
    args += ["task.compression_warmup_epochs=0.25", "data.limit=32", "train.max_steps=10"]
    args += ["train.checkpoint_every=2", "train.log_every=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    out = cli([*args, f"run_dir={a}"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]

    # killed after step 5: after the checkpoint of step 4 and after step 5 was logged
    out = cli([*args, f"run_dir={b}"], tmp_path, env={"DGC_FAULTS": "kill@5"})
    assert out.returncode == -signal.SIGKILL
    assert not (b / "summary.json").exists()
    assert load(b)["counters"]["step"] == 4
    assert [r["step"] for r in records(b, "train")] == [1, 2, 3, 4, 5]

    out = cli([*args, f"run_dir={b}", "resume=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"resuming {b} at step 4" in out.stdout
    assert json.loads((b / "summary.json").read_text())["steps"] == 10
    assert [r["step"] for r in records(b, "train")] == list(range(1, 11))
    assert [r["step"] for r in records(b, "eval")] == [8, 10]
    assert_same_training(a, b)
    sa, sb = json.loads((a / "summary.json").read_text()), json.loads((b / "summary.json").read_text())
    for key in ("steps", "metrics", "wire_ratio", "bytes_per_step", "wire_ratio_all_steps"):
        assert sa[key] == sb[key], key


def test_checkpoints_follow_the_evaluation(fmnist, tmp_path, monkeypatch):
    """One checkpoint per step, and at the end of an epoch or of the run it is taken after the evaluation
    (a resumed run then neither evaluates nor logs that step twice)."""
    from dgc.repro.rundir import RunFiles

    saved = []
    original = RunFiles.save_checkpoint

    def save(self, state):
        saved.append((state["counters"]["step"], state["last_eval"][1]))
        original(self, state)

    monkeypatch.setattr(RunFiles, "save_checkpoint", save)
    args = [*TINY, f"data.root={fmnist}", "data.limit=16", "train.max_steps=6", "train.checkpoint_every=2"]
    cfg = _compose(*args, "data.eval_limit=4", f"run_dir={tmp_path / 'r'}")
    Trainer(cfg, init_distributed("cpu")).fit()
    # 4 steps per epoch: evaluations at 4 (epoch end) and 6 (run end)
    assert saved == [(2, -1), (4, 4), (6, 6)]


# -- mistakes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        (["task=nope"], "unknown task 'nope'; valid: "),
        (["compression=dgc", "compression.density=0"], "density"),
        (["data.root=/nonexistent"], "/nonexistent"),
        (["resume=true"], "resume=true but"),
        (["train.max_step=3"], "max_step"),
        (["optim.lr=abc"], "optim.lr"),
        (["train.test_eval=sometimes"], "train.test_eval must be one of every, end, never"),
        (["train.test_eval=never"], "train.test_eval=never evaluates the validation split only, and fmnist_resnet20"),
        (["sync.overlap=true"], "sync.overlap=true needs sync.ddp_hook=true"),
        (
            ["sync.ddp_hook=true", "sync.overlap=true", "sync.clip_norm=1", "sync.clip_scope=step"],
            "use clip_scope=tensor (or auto) with sync.overlap=true",
        ),
        (["sync.pack=all", "sync.exchange=hierarchical"], "sync.pack=all needs sync.exchange=flat"),
        (["sync.pack=dense", "sync.exchange=auto"], "sync.exchange=auto may choose another: set sync.exchange=flat"),
        (["data.eval_limit=0"], "data.eval_limit must be an integer >= 1 or null, got 0"),
        (["optim.momentum=nan"], "optim.momentum must be a number in [0, 1), got nan"),
    ],
    ids=[
        "unknown-task",
        "density-0",
        "missing-data",
        "resume-without-checkpoint",
        "typo",
        "wrong-type",
        "test-eval",
        "test-eval-never",
        "overlap-without-hook",
        "overlap-whole-clip",
        "pack-dense-hierarchical",
        "pack-with-auto-exchange",
        "eval-limit-0",
        "momentum-nan",
    ],
)
def test_bad_overrides(override, message, fmnist, tmp_path):
    run_dir = tmp_path / "r"
    cwd = tmp_path / "cwd"
    args = [*TINY, f"data.root={fmnist}", "train.max_steps=1", *override, f"run_dir={run_dir}"]
    out = cli(args, cwd)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in out.stdout + out.stderr
    assert not run_dir.exists()
    assert os.listdir(cwd) == []


def test_a_value_out_of_range_under_the_launcher_is_one_line_before_any_worker_starts(fmnist, tmp_path):
    """timeout_s=inf under --nproc ended in a traceback from the process group: the launcher refuses it first."""
    run_dir = tmp_path / "r"
    out = cli([*TINY, f"data.root={fmnist}", "timeout_s=inf", f"run_dir={run_dir}"], tmp_path, nproc=2)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: timeout_s must be a number in [1, 1000000], got inf"
    assert not run_dir.exists() and "Traceback" not in out.stdout


def test_test_eval_end_without_a_validation_split_evaluates_once(fmnist, tmp_path):
    """Fashion-MNIST has no validation split: with train.test_eval=end only the run's end is evaluated."""
    cfg = _compose(*TINY, f"data.root={fmnist}", "data.limit=32", "train.epochs=2", "train.test_eval=end",
                   f"run_dir={tmp_path / 'r'}")  # fmt: skip
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    evals = records(tmp_path / "r", "eval")
    assert [e["step"] for e in evals] == [summary["steps"]] and "top1" in evals[0]


def test_existing_run_is_refused(fmnist, tmp_path):
    run_dir = tmp_path / "r"
    args = [*TINY, f"data.root={fmnist}", "train.max_steps=1", f"run_dir={run_dir}"]
    cfg = _compose(*args)
    Trainer(cfg, init_distributed("cpu")).fit()
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    out = cli(args, tmp_path)
    assert out.returncode != 0
    assert (
        out.stderr.strip()
        == f"error: {run_dir} already holds a run: pass resume=true (or resume=auto) to continue it, or another run_dir"
    )
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_run_without_checkpoint_is_refused(fmnist, tmp_path):
    # a run that stopped before its first checkpoint left a log: a new run would append to it
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    cfg = _compose(*TINY, f"data.root={fmnist}", "train.max_steps=1", f"run_dir={run_dir}")
    with pytest.raises(ConfigError, match="no checkpoint"):
        Trainer(cfg, init_distributed("cpu")).fit()
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]  # left as it was
    # an empty directory is fine
    (run_dir / "metrics.jsonl").unlink()
    assert Trainer(cfg, init_distributed("cpu")).fit()["steps"] == 1


def _compose(*overrides: str) -> Config:
    with initialize_config_module("dgc.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))  # type: ignore[return-value]


# -- learning-rate schedules ---------------------------------------------------------------


def _lr_config(**optim) -> Config:
    cfg = Config()
    cfg.train.epochs = 10
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    return cfg


def test_learning_rate_warmup_is_linear():
    cfg = _lr_config(warmup_epochs=2, schedule="constant")
    rates = [learning_rate(cfg, 0.4, e) for e in (0.0, 0.5, 1.0, 1.5)]
    steps = [b - a for a, b in zip(rates, rates[1:])]
    assert steps == pytest.approx([0.1, 0.1, 0.1], rel=1e-9)
    assert 0 < rates[0] < 1e-3
    assert learning_rate(cfg, 0.4, 1.999) == pytest.approx(0.4, rel=1e-3)
    assert learning_rate(cfg, 0.4, 2.0) == 0.4 == learning_rate(cfg, 0.4, 9.0)


def test_learning_rate_cosine():
    cfg = _lr_config(warmup_epochs=2, schedule="cosine")
    assert learning_rate(cfg, 0.4, 2.0) == pytest.approx(0.4)
    assert learning_rate(cfg, 0.4, 6.0) == pytest.approx(0.2)  # half way through the 8 epochs after warm-up
    assert learning_rate(cfg, 0.4, 9.99) < 1e-5
    assert learning_rate(cfg, 0.4, 10.0) == pytest.approx(0.0, abs=1e-12)
    rates = [learning_rate(cfg, 0.4, 2 + e / 10) for e in range(81)]
    assert all(x > y for x, y in zip(rates, rates[1:]))


def test_learning_rate_multistep():
    cfg = _lr_config(warmup_epochs=1, schedule="multistep", milestones=[3, 6], gamma=0.1)
    assert learning_rate(cfg, 0.4, 0.5) == pytest.approx(0.4 * 0.501)
    assert learning_rate(cfg, 0.4, 2.99) == 0.4
    assert learning_rate(cfg, 0.4, 3.0) == pytest.approx(0.04)
    assert learning_rate(cfg, 0.4, 5.99) == pytest.approx(0.04)
    assert learning_rate(cfg, 0.4, 6.0) == pytest.approx(0.004)
    assert learning_rate(cfg, 0.4, 9.0) == pytest.approx(0.004)


# -- Weights & Biases, offline -------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline(fmnist, tmp_path):
    run_dir = tmp_path / "r"
    cwd = tmp_path / "cwd"
    home = tmp_path / "home"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }
    args = [*TINY, f"data.root={fmnist}", "logger=wandb", "train.max_steps=2", "train.log_every=1"]
    out = cli([*args, f"run_dir={run_dir}"], cwd, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (log,) = runs[0].glob("run-*.wandb")
    assert log.stat().st_size > 0
    assert os.listdir(cwd) == []  # nothing under the working directory (no ./wandb)
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.logger.wandb is True and saved.logger.mode == "offline"


BLOCK = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
"""


def test_a_python_without_the_environment_gets_one_line(tmp_path):
    """``python -m dgc.train`` with a Python that lacks torch (the system one, not .venv's): which module is
    missing and what to run, exit 2, no traceback; ``import dgc`` there still raises the ImportError."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).parents[1]}"}
    out = subprocess.run([sys.executable, "-m", "dgc.train"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: torch is not installed for {sys.executable}: run `make install`, then use .venv/bin/python "
        "(or `source .venv/bin/activate`)"
    )
    out = subprocess.run([sys.executable, "-c", "import dgc"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.strip().endswith("ModuleNotFoundError: No module named 'torch'")
