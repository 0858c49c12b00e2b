"""dgc.repro.runlock: one run per directory; a lock whose holder is gone is taken over, whatever it names."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dgc.repro import runlock
from dgc.repro.config import ConfigError
from dgc.repro.runlock import RunLock

HOLD = """
import sys, time
from pathlib import Path
from dgc.repro.runlock import RunLock
lock = RunLock(Path(sys.argv[1]))
print(lock.acquire(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of ``tmp_path`` (killed at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "None"
    yield proc
    proc.kill()
    proc.wait()


def write_lock(path, **owner) -> None:
    (path / ".lock").write_text(json.dumps({"started": "2026-12-01 10:00:00", **owner}))


def test_a_live_holder_refuses_a_second_lock_and_release_frees_it(tmp_path):
    first = RunLock(tmp_path)
    assert first.acquire() is None and first.held
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / ".lock").exists()
    second = RunLock(tmp_path)
    assert second.acquire() is None
    second.release()


def test_another_process_holding_it_refuses(tmp_path, holder):
    with pytest.raises(ConfigError, match=f"in use by pid {holder.pid} on "):
        RunLock(tmp_path).acquire()
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing else written


def test_a_sigkilled_holder_is_taken_over_with_one_warning(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock(tmp_path)
    warning = lock.acquire()
    assert warning is not None and warning.startswith(f"took over the stale lock of pid {holder.pid} on ")
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.parametrize(
    "owner",
    [{"pid": 1, "host": socket.gethostname()}, {"pid": 4242, "host": "node-17"}],
    ids=["live-pid-of-another-process", "dead-holder-on-another-host"],
)
def test_a_lock_nobody_holds_is_stale_whatever_it_names(tmp_path, owner):
    """PID 1 is alive (it is not this run: a reused PID, a container's init); a requeued job on another node
    finds the lock of the node it lost: neither holds the lock, and both are taken over."""
    write_lock(tmp_path, **owner)
    lock = RunLock(tmp_path)
    assert lock.acquire() == (
        f"took over the stale lock of pid {owner['pid']} on {owner['host']} (since 2026-12-01 10:00:00): that run "
        f"is gone ({tmp_path / '.lock'})"
    )
    lock.release()


def test_an_unreadable_lock_is_stale(tmp_path):
    (tmp_path / ".lock").write_text("{not json")
    lock = RunLock(tmp_path)
    assert lock.acquire() == f"took over an unreadable lock file ({tmp_path / '.lock'})"
    lock.release()


def test_the_lease_is_renewed_while_the_lock_is_held(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "RENEW_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    os.utime(tmp_path / ".lock", (time.time() - 1000, time.time() - 1000))
    time.sleep(0.3)
    assert time.time() - (tmp_path / ".lock").stat().st_mtime < 5
    lock.release()


def test_without_flock_the_lease_decides(tmp_path, monkeypatch):
    """A file system without flock: a live process of this host, or a lease renewed lately, holds the lock;
    a lease left to expire does not."""
    monkeypatch.setattr(RunLock, "_flock", staticmethod(lambda fd: None))
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)  # fmt: skip
    write_lock(tmp_path, pid=os.getppid(), host=socket.gethostname())
    with pytest.raises(ConfigError, match=f"in use by pid {os.getppid()}"):
        RunLock(tmp_path).acquire()
    write_lock(tmp_path, pid=gone, host=socket.gethostname())
    lock = RunLock(tmp_path)
    assert lock.acquire().startswith(f"took over the stale lock of pid {gone} ")
    lock.release()
    write_lock(tmp_path, pid=7, host="node-17")  # renewed just now
    with pytest.raises(ConfigError, match="in use by pid 7 on node-17"):
        RunLock(tmp_path).acquire()
    expired = time.time() - runlock.LEASE_S - 10
    os.utime(tmp_path / ".lock", (expired, expired))
    lock = RunLock(tmp_path)
    assert lock.acquire().startswith("took over the stale lock of pid 7 on node-17")
    lock.release()
