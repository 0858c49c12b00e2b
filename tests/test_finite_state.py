"""The last good state stays good: no checkpoint holding a NaN or an infinity is written, rotated in or resumed
from, and an update that overflows the weights ends the run at once (real ``python -m dgc.train`` processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dgc.tasks.tiny_data import write_fmnist

from dgc.repro import checkpoint
from dgc.repro.config import EXIT_DIVERGED, EXIT_USER
from tests.runs import TINY, cli, load

RUN = [*TINY, "data.limit=64", "data.eval_limit=16", "train.log_every=1", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return write_fmnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=64, n_test=16)


def one_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def test_a_run_whose_state_overflows_keeps_its_last_finite_checkpoints(fmnist, tmp_path):
    """optim.lr=1e3: the loss grows from finite gradients until the BatchNorm statistics overflow (step 6 here);
    that state is not saved, and both kept checkpoints are finite ones from before it."""
    run_dir = tmp_path / "run"
    out = cli([*RUN, f"data.root={fmnist}", "optim.lr=1e3", "train.max_steps=9", f"run_dir={run_dir}"], tmp_path,
              nproc=2)  # fmt: skip
    assert out.returncode == EXIT_DIVERGED, out.stderr[-3000:]
    line = one_line(out)
    assert line.startswith("error: the state of step ") and "holds non-finite values (model." in line
    failed = int(line.split("the state of step ")[1].split()[0])
    assert f"not saved; the run diverged; the last checkpoint (step {failed - 1}, {run_dir})" in line
    kept = checkpoint.paths(run_dir)
    assert [p.name for p in kept] == ["checkpoint.pt", "checkpoint.prev.pt"]
    assert [load(run_dir, p.name)["counters"]["step"] for p in kept] == [failed - 1, failed - 2]
    assert all(checkpoint.nonfinite(load(run_dir, p.name)) == [] for p in kept)
    assert not (run_dir / "summary.json").exists()


def test_an_update_that_overflows_the_weights_ends_the_run_before_anything_is_saved(fmnist, tmp_path):
    """A finite gradient times optim.lr=1.5e41 (3e38 after the warm-up's first step) overflows fc.weight."""
    run_dir = tmp_path / "run"
    out = cli([*RUN, f"data.root={fmnist}", "optim.lr=1.5e41", "train.max_steps=4", f"run_dir={run_dir}"], tmp_path)
    assert out.returncode == EXIT_DIVERGED, out.stderr[-3000:]
    assert one_line(out) == (
        "error: the update of step 1 made the weights non-finite (fc.weight) from a finite gradient: the run "
        "diverged; lower optim.lr; no checkpoint was saved before"
    )
    assert checkpoint.paths(run_dir) == []


def test_a_checkpoint_holding_nan_is_refused_on_resume_naming_the_last_finite_one(fmnist, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, f"data.root={fmnist}", "train.max_steps=3", f"run_dir={run_dir}"]
    assert cli([*args, "train.max_steps=2"], tmp_path).returncode == 0
    # the latest checkpoint gets a NaN weight (as one written before this check could hold)
    state = load(run_dir)
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name].view(-1)[0] = float("nan")
    torch.save(state, run_dir / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    out = cli([*args, "resume=auto"], tmp_path)
    assert out.returncode == EXIT_USER
    assert one_line(out) == (
        f"error: cannot resume from {run_dir / 'checkpoint.pt'}: it holds non-finite values (model.{name}); the "
        f"last finite one is {run_dir / 'checkpoint.prev.pt'} (step 1): remove checkpoint.pt to resume from it"
    )
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing rotated, nothing rewritten
    (run_dir / "checkpoint.pt").unlink()
    out = cli([*args, "resume=auto"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming {run_dir} at step 1" in out.stdout and checkpoint.nonfinite(load(run_dir)) == []


def test_nonfinite_names_where_the_state_is_not_finite():
    ranks = [{"compression": {"r": torch.zeros(2)}}, {"compression": {"r": torch.tensor([0.0, float("inf")])}}]
    state = {"model": {"w": torch.ones(2), "steps": torch.tensor(3)}, "optimizer": {"state": {0: {"m": torch.ones(1)}}}}
    state["ranks"] = ranks
    assert checkpoint.nonfinite(state) == ["ranks[1].compression.r"]
    state["model"]["w"][0] = float("nan")
    state["optimizer"]["state"][0]["m"][0] = float("-inf")
    assert checkpoint.nonfinite(state) == ["model.w", "optimizer.state.0.m", "ranks[1].compression.r"]
    assert checkpoint.nonfinite(state, limit=1) == ["model.w"]


def test_a_skipped_step_leaves_nothing_of_itself(fmnist, tmp_path):
    """A NaN in one rank's input (step 4) skips the step on every rank; that rank's BatchNorm statistics, which the
    forward pass made NaN, are put back, so the run goes on, evaluates finite and checkpoints."""
    run_dir = tmp_path / "run"
    out = cli([*RUN, f"data.root={fmnist}", "train.max_steps=8", f"run_dir={run_dir}"], tmp_path, nproc=2,
              env={"DGC_FAULTS": "naninput@4:1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 8
    assert math.isfinite(summary["metrics"]["loss"]) and "not finite" not in out.stdout
    state = load(run_dir)
    assert checkpoint.nonfinite(state) == [] and state["ranks"][1]["buffers"]  # rank 1's own statistics, finite


def test_a_non_finite_evaluation_is_flagged(fmnist, tmp_path, capsys):
    """In one process: an evaluation whose loss comes out NaN (here: the task's evaluate made to return it) is
    flagged with one warning, not reported as if it were a number like any other."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import dgc.train  # noqa: F401  (registers the schema)
    from dgc.distributed import init_distributed
    from dgc.repro.trainer import Trainer

    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[*RUN, f"data.root={fmnist}", "train.max_steps=1",
                                                               f"run_dir={tmp_path / 'run'}"]))  # fmt: skip
    trainer = Trainer(cfg, init_distributed("cpu"))
    evaluate = trainer.task.evaluate
    trainer.task.evaluate = lambda model, test: {**evaluate(model, test=test), "loss": float("nan")}
    trainer.fit()
    out = capsys.readouterr().out
    assert "warning: the evaluation at step 1 is not finite (loss); check the evaluation data" in out
