"""Where a Slurm job's log goes: runs/slurm/<job name>-<job id>.out, never the repository root. No Slurm here:
the sbatch script runs as a batch job would (its environment, its log file as stdout, from the submit
directory) with a stand-in srun."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A fresh clone as far as the scripts see it: launch/slurm/ and nothing under runs/; srun only prints."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "launch" / "slurm", repo / "launch" / "slurm")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\necho "ranks ran: $*"\nexit "${FAKE_STATUS:-0}"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return repo


def _job(repo: Path, log: Path, script: str = "train_1node.sbatch", job: str = "4242", restart: int = 0) -> str:
    """Run ``script`` as Slurm runs a batch job whose log is ``log`` (opened to append, as --open-mode=append)."""
    env = dict(os.environ, PATH=f"{repo.parent / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=job,
               SLURM_JOB_NAME="dgc", SLURM_SUBMIT_DIR=str(repo), SLURM_RESTART_COUNT=str(restart), NPROC="2",
               PYTHON="python3")  # fmt: skip
    with open(log, "a") as out:
        done = subprocess.run(["bash", str(repo / "launch" / "slurm" / script), "task=fmnist_resnet20"],
                              cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=60)  # fmt: skip
    assert done.returncode == 0
    return job


@pytest.mark.parametrize("script", ["train_1node.sbatch", "train_multinode.sbatch"])
def test_the_job_log_moves_from_the_root_into_runs_slurm(checkout, script):
    default = checkout / "slurm-dgc-4242.out"  # where Slurm opens it: #SBATCH --output=slurm-%x-%j.out
    assert (
        f"#SBATCH --output={default.name.replace('dgc', '%x').replace('4242', '%j')}"
        in (checkout / "launch" / "slurm" / script).read_text()
    )
    _job(checkout, default, script)
    log = checkout / "runs" / "slurm" / "dgc-4242.out"
    assert not default.exists() and log.is_file()  # the folder was made: a fresh clone has no runs/
    text = log.read_text()
    assert "[dgc] job 4242 (restart 0)" in text and "log runs/slurm/dgc-4242.out" in text
    assert "ranks ran: --nodes=1" in text and "run_dir=runs/slurm/4242" in text
    assert sorted(p.name for p in checkout.iterdir()) == ["launch", "runs"]


def test_a_requeued_job_appends_to_the_same_log(checkout):
    default = checkout / "slurm-dgc-4242.out"
    _job(checkout, default)
    _job(checkout, default, restart=1)  # the requeued job: Slurm opens the default path again
    log = checkout / "runs" / "slurm" / "dgc-4242.out"
    text = log.read_text()
    assert not default.exists()
    assert text.index("(restart 0)") < text.index("(restart 1)") and text.count("ranks ran:") == 2


def test_a_log_placed_with_output_stays_there(checkout):
    placed = checkout / "job.out"
    _job(checkout, placed)
    assert "[dgc] job 4242" in placed.read_text() and not (checkout / "runs" / "slurm" / "dgc-4242.out").exists()
