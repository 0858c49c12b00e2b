"""tools/background-sweep.sh: what keep commits for the next session (stopped or while the sweep runs), and the
commit a start on a fresh machine runs (pin)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = ("config.yaml", "env.json", "metrics.jsonl")
#: a committer for the scratch repository (the machine may have none configured)
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


def sweep_tool(repo: Path, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "tools/background-sweep.sh", command], cwd=repo, env={**os.environ, **GIT_ENV},
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def keep(repo: Path) -> subprocess.CompletedProcess[str]:
    return sweep_tool(repo, "keep")


def run_dir(repo: Path, name: str, *, finished: bool) -> Path:
    path = repo / "results" / "runs" / "t" / name
    path.mkdir(parents=True)
    for f in RUN_FILES:
        (path / f).write_text(f"{name} {f}\n")
    (path / "checkpoint.pt").write_bytes(os.urandom(64))
    if finished:
        (path / "summary.json").write_text("{}\n")
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.fail("git is needed: the background sweep keeps its runs in git")
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "background-sweep.sh", repo / "tools")
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")  # checkpoints and /runs/ ignored, as here
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "start")
    return repo


def committed(repo: Path) -> set[str]:
    return set(git(repo, "ls-files", "results").split())


def test_keep_commits_an_unfinished_run_with_its_checkpoint_and_a_finished_one_without(repo):
    done = run_dir(repo, "done", finished=True)
    git(repo, "add", "-f", str(done / "checkpoint.pt"))  # kept by an earlier session while it ran
    git(repo, "commit", "-q", "-m", "an earlier keep")
    run_dir(repo, "half", finished=False)
    out = keep(repo)
    assert out.returncode == 0, out.stderr
    assert "finished results/runs/t/done; unfinished results/runs/t/half" in out.stdout
    assert committed(repo) == {
        *(f"results/runs/t/half/{f}" for f in (*RUN_FILES, "checkpoint.pt")),
        *(f"results/runs/t/done/{f}" for f in (*RUN_FILES, "summary.json")),
    }
    assert (done / "checkpoint.pt").exists()  # left on disk, only out of git
    again = keep(repo)
    assert again.returncode == 0 and "nothing to keep" in again.stdout


def test_keep_while_the_sweep_runs_commits_a_snapshot_and_leaves_it_running(repo):
    half = run_dir(repo, "half", finished=False)
    sweep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (repo / "runs" / "bg").mkdir(parents=True)
        (repo / "runs" / "bg" / "pid").write_text(f"{sweep.pid}\n")
        out = keep(repo)
        assert out.returncode == 0, out.stderr
        assert "keeping a snapshot" in out.stdout and "unfinished results/runs/t/half" in out.stdout
        assert "results/runs/t/half/checkpoint.pt" in committed(repo)
        assert sweep.poll() is None  # keep does not stop the sweep
        # the run goes on: its next checkpoint is the next snapshot
        (half / "checkpoint.pt").write_bytes(os.urandom(64))
        assert "unfinished results/runs/t/half" in keep(repo).stdout
        assert git(repo, "status", "--porcelain", "--ignored", str(half)) == ""
    finally:
        sweep.kill()
        sweep.wait()


def test_a_fresh_machine_resumes_an_unfinished_run_at_the_commit_it_started_with(repo):
    def pin() -> str:
        out = sweep_tool(repo, "pin")
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "later.txt").write_text("a later commit\n")
    git(repo, "add", "later.txt")
    git(repo, "commit", "-q", "-m", "later")
    head = git(repo, "rev-parse", "HEAD").strip()
    done = run_dir(repo, "done", finished=True)
    (done / "env.json").write_text(f'{{"git_revision": "{first}"}}\n')
    assert pin() == head  # a finished run pins nothing
    half = run_dir(repo, "half", finished=False)
    (half / "env.json").write_text(f'{{"python": "3.11", "git_revision": "{first}", "world_size": 2}}\n')
    assert pin() == first
    (half / "env.json").write_text('{"git_revision": "' + "0" * 40 + '"}\n')
    assert pin() == head  # a revision this repository does not have: HEAD
    (repo / "runs" / "bg").mkdir(parents=True)
    (repo / "runs" / "bg" / "commit").write_text("")
    assert pin() == head  # an empty record (what start once left: it created the file before pin read it) is none
    (repo / "runs" / "bg" / "commit").write_text(f"{first}\n")
    assert pin() == first  # a queue under way here keeps its own


def test_keep_commits_no_more_checkpoints_than_a_submission_can_hold(repo):
    """A submission's diffs hold at most 256 MiB, a binary counting whole each time it changes: past the budget
    (checkpoints committed in the last 3 hours), keep leaves the unfinished runs out, in one line, and still keeps
    the finished ones."""
    half = run_dir(repo, "half", finished=False)
    env = {**os.environ, **GIT_ENV, "KEEP_BUDGET_BYTES": "100"}
    first = subprocess.run(["bash", "tools/background-sweep.sh", "keep"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert first.returncode == 0 and "unfinished results/runs/t/half" in first.stdout, first.stdout + first.stderr
    (half / "checkpoint.pt").write_bytes(os.urandom(64))  # the run went on: 64 bytes more, 128 with the first
    (half / "metrics.jsonl").write_text("later\n")
    run_dir(repo, "done", finished=True)
    second = subprocess.run(["bash", "tools/background-sweep.sh", "keep"], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert "not keeping the unfinished runs (results/runs/t/half)" in second.stdout
    assert "finished results/runs/t/done; unfinished (none)" in second.stdout
    assert git(repo, "show", "HEAD:results/runs/t/half/metrics.jsonl") == "half metrics.jsonl\n"  # as first kept
    assert not git(repo, "status", "--porcelain", "--", "results/runs/t/done").strip()


RANK = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def last_checkpoint(*_):
    time.sleep(2)  # a rank finishing its step and writing its checkpoint after the signal
    out.write_text("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGTERM, last_checkpoint)
out.with_suffix(".ready").write_text("")
time.sleep(60)
"""


def test_stop_returns_once_every_process_of_the_sweep_is_gone(repo, tmp_path):
    """The ranks write their last checkpoint after the sweep's own shell has exited: stop waits for the whole process
    group, so a keep right after finds the checkpoint in place."""
    out = tmp_path / "rank.out"
    sweep = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "$1" "$2" & wait', "_", RANK, str(out)],
                             start_new_session=True)  # fmt: skip
    threading.Thread(target=sweep.wait, daemon=True).start()  # reaped as it exits, as init reaps the real sweep
    try:
        for _ in range(300):
            if out.with_suffix(".ready").exists():
                break
            time.sleep(0.1)
        (repo / "runs" / "bg").mkdir(parents=True)
        (repo / "runs" / "bg" / "pid").write_text(f"{sweep.pid}\n")
        stopped = sweep_tool(repo, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert out.read_text() == "checkpoint"
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the group is left behind
            os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()
