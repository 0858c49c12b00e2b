"""Unattended runs survive what clusters do to them: each fault injected into real gloo processes.

Two ranks run ``python -m dgc.train --nproc 2`` (the elastic launcher) on a tiny Fashion-MNIST; faults
come from ``DGC_FAULTS`` (:mod:`dgc.repro.faults`). A run that is stopped, killed or fed a corrupt or torn
file and then started again with the same command finishes exactly like the uninterrupted reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from dgc.tasks.tiny_data import write_fmnist

from dgc.repro import checkpoint
from dgc.repro.config import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_STALLED, EXIT_USER
from tests import privatefs
from tests.runs import TINY, assert_same_training, cli, load, records

#: 96 images / (2 ranks x 4) = 12 steps per epoch; 16 steps cross an epoch end; a checkpoint every 3 steps
RUN = [*TINY, "compression=dgc", "compression.density=0.05", "task.compression_warmup_epochs=0.25"]
RUN += ["data.limit=96", "data.eval_limit=16", "train.max_steps=16", "train.checkpoint_every=3"]
RUN += ["train.log_every=1", "resume=auto"]


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return write_fmnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=96, n_test=16)


def args(fmnist: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*RUN, f"data.root={fmnist}", f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(fmnist, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    out = cli(args(fmnist, run_dir), run_dir.parent, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    return lines[0]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}


def leftover_processes(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"run_dir={run_dir}"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


# -- stop on a signal, at the same step on every rank --------------------------------------------


@pytest.mark.parametrize("fault", ["usr1@5:1", "term@7"], ids=["sigusr1-one-rank", "sigterm-every-rank"])
def test_signal_stops_every_rank_at_one_step_then_resumes_exactly(fault, fmnist, reference, tmp_path):
    run_dir = tmp_path / "run"
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2, env={"DGC_FAULTS": fault})
    assert out.returncode == EXIT_INTERRUPTED, out.stderr[-3000:]
    # the signal arrives after step K; every rank sees it in step K+1's exchange, and stops there
    stopped = int(fault.split("@")[1].split(":")[0]) + 1
    assert one_line(out).startswith(f"interrupted: stopped at step {stopped} ")
    assert load(run_dir)["counters"]["step"] == stopped
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, stopped + 1))
    assert not leftover_processes(run_dir)

    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)  # the same command
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming {run_dir} at step {stopped}" in out.stdout
    assert_same_training(reference, run_dir)


# -- a rank dies; the latest checkpoint is corrupt; the log ends in a torn line ----------------------


@pytest.mark.parametrize("rank", [1, 0])
def test_killed_rank_corrupt_checkpoint_and_torn_log_resume_exactly(rank, fmnist, reference, tmp_path):
    """Either rank SIGKILLed (rank 0 too, which holds the lock and would print the job's line): the launcher
    names it, and the run resumes exactly."""
    run_dir = tmp_path / "run"
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2, env={"DGC_FAULTS": f"kill@10:{rank}"})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert any(
        re.fullmatch(
            rf"error: rank {rank} \(pid \d+\) was killed by signal 9 \(SIGKILL\); to continue from the last "
            r"checkpoint, run the same command with resume=auto",
            line,
        )
        for line in lines
    )
    # rank 0, when it survives, says what it saw (once: not rank 1, whose loss of rank 0 the launcher names)
    assert len([line for line in lines if "another rank stopped" in line]) == (1 if rank == 1 else 0), out.stderr
    assert not leftover_processes(run_dir)
    assert load(run_dir)["counters"]["step"] == 9 and load(run_dir, "checkpoint.prev.pt")["counters"]["step"] == 6
    # the disk then loses the end of the latest checkpoint, and the log's last line is cut short
    latest = run_dir / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 11, "lo')

    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint.pt is unreadable" in out.stdout and "resuming from checkpoint.prev.pt" in out.stdout
    assert "dropped a torn last line" in out.stdout
    assert f"resuming {run_dir} at step 6" in out.stdout
    assert_same_training(reference, run_dir)


def test_unreadable_checkpoints_refuse_with_one_line_and_change_nothing(fmnist, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "checkpoint.pt").write_bytes(b"garbage")
    (run_dir / "checkpoint.prev.pt").write_bytes(b"")
    before = snapshot(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == EXIT_USER
    line = one_line(out)
    assert line.startswith("error: cannot resume: ") and "checkpoint.pt is unreadable" in line
    assert snapshot(run_dir) == before


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_log_that_is_not_utf8_is_one_line_naming_it(fmnist, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "checkpoint.pt").unlink()  # resume from the previous checkpoint: the log past it is cut
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind": "train", "step": 17, "note": "\xff\xfe"}\n')
    before = snapshot(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == EXIT_USER
    line = one_line(out)
    assert line.startswith(f"error: {run_dir / 'metrics.jsonl'} is not UTF-8 text (a bad byte at offset ")
    assert line.endswith("; repair or remove it, then resume")
    assert snapshot(run_dir) == before  # nothing rewritten


def test_a_checkpoint_carrying_a_callable_is_refused_without_running_it(fmnist, reference, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(reference, run_dir)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        state = load(run_dir, name)
        state["counters"] = {"step": _Payload(marker)}
        torch.save(state, run_dir / name)
    before = snapshot(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == EXIT_USER
    line = one_line(out)
    assert "holds objects other than tensors and plain containers" in line and "refused" in line
    assert not marker.exists()
    assert snapshot(run_dir) == before


# -- non-finite gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("pack", ["none", "all"], ids=["agreement-first", "agreement-in-the-message"])
def test_nan_and_inf_on_one_rank_skip_the_step_everywhere(fmnist, tmp_path, pack):
    run_dir = tmp_path / "run"
    out = cli(args(fmnist, run_dir, f"sync.pack={pack}"), tmp_path, nproc=2, env={"DGC_FAULTS": "nan@4:1,inf@9:0"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["steps"] == 16
    assert [r["step"] for r in records(run_dir, "train") if r["skipped"]] == [4, 9]
    state = load(run_dir)
    for rank in state["ranks"]:  # nothing non-finite entered the momenta or residuals
        for tensors in rank["compression"]["compressor"]["tensors"].values():
            assert all(bool(t.isfinite().all()) for t in tensors.values())
    assert all(bool(t.isfinite().all()) for t in state["model"].values() if t.is_floating_point())
    assert summary["wire_ratio"] is not None and 0 < summary["wire_ratio"] < float("inf")


def test_too_many_bad_steps_in_a_row_end_the_run(fmnist, tmp_path):
    run_dir = tmp_path / "run"
    faults = "nan@4:0,nan@5:1,nan@6:0"
    out = cli(args(fmnist, run_dir, "train.max_bad_steps=3"), tmp_path, nproc=2, env={"DGC_FAULTS": faults})
    assert out.returncode == EXIT_DIVERGED
    line = one_line(out)
    assert line.startswith("error: 3 steps in a row (to step 6) had non-finite gradients") and "optim.lr" in line
    assert not (run_dir / "summary.json").exists()


# -- one run per directory; refused resumes; stalls ------------------------------------------------


def test_a_second_start_on_the_same_run_dir_is_refused(fmnist, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dgc.train", *args(fmnist, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DGC_FAULTS": "stall@4"}  # it stops itself, holding the run dir
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while Path(f"/proc/{first.pid}/stat").read_text().split(")")[1].split()[0] != "T":
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        second = cli(args(fmnist, run_dir), tmp_path)
        assert second.returncode == EXIT_USER
        line = one_line(second)
        assert line.startswith(f"error: {run_dir} is in use by pid {first.pid}") and "another run_dir" in line
    finally:
        first.kill()
        first.communicate()
    # the first run died holding the lock: the next start takes the stale lock over and resumes
    third = cli(args(fmnist, run_dir), tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the stale lock of pid {first.pid}" in third.stdout
    assert f"resuming {run_dir} at step 3" in third.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 16
    assert not (run_dir / ".lock").exists()


def test_resume_with_other_settings_is_refused_before_anything_changes(fmnist, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = snapshot(run_dir)
    out = cli(args(fmnist, run_dir, "optim.lr=0.5", "compression=topk"), tmp_path, nproc=2)
    assert out.returncode == EXIT_USER
    line = one_line(out)
    assert line.startswith(f"error: cannot resume {run_dir} with other settings: ")
    assert "optim.lr: 0.025 -> 0.5" in line and "compression.name: 'dgc' -> 'topk'" in line
    assert "resume_allow=[" in line
    out = cli(args(fmnist, run_dir), tmp_path)  # one worker instead of two
    assert out.returncode == EXIT_USER and "written by 2 workers" in one_line(out)
    assert snapshot(run_dir) == before
    # a setting named in resume_allow is accepted (the run is finished: nothing more to train)
    out = cli(args(fmnist, run_dir, "optim.lr=0.5", "resume_allow=[optim.lr]"), tmp_path, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_stalled_rank_ends_the_job_after_the_timeout(fmnist, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    out = cli(args(fmnist, run_dir, "timeout_s=10"), tmp_path, nproc=2, env={"DGC_FAULTS": "stall@5:1"}, timeout=240)
    assert out.returncode == EXIT_STALLED, out.stderr[-3000:]
    assert "timeout_s=10" in one_line(out) and "a rank stalled or died" in out.stderr
    assert time.monotonic() - started < 180
    assert not leftover_processes(run_dir)


# -- mistakes: one line, once, the same status with and without the launcher -------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("+foo=1", "the configuration has no key 'foo' to add"),
        ("+train.max_stpes=10", "no key 'train.max_stpes' to add (valid keys: epochs, batch_size"),
        ("run_dir=/etc/passwd", "run_dir /etc/passwd exists and is not a directory"),
        ("resume=maybe", "resume must be true, false or auto"),
        (
            "optim.lr=(",
            "cannot read the override 'optim.lr=(' (extraneous input '('); Hydra reads such a value in "
            "quotes, inside the shell's: \"optim.lr='('\"",
        ),
        ("run_dir=/tmp/ü€漢字", "cannot read the override 'run_dir=/tmp/ü€漢字'; Hydra reads such a value in quotes"),
        ("data.root=/data/é", "\"data.root='/data/é'\""),
    ],
)
def test_mistakes_are_one_line_once(override, message, fmnist, tmp_path):
    for nproc in (0, 2):
        out = cli([*RUN, f"data.root={fmnist}", override], tmp_path / str(nproc), nproc=nproc)
        assert out.returncode == EXIT_USER, (nproc, out.stderr[-2000:])
        line = one_line(out)
        assert line.startswith("error: ") and message in line, line


def _foreign_lock(run_dir: Path, **owner) -> str:
    (run_dir / ".lock").write_text(json.dumps({"started": "2026-12-01 10:00:00", **owner}))
    return f"took over the stale lock of pid {owner['pid']} on {owner['host']}"


def _half_checkpoint(run_dir: Path) -> str:
    data = (run_dir / "checkpoint.pt").read_bytes()
    (run_dir / ".checkpoint.pt.k1ll3d.tmp").write_bytes(data[: len(data) // 2])
    return "removed 1 unfinished temporary file(s) of an earlier stop (.checkpoint.pt.k1ll3d.tmp"


def _no_log(run_dir: Path) -> str:
    (run_dir / "metrics.jsonl").unlink()
    return "metrics.jsonl is missing or empty: the log of steps 1-"


LEFTOVERS = {
    # rank 0 SIGKILLed long ago; its PID now names another live process (PID 1: a container's init)
    "lock-of-a-live-pid": lambda d: _foreign_lock(d, pid=1, host=socket.gethostname()),
    # a job requeued onto another node finds the lock of the node it lost
    "lock-of-another-host": lambda d: _foreign_lock(d, pid=4242, host="node-17"),
    "half-written-checkpoint": _half_checkpoint,
    "deleted-log": _no_log,
}


def test_what_a_dead_run_leaves_resumes_without_a_person_with_one_warning(fmnist, tmp_path):
    """One run stopped again and again; before each launch it finds one thing a dead run leaves behind. Each
    launch resumes under resume=auto with one warning line, and the run ends as the one left alone."""
    alone = tmp_path / "alone"
    assert cli(args(fmnist, alone), tmp_path).returncode == 0
    run_dir = tmp_path / "run"
    out = cli(args(fmnist, run_dir), tmp_path, env={"DGC_FAULTS": "term@2"})
    assert out.returncode == EXIT_INTERRUPTED, out.stderr[-2000:]
    for i, make in enumerate(LEFTOVERS.values()):
        expected = make(run_dir)
        last = i == len(LEFTOVERS) - 1
        out = cli(args(fmnist, run_dir), tmp_path, env={} if last else {"DGC_FAULTS": f"term@{3 * i + 5}"})
        assert out.returncode == (0 if last else EXIT_INTERRUPTED), out.stderr[-3000:]
        warnings = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and expected in warnings[0], warnings
        assert not checkpoint.leftovers(run_dir)
    assert not (run_dir / ".lock").exists()
    assert load(alone)["model"].keys() == load(run_dir)["model"].keys()
    assert all(torch.equal(a, b) for a, b in zip(load(alone)["model"].values(), load(run_dir)["model"].values()))


def test_a_damaged_data_file_is_one_line_once_naming_it(tmp_path):
    data = write_fmnist(tmp_path / "fmnist", n_train=96, n_test=16)
    damaged = data / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:200])  # a download cut short
    for nproc in (0, 2):
        out = cli([*RUN, f"data.root={data}", f"run_dir={tmp_path / str(nproc)}"], tmp_path, nproc=nproc)
        assert out.returncode == EXIT_USER, out.stderr[-2000:]
        assert one_line(out).startswith(f"error: {damaged} is damaged (Compressed file ended before the end-of-stream")


#: makes rank 0 of a --nproc job slow to reach its data (after the process group exists): rank 1 meets the
#: damaged file alone and fails, and the agent stops rank 0 before it can say anything
SLOW_RANK_0 = """import os, sys, time
if os.environ.get("RANK") == "0" and os.environ.get("DGC_LAUNCHER_PID"):
    class SlowData:
        def find_spec(self, name, path=None, target=None):
            if name == "dgc.tasks.image_data":
                time.sleep(120)
    sys.meta_path.insert(0, SlowData())
"""


def test_a_line_of_another_rank_is_printed_once_when_rank_0_was_stopped_before_saying_it(tmp_path):
    data = write_fmnist(tmp_path / "fmnist", n_train=96, n_test=16)
    damaged = data / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:200])
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK_0)
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{site}{os.pathsep}{root}"}
    start = time.monotonic()
    out = cli([*RUN, f"data.root={data}", f"run_dir={tmp_path / 'run'}"], tmp_path, nproc=2, env=env)
    assert out.returncode == EXIT_USER, out.stderr[-2000:]
    assert one_line(out).startswith(f"error: {damaged} is damaged (Compressed file ended before the end-of-stream")
    assert time.monotonic() - start < 100  # rank 0 was stopped, not waited for


def test_dgc_data_moves_fashion_mnist(tmp_path):
    write_fmnist(tmp_path / "data" / "fashion-mnist", n_train=96, n_test=16)
    out = cli(
        [*RUN, f"run_dir={tmp_path / 'run'}", "train.max_steps=1"], tmp_path, env={"DGC_DATA": str(tmp_path / "data")}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["data"]["root"] == str(tmp_path / "data" / "fashion-mnist")


def test_an_unreadable_override_in_a_sweep_is_one_line_and_the_quoted_form_runs(fmnist, tmp_path):
    out = cli(["-m", *RUN, f"data.root={fmnist}", "compression=none,dgc", "optim.lr=("], tmp_path)
    assert out.returncode == EXIT_USER and one_line(out).startswith("error: cannot read the override 'optim.lr=('")
    run_dir = tmp_path / "ü€漢字 run"
    out = cli([*RUN, f"data.root={fmnist}", f"run_dir='{run_dir}'", "train.max_steps=2"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (run_dir / "summary.json").is_file()


@pytest.mark.skipif(privatefs.available() is not None, reason=str(privatefs.available()))
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(fmnist, tmp_path):
    # a 24 MB tmpfs in a mount namespace of its own: gone with this test even if it is killed
    disk = tmp_path / "disk"
    with privatefs.PrivateTmpfs(disk, "24m") as fs:
        run_dir = disk / "run"
        # a checkpoint here is about 5.5 MB (the model, both ranks' DGC momenta and residuals): room for one
        fs.outside(disk / "filler").write_bytes(b"\0" * (14 * 2**20))
        out = cli(args(fmnist, run_dir, "train.max_steps=30"), tmp_path, nproc=2, inside=fs.command)
        assert out.returncode == EXIT_USER
        line = one_line(out)
        assert line.startswith(f"error: no space left on the device of {run_dir}") and "resume=auto" in line
        step = load(fs.outside(run_dir))["counters"]["step"]
        fs.outside(disk / "filler").unlink()
        out = cli(args(fmnist, run_dir, "train.max_steps=30"), tmp_path, nproc=2, inside=fs.command)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"at step {step}" in out.stdout
    assert not privatefs.mounted_anywhere(disk) and not any(disk.iterdir())


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until its file system is full."""
    with open(path, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 2**16)
                f.flush()


def test_a_full_disk_at_the_start_or_at_a_resume_is_one_line_and_changes_nothing(fmnist, tmp_path):
    disk = tmp_path / "disk"
    with privatefs.PrivateTmpfs(disk, "24m") as fs:
        # (the resumed run in one process, the fresh one on 2 ranks: rank 0's refusal reaches rank 1)
        fresh, stopped = disk / "fresh", disk / "stopped"
        out = cli(args(fmnist, stopped), tmp_path, inside=fs.command, env={"DGC_FAULTS": "term@5"})
        assert out.returncode == EXIT_INTERRUPTED, out.stderr[-2000:]
        before = snapshot(fs.outside(stopped))
        _fill(fs.outside(disk / "filler"))
        for run_dir, nproc in ((fresh, 2), (stopped, 0)):
            out = cli(args(fmnist, run_dir), tmp_path, nproc=nproc, inside=fs.command)
            assert out.returncode == EXIT_USER, out.stderr[-2000:]
            assert one_line(out).startswith(f"error: no space left on the device of {run_dir} at the start")
        assert not fs.outside(fresh).exists()
        assert snapshot(fs.outside(stopped)) == before  # no lock, no temporary file, the checkpoint as it was
        fs.outside(disk / "filler").unlink()
        out = cli(args(fmnist, stopped), tmp_path, inside=fs.command)
        assert out.returncode == 0, out.stderr[-2000:]
    assert not privatefs.mounted_anywhere(disk)


@pytest.mark.skipif(privatefs.available() is not None, reason=str(privatefs.available()))
def test_the_full_disk_test_killed_leaves_no_mount(tmp_path):
    """SIGKILL the test above while its tmpfs is mounted: no tmpfs of it anywhere afterwards."""
    base = tmp_path / "killed"
    test = f"{Path(__file__).resolve()}::test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}", test]
    child = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not privatefs.mounted_anywhere(base):
            assert child.poll() is None and time.monotonic() < deadline, "the test never mounted its tmpfs"
            time.sleep(0.1)
        time.sleep(1)  # let its training start inside the namespace
        assert not privatefs.here(base)  # never in this (the root) namespace
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 60  # the holder and the run inside die with the killed test
        while privatefs.mounted_anywhere(base):
            assert time.monotonic() < deadline, f"still mounted for {privatefs.mounted_anywhere(base)}"
            time.sleep(0.2)
    finally:
        child.kill()
    assert not privatefs.here(base)
    shutil.rmtree(base)  # nothing mounted under it: it can be removed


