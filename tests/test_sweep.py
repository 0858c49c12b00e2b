"""The table definitions (dgc.repro.tables) and the sweep driver (python -m dgc.repro.sweep), without training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dgc.conf import options
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the config schema)
from dgc.repro import sweep
from dgc.repro.tables import METRICS, TABLES, get_table
from tests.test_report import fake_run

ROWS = [(t.name, r) for t in TABLES.values() for r in t.rows]


@pytest.mark.parametrize("table", list(TABLES.values()), ids=list(TABLES))
def test_tables_are_well_formed(table):
    keys = [r.key for r in table.rows]
    assert len(keys) == len(set(keys)), "row keys must be unique (they name run directories)"
    assert all(m in METRICS for m in table.metrics)
    for group, seed in {(r.group, r.seed) for r in table.rows}:
        baselines = sum(r.baseline for r in table.rows if (r.group, r.seed) == (group, seed))
        assert baselines == 1, f"{group} (seed {seed}) needs one baseline"
    for row in table.rows:
        assert row.task in options("task") and row.compression in options("compression")
        assert set(row.paper.metrics) <= set(table.metrics)


def test_every_row_composes():
    with initialize_config_module("dgc.conf", version_base="1.3"):
        for name, row in ROWS:
            cfg = compose("config", overrides=sweep.train_overrides(row, [], Path("runs/x")))
            # a compression preset is a compressor's name, or one with a suffix (dgc_compact is dgc), or a local-steps
            # method's (diloco: local steps around the dense compressors)
            compressor = "none" if row.compression.startswith("diloco") and cfg.local_steps.every else None
            want = compressor or row.compression.split("_")[0]
            assert cfg.task.name == row.task and cfg.compression.name in (want, "bf16"), (name, row.key)


def test_compact_rows_differ_from_the_default_only_in_the_format():
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = {r.key: OmegaConf.to_object(compose("config", overrides=r.train_overrides()))
               for r in get_table("cpu-compact").rows}  # fmt: skip
    assert len(cfg) == 12
    for seed in range(4):
        default, onebit, every = (cfg[f"{k}-s{seed}"] for k in ("default", "compact-1bit", "compact-all"))
        policies = [vars(c.sync.policy) for c in (default, onebit, every)]
        assert policies == [
            {"min_ndim": 2, "min_numel": 1, "dense_values": "fp16"},
            {"min_ndim": 2, "min_numel": 1, "dense_values": "1bit"},
            {"min_ndim": 1, "min_numel": 1, "dense_values": "fp16"},
        ]
        assert default.compression.wire_indices == "delta16"  # the compressor's default
        for run in (default, onebit, every):
            assert run.seed == seed and run.compression.name == "dgc" and run.compression.wire_values == "fp16"
            assert run.train.epochs == 4 and run.compression.warmup_epochs == 1 and run.compression.density == 0.001
            assert run.compression.wire_indices == ("delta16" if run is default else "rice")


def test_ablation_rows_switch_one_technique_off():
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = {r.key: compose("config", overrides=r.train_overrides()) for r in get_table("cpu-ablation").rows}
    assert cfg["dgc"].sync.clip_norm == 1.25 and cfg["dgc"].compression.momentum_correction
    assert cfg["dgc-no-clip"].sync.clip_norm is None
    assert not cfg["dgc-no-mc"].compression.momentum_correction and cfg["dgc-no-mc"].sync.clip_norm == 1.25
    assert not cfg["dgc-no-mask"].compression.momentum_masking
    assert cfg["dgc-no-warmup"].compression.warmup_epochs == 0 and cfg["dgc"].compression.warmup_epochs == 0.5


def test_overrides_each_key_once_last_wins():
    row = get_table("cpu-ablation").rows[1]
    args = sweep.parse_args(["cpu-ablation", "--data-root", "fmnist=/d/f", "--data-root", "fm=/x", "sync.clip_norm=9"])
    out = sweep.train_overrides(row, sweep.extra_overrides(row, args), Path("r/d"))
    assert out.count("sync.clip_norm=9") == 1 and not any(o == "sync.clip_norm=1.25" for o in out)
    assert "data.root=/d/f" in out and "data.root=/x" not in out
    assert out[-1] == "run_dir=r/d"


def test_slurm_command_splits_ranks_over_nodes():
    table = get_table("table2-cifar")
    rows = {r.key: r for r in table.rows}
    args = sweep.parse_args(["table2-cifar", "--launcher", "slurm", "--sbatch=--partition=gpu"])
    cmd, env = sweep.slurm_command(table, rows["dgc-32"], 32, [], Path("runs/t/dgc-32"), args)
    assert "--nodes=8" in cmd and "--gpus-per-node=4" in cmd and "--partition=gpu" in cmd and env == {"NPROC": "4"}
    assert "launch/slurm/train_multinode.sbatch" in cmd and cmd[-1] == "run_dir=runs/t/dgc-32"
    cmd, env = sweep.slurm_command(table, rows["none-4"], 4, [], Path("r"), args)
    assert "launch/slurm/train_1node.sbatch" in cmd and "--nodes=1" in cmd and env == {"NPROC": "4"}
    cpu = sweep.parse_args(["table2-cifar", "--launcher", "slurm", "--cpu", "--gpus-per-node", "2"])
    cmd, env = sweep.slurm_command(table, rows["none-4"], 4, [], Path("r"), cpu)
    assert "--gpus-per-node=0" in cmd and "--nodes=2" in cmd and env == {"NPROC": "2"}


def test_bad_arguments_name_the_valid_values(capsys):
    for argv, message in (
        (["table7"], "valid: table2-cifar"),
        (["cpu-kjv", "--only", "dgc-s0,nope"], "unknown row nope of cpu-kjv; valid: none-s0, dgc-s0, none-s1, dgc-s1"),
        (["cpu-kjv", "notanoverride"], "not a dgc.train override"),
        (["cpu-kjv", "--data-root", "x"], "PREFIX=PATH"),
    ):
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        assert message in capsys.readouterr().err


def test_local_sweep_removes_stale_runs_then_reports(tmp_path, monkeypatch):
    """Each run is one `python -m dgc.train --nproc N` (faked here: it writes the run directory), then the report."""
    runs, out = tmp_path / "runs", tmp_path / "results"
    stale = runs / "cpu-fmnist" / "dgc-s0"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text("old\n")
    commands = []
    real_run = subprocess.run

    def fake_torchrun(cmd, env=None, **kw):
        if "dgc.train" not in cmd:  # e.g. matplotlib's first import asks fc-list for the fonts
            return real_run(cmd, env=env, **kw)
        commands.append(cmd)
        assert env["OMP_NUM_THREADS"]
        args = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))
        assert not Path(args["run_dir"]).exists(), "a stale run directory must be removed first"
        fake_run(Path(args["run_dir"]), args["task"], args["compression"], {"top1": 80.0}, world_size=2)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_torchrun)
    sweep.main(["cpu-fmnist", "--world-size", "2", "--runs-root", str(runs), "--out", str(out), "train.max_steps=3"])
    assert len(commands) == len(get_table("cpu-fmnist").rows) == 12
    assert all(c[1:5] == ["-m", "dgc.train", "--nproc", "2"] and "train.max_steps=3" in c for c in commands)
    assert not (stale / "metrics.jsonl").read_text().startswith("old")
    assert (out / "cpu-fmnist.md").is_file() and (out / "cpu-fmnist-steps.png").is_file()

    # --skip-done keeps the finished runs
    commands.clear()
    sweep.main(["cpu-fmnist", "--skip-done", "--no-report", "--runs-root", str(runs)])
    assert commands == []


def test_skip_done_resumes_an_unfinished_run_from_its_checkpoint(tmp_path, monkeypatch):
    """--skip-done: a finished run is kept, an unfinished one with a checkpoint continues (resume=auto, nothing
    removed), one without a checkpoint starts over."""
    runs = tmp_path / "runs"
    done, stopped, empty = (runs / "cpu-kjv" / k for k in ("none-s0", "dgc-s0", "none-s1"))
    fake_run(done, "kjv_lstm", "none", {"ppl": 60.0}, kind="language", world_size=2)
    stopped.mkdir(parents=True)
    (stopped / "checkpoint.pt").write_bytes(b"ckpt")
    empty.mkdir(parents=True)
    (empty / "metrics.jsonl").write_text("torn\n")
    commands = {}

    def fake_torchrun(cmd, env=None, **kw):
        args = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))
        commands[Path(args["run_dir"]).name] = args
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_torchrun)
    sweep.main(["cpu-kjv", "--skip-done", "--no-report", "--runs-root", str(runs)])
    assert sorted(commands) == ["dgc-s0", "dgc-s1", "none-s1"]
    assert commands["dgc-s0"].get("resume") == "auto" and (stopped / "checkpoint.pt").read_bytes() == b"ckpt"
    assert "resume" not in commands["none-s1"] and not empty.exists()
    assert "resume" not in commands["dgc-s1"]


def test_local_sweep_stops_at_a_failed_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 3))
    with pytest.raises(SystemExit, match="run cpu-kjv/none-s0 failed"):
        sweep.main(["cpu-kjv", "--runs-root", str(tmp_path)])
    assert not (tmp_path / "results").exists()


def test_slurm_sweep_submits_runs_then_a_dependent_report(tmp_path, monkeypatch):
    submitted = []

    def fake_sbatch(cmd, **kw):
        submitted.append((cmd, kw.get("env", {}).get("NPROC")))
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{100 + len(submitted)}\n", stderr="")

    monkeypatch.setattr(sweep.subprocess, "run", fake_sbatch)
    monkeypatch.setattr(sweep.shutil, "which", lambda name: f"/usr/bin/{name}")  # a login node
    monkeypatch.chdir(tmp_path)  # the submit directory
    sweep.main(["table4-ptb", "--launcher", "slurm", "--runs-root", "r", "--data-root", "ptb=/data/ptb",
                "--sbatch=--partition=gpu"])  # fmt: skip
    (run1, n1), (run2, _), (rep, _) = submitted
    assert n1 == "4" and "data.root=/data/ptb" in run1 and "compression=dgc" in run2
    # after every run has ended, whatever its outcome (the report marks the rows that did not finish), with the runs'
    # sbatch options
    assert "--dependency=afterany:101:102" in rep and "--partition=gpu" in rep and "--partition=gpu" in run1
    assert any(a.startswith("--wrap=") and a.endswith("--partial") for a in rep)
    assert any(a.startswith("--wrap=") and "dgc.repro.report --table table4-ptb" in a for a in rep)
    # every job's log under runs/slurm/ (made before submitting: Slurm does not make it), named by the job
    for cmd in (run1, run2, rep):
        assert "--output=runs/slurm/%x-%j.out" in cmd
    assert (tmp_path / "runs" / "slurm").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["r", "runs"]


def test_a_slurm_sweep_without_sbatch_is_one_line_and_leaves_nothing(tmp_path):
    """`make table2-cifar` off a cluster was a 20-line FileNotFoundError after making the runs folder."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no sbatch on it
    cmd = [sys.executable, "-m", "dgc.repro.sweep", "table2-cifar", "--launcher", "slurm", "--runs-root", "runs"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --launcher slurm submits with sbatch, which is not on PATH")
    assert "make table2-cifar LAUNCHER=local" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_dry_run_shows_the_report_job_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sweep.main(["table4-ptb", "--launcher", "slurm", "--runs-root", "r", "--dry-run"])
    err = capsys.readouterr().err
    report_line = err.strip().splitlines()[-1]
    assert report_line.startswith("[sweep] report job: sbatch --parsable --job-name=dgc-report-table4-ptb")
    assert "--dependency=afterany:" in report_line and not (tmp_path / "r").exists()
