"""One run per run directory: an exclusive lock file, ``<run_dir>/.lock``, taken before anything is written.

The lock holds the owner's PID, host and start time. A lock whose process is gone (same host, PID not
alive) is stale: it is taken over with a warning, which is what a restarted job needs after a crash.
A live owner, or one on another host (whose process cannot be checked), refuses the second start.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from dgc.repro.config import ConfigError

NAME = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / NAME
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale one was taken over. ConfigError when it is held."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        warning = None
        tmp = self.path.with_name(f"{NAME}.{me['pid']}.tmp")
        tmp.write_text(json.dumps(me))
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # atomic, and the lock is complete the moment it exists
                    self.held = True
                    return warning
                except FileExistsError:
                    pass
                owner = self._owner()
                if owner is not None and (owner.get("host") != me["host"] or _alive(int(owner.get("pid", -1)))):
                    raise ConfigError(
                        f"{self.path.parent} is in use by pid {owner.get('pid')} on {owner.get('host')} "
                        f"(since {owner.get('started')}); wait for that run, or pass another run_dir. If that "
                        f"process is gone, delete {self.path}"
                    )
                warning = f"took over the stale lock of pid {owner and owner.get('pid')} ({self.path})"
                self.path.unlink(missing_ok=True)
        finally:
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"could not take {self.path}: another process keeps creating it")

    def _owner(self) -> dict | None:
        """The lock's owner; None when the file is unreadable (half-written by a crash: stale)."""
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) and "pid" in owner else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
