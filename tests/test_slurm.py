"""The Slurm launch scripts, run for real on a Slurm cluster (skipped cleanly where there is none).

Locally: ``launch/slurm/local_cluster.sh start`` (root; a one-node CPU cluster), then
``pytest -m slurm``; ``launch/slurm/local_cluster.sh stop`` afterwards (``stop --purge`` also removes what
``start`` installed and created).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "task=fmnist_resnet20",
    "compression=dgc",
    "train.max_steps=5",
    "data.limit=512",
    "data.eval_limit=256",
    "train.progress=false",
]
USABLE = {"idle", "mixed", "allocated", "completing"}


def _controller() -> tuple[str, int] | None:
    """slurmctld's address and port from slurm.conf (None when the file says nothing plain about them)."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    try:
        text = conf.read_text()
    except OSError:
        return None
    host, port = None, 6817
    for line in text.splitlines():
        key, _, value = line.split("#", 1)[0].strip().partition("=")
        if key.lower() in ("slurmctldhost", "controlmachine") and host is None:
            # SlurmctldHost=name(address)
            host = value.split("(", 1)[1].rstrip(")") if "(" in value else value
        elif key.lower() == "slurmctldport" and value.split("-")[0].isdigit():
            port = int(value.split("-")[0])
    return (host.strip(), port) if host else None


def _no_cluster() -> str | None:
    """Why no job can run here, or None when a Slurm cluster answers and has a usable node."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no Slurm client (sinfo/sbatch) installed"
    ctld = _controller()
    if ctld is not None:  # a stopped controller makes sinfo retry for ~10 s: ask the port first
        try:
            socket.create_connection(ctld, timeout=2).close()
        except OSError as exc:
            return f"slurmctld does not answer at {ctld[0]}:{ctld[1]} ({exc.strerror or exc})"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0:
        return f"sinfo failed: {(out.stderr or out.stdout).strip().splitlines()[:1]}"
    states = {s.rstrip("*~#!%$@^-") for s in out.stdout.split()}
    if not states & USABLE:
        return f"no usable Slurm node (states: {', '.join(sorted(states)) or 'none'})"
    return None


@pytest.fixture(scope="session")
def cluster() -> None:
    """Skip unless a Slurm cluster runs jobs (asked only when a slurm test is selected)."""
    reason = _no_cluster()
    if reason is not None:
        pytest.skip(f"needs a running Slurm cluster (launch/slurm/local_cluster.sh start): {reason}")


@pytest.fixture
def shared_dir(cluster):
    """A directory under the repository (the submit directory is shared with the compute nodes; /tmp may not be)."""
    path = ROOT / "runs" / "test_slurm" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for parent in (path.parent, ROOT / "runs" / "slurm"):  # left empty by these tests
        try:
            parent.rmdir()
        except OSError:
            pass


def _sbatch(script: str, out: Path, args: list[str], *options: str) -> subprocess.CompletedProcess:
    cmd = ["sbatch", "--wait", "--parsable", "--time=15", "--gpus-per-node=0", "-c", "2", "-o", str(out), *options]
    env = dict(os.environ, NPROC="2", PYTHON=sys.executable)
    return subprocess.run(
        [*cmd, f"launch/slurm/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("script, options", [("train_1node.sbatch", ()), ("train_multinode.sbatch", ("--nodes=1",))])
def test_sbatch_script_trains_two_cpu_ranks(shared_dir, script, options):
    run_dir, out = shared_dir / "run", shared_dir / "job.out"
    done = _sbatch(script, out, [*TINY, f"run_dir={run_dir}"], *options)
    log = out.read_text() if out.exists() else ""
    assert done.returncode == 0, f"sbatch exit {done.returncode}: {done.stderr}\n{log}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["task"], summary["compression"], summary["world_size"], summary["steps"]) == (
        "fmnist_resnet20",
        "dgc",
        2,
        5,
    )
    assert "top1" in summary["metrics"]
    assert json.loads((run_dir / "env.json").read_text())["backend"] == "gloo"
    assert "2 ranks (CPU, gloo)" in log


def test_sbatch_picks_one_run_dir_per_job(shared_dir):
    """Without run_dir=..., every rank uses runs/slurm/<job id>."""
    out = shared_dir / "job.out"
    done = _sbatch("train_1node.sbatch", out, TINY)
    job = done.stdout.strip().split(";")[0]
    run_dir = ROOT / "runs" / "slurm" / job
    try:
        assert done.returncode == 0, f"sbatch exit {done.returncode}: {done.stderr}\n{out.read_text()}"
        assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_submitit_launcher_sweep(shared_dir):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install 'dgc[slurm]'")
    cmd = [
        sys.executable, "-m", "dgc.train", "-m", "hydra/launcher=slurm_cpu",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=15",
        f"hydra.launcher.submitit_folder={shared_dir}/submitit/%j", f"hydra.sweep.dir={shared_dir}/hydra",
        *TINY, "compression=none,dgc",
        f"run_dir={shared_dir}/sweep/${{compression.name}}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    for method in ("none", "dgc"):
        summary = json.loads((shared_dir / "sweep" / method / "summary.json").read_text())
        assert (summary["compression"], summary["world_size"], summary["steps"]) == (method, 2, 5)


def test_time_limit_warning_checkpoints_requeues_and_finishes_identically(shared_dir):
    """A job shorter than its run: Slurm's USR1 before the limit stops every rank after a checkpoint (exit 75),
    the script requeues the job, and the requeued job resumes and finishes like an uninterrupted run."""
    from tests.runs import assert_same_training

    run = ["task=fmnist_resnet20", "compression=dgc", "data.limit=2048", "data.eval_limit=256",
           "train.checkpoint_every=50", "train.progress=false", "train.log_every=10", "device=cpu"]  # fmt: skip
    reference = shared_dir / "reference"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "dgc.train", "--nproc", "2", *run, f"run_dir={reference}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir, out = shared_dir / "run", shared_dir / "job.out"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--time=3", "--signal=USR1@60", "--gpus-per-node=0", "-c", "2", "-o", str(out),
         "launch/slurm/train_1node.sbatch", *run, f"run_dir={run_dir}"],
        cwd=ROOT, env=dict(os.environ, NPROC="2", PYTHON=sys.executable), capture_output=True, text=True,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline, state = time.monotonic() + 1200, ""
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = next((w.split("=")[1] for w in show.split() if w.startswith("JobState=")), "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(5)
    log = out.read_text()
    assert state == "COMPLETED", f"job {job}: {state}\n{log[-3000:]}"
    assert "interrupted: stopped at step" in log and "on SIGUSR1" in log and "requeueing job" in log
    assert "(restart 1)" in log and "resuming" in log
    assert_same_training(reference, run_dir)
