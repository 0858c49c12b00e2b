"""dgc.repro.runlock: one run per directory; a dead owner's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from dgc.repro.config import ConfigError
from dgc.repro.runlock import RunLock


def test_a_live_owner_refuses_a_second_lock(tmp_path):
    first = RunLock(tmp_path)
    assert first.acquire() is None and first.held
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / ".lock").exists()
    second = RunLock(tmp_path)
    assert second.acquire() is None
    second.release()


def test_a_dead_owner_on_this_host_is_stale(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then"}))
    lock = RunLock(tmp_path)
    assert lock.acquire() == f"took over the stale lock of pid {pid} ({tmp_path / '.lock'})"
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_an_owner_on_another_host_cannot_be_checked_and_refuses(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ConfigError, match="in use by pid 1 on elsewhere.*delete"):
        RunLock(tmp_path).acquire()
    assert not [p for p in tmp_path.iterdir() if p.name != ".lock"]  # no temporary left behind


def test_an_unreadable_lock_is_stale(tmp_path):
    (tmp_path / ".lock").write_text("{not json")
    lock = RunLock(tmp_path)
    assert "took over the stale lock" in lock.acquire()
    lock.release()