def test_the_launcher_checks_the_config_before_starting_workers(tmp_path):
    out = cli([*RUN, "compression.density=0"], tmp_path, nproc=2, env={"DGC_DEBUG": ""})
    assert out.returncode == EXIT_USER
    assert one_line(out) == "error: density must be a number in (0, 1], got 0.0"


def _start_launcher(fmnist: Path, run_dir: Path, cwd: Path) -> subprocess.Popen:
    """``python -m dgc.train --nproc 2`` started and trained for 4 steps."""
    cmd = [sys.executable, "-m", "dgc.train", "--nproc", "2", *args(fmnist, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(records(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else []) < 4:
        if time.monotonic() > deadline or job.poll() is not None:
            job.kill()
            raise AssertionError(f"the job did not train: {job.communicate()[1][-3000:]}")
        time.sleep(0.1)
    return job


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by a container's init, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_the_job_resumably(signum, fmnist, reference, tmp_path):
    """SIGTERM (a scheduler) and SIGUSR1 (Slurm's warning before the time limit) to the launcher alone reach
    every worker: one line, exit 75, a checkpoint, and the same command continues exactly."""
    run_dir = tmp_path / "run"
    job = _start_launcher(fmnist, run_dir, tmp_path)
    try:
        job.send_signal(signum)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err and err.count("interrupted: stopped at step") == 1
    assert f"on {signum.name}" in err
    assert not leftover_processes(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_training(reference, run_dir)


def test_ctrl_c_stops_after_a_checkpoint(fmnist, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dgc.train", *args(fmnist, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(records(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else []) < 4:
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == EXIT_INTERRUPTED and "Traceback" not in err, err[-3000:]
    line = one_line(subprocess.CompletedProcess([], 0, "", err))
    assert line.startswith("interrupted: stopped at step") and "on SIGINT" in line
    assert line.endswith(f"checkpoint saved in {run_dir}: to continue, run the same command with resume=auto")
    assert load(run_dir)["counters"]["step"] >= 4


# -- restarts and requeues find the run they continue ------------------------------------------------


def without_resume(fmnist: Path, run_dir: Path | None, *extra: str) -> list[str]:
    """The run's arguments as a user first writes them: no resume=..., and no run_dir=... when ``run_dir`` is None."""
    return [a for a in args(fmnist, run_dir or Path("-"), *extra) if a != "resume=auto" and a != "run_dir=-"]


def the_run_dir(cwd: Path) -> Path:
    (found,) = (cwd / "runs").glob("*/*/*")
    return found


@pytest.mark.parametrize("given", [True, False], ids=["run_dir-given", "run_dir-default"])
def test_a_restarted_job_resumes_the_run_it_started(given, fmnist, reference, tmp_path):
    """``--nproc 2 --max-restarts=1``, rank 1 SIGKILLed after step 9's checkpoint: the restarted workers (the
    launcher knows it is a restart) resume at step 9, with or without run_dir=, and end as the run left alone."""
    run_dir = tmp_path / "run" if given else None
    out = cli([*without_resume(fmnist, run_dir), "--max-restarts=1"], tmp_path, nproc=2, env={"DGC_FAULTS": "kill@9:1"})
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = run_dir or the_run_dir(tmp_path)
    assert f"resuming {run_dir if given else run_dir.relative_to(tmp_path)} at step 9" in out.stdout
    assert json.loads((run_dir / "env.json").read_text())["restarts"] == 1
    assert_same_training(reference, run_dir)


def test_a_restart_does_not_resume_a_run_another_job_left(fmnist, reference, tmp_path):
    """A restart resumes only the run its own job started: a run_dir holding another job's run stays refused."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = snapshot(run_dir)
    out = cli([*without_resume(fmnist, run_dir), "--max-restarts=1"], tmp_path, nproc=2)
    assert out.returncode == EXIT_USER
    assert out.stderr.count(f"error: {run_dir} already holds a run: pass resume=true") == 2  # both attempts
    assert snapshot(run_dir) == before


def test_a_killed_rank_names_the_default_run_dir_and_that_command_continues(fmnist, reference, tmp_path):
    out = cli(without_resume(fmnist, None), tmp_path, nproc=2, env={"DGC_FAULTS": "kill@10:1"})
    assert out.returncode == 1
    run_dir = the_run_dir(tmp_path)
    suffix = f"to continue from the last checkpoint, run the same command with run_dir={run_dir.relative_to(tmp_path)} "
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: rank 1 ")]
    assert len(lines) == 1 and lines[0].endswith(suffix + "resume=auto"), out.stderr
    out = cli([*without_resume(fmnist, None), f"run_dir={run_dir.relative_to(tmp_path)}", "resume=auto"], tmp_path,
              nproc=2)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 9" in out.stdout
    assert_same_training(reference, run_dir)


def test_a_killed_sweep_rerun_with_resume_auto_keeps_its_finished_points_and_resumes_the_other(fmnist, tmp_path):
    """``-m train.max_steps=4,8`` killed in its second job (after step 6's checkpoint); the same sweep with
    resume=auto finds both runs (no run_dir= given): the first is complete, the second resumes at step 6."""
    sweep = ["-m", *(a for a in without_resume(fmnist, None) if not a.startswith("train.max_steps="))]
    sweep += ["train.max_steps=4,8"]
    out = cli(sweep, tmp_path, env={"DGC_FAULTS": "kill@6"})
    assert out.returncode == -signal.SIGKILL

    def runs() -> list[Path]:  # (runs/multirun/<time>/ holds the sweep's record of them)
        return sorted(p.parent for p in (tmp_path / "runs").glob("*/*/*/config.yaml"))

    first, second = sorted(runs(), key=lambda d: (d / "config.yaml").stat().st_mtime)
    assert (first / "summary.json").exists() and not (second / "summary.json").exists()
    finished = snapshot(first)
    out = cli([*sweep, "resume=auto"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{first.relative_to(tmp_path)} is complete (step 4, evaluated): nothing to do" in out.stdout
    assert f"resuming {second.relative_to(tmp_path)} at step 6" in out.stdout
    assert runs() == sorted([first, second])  # no run started over
    assert snapshot(first)["checkpoint.pt"] == finished["checkpoint.pt"]  # the finished run trained nothing more
    assert json.loads((second / "summary.json").read_text())["steps"] == 8


def test_resuming_a_finished_run_says_it_is_complete(fmnist, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = snapshot(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{run_dir} is complete (step 16, evaluated): nothing to do" in out.stdout
    assert '"metrics"' not in out.stdout  # not the summary again
    after = snapshot(run_dir)
    header = ("env.json", "config.yaml")  # rewritten by every start that goes ahead
    assert {k: v for k, v in after.items() if k not in header} == {k: v for k, v in before.items() if k not in header}


def test_kill_9_of_the_launcher_leaves_no_worker_and_the_run_resumes(fmnist, reference, tmp_path):
    """The launcher SIGKILLed (an OOM killer, a lost login shell): its workers do not train on unsupervised
    holding the run's lock; within 5 s none is alive, and the same command continues the run exactly."""
    run_dir = tmp_path / "run"
    job = _start_launcher(fmnist, run_dir, tmp_path)
    workers: list[int] = []
    try:
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True,
                                                  text=True).stdout.split()]  # fmt: skip
        assert len(workers) == 2, workers
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)]
    finally:
        job.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not leftover_processes(run_dir)
    out = cli(args(fmnist, run_dir), tmp_path, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_training(reference, run_dir)
