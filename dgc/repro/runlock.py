"""One run per run directory: ``<run_dir>/.lock``, held by rank 0 for as long as the run lives.

The lock is an exclusive ``flock`` on the file, which the kernel (or, on NFS, the lock manager) drops the
moment the holder dies, however it dies: a lock nobody holds is stale by proof, whatever PID or host the
file names (a SIGKILLed rank 0, a job requeued onto another node, a PID reused by another process, PID 1 in
a container). It is taken over with one warning naming the previous holder. The file also says who holds it
(PID, host, start time) for the refusal message, and its modification time is renewed every
:data:`RENEW_S` seconds while the run lives (a lease).

On a file system without ``flock`` (some parallel file systems mounted without it), the lease decides: a lock
whose holder is this host's live process, or whose lease was renewed within :data:`LEASE_S` seconds, is held;
any other is stale.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from dgc.repro.config import ConfigError

NAME = ".lock"
#: seconds between renewals of the lease (the lock file's modification time)
RENEW_S = 30.0
#: a lease not renewed for this long is stale (file systems without flock only)
LEASE_S = float(os.environ.get("DGC_LOCK_LEASE_S", 300))
#: errors of flock that mean "this file system has no flock", not "someone holds it"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(owner: dict | None) -> str:
    if not owner:
        return "an unknown holder (an unreadable lock file)"
    return f"pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('started')})"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / NAME
        self.held = False
        self._fd: int | None = None
        self._renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale one was taken over. ConfigError when it is held."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                locked = self._flock(fd)
                if locked is False:
                    raise ConfigError(self._in_use(self._owner()))
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # the holder released (unlinked) it between our open and our lock: again
                    os.close(fd)
                    continue
                previous, left = self._owner(), os.fstat(fd).st_size > 0
                if locked is None and previous is not None and self._lease_held(previous, me["host"]):
                    raise ConfigError(self._in_use(previous))
                try:
                    self._write(fd, me)
                except OSError:  # a full disk: the file we may have emptied goes, the lock with it
                    self.path.unlink(missing_ok=True)
                    raise
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd, self.held = fd, True
            self._start_renewing()
            if previous is not None:
                return f"took over the stale lock of {_describe(previous)}: that run is gone ({self.path})"
            return f"took over an unreadable lock file ({self.path})" if left else None
        raise ConfigError(f"could not take {self.path}: another process keeps replacing it")

    @staticmethod
    def _flock(fd: int) -> bool | None:
        """True: locked; False: someone holds it; None: this file system has no flock."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in _NO_FLOCK:
                return None
            raise
        return True

    def _lease_held(self, owner: dict, host: str) -> bool:
        """Without flock: whether the owner still holds the lease."""
        if owner.get("host") == host and str(owner.get("pid", "")).isdigit():
            return _alive(int(owner["pid"])) and int(owner["pid"]) != os.getpid()
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        return age < LEASE_S

    def _in_use(self, owner: dict | None) -> str:
        return (
            f"{self.path.parent} is in use by {_describe(owner)}; wait for that run, or pass another run_dir "
            "(the lock frees itself when that process ends)"
        )

    @staticmethod
    def _write(fd: int, me: dict) -> None:
        data = json.dumps(me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def _owner(self) -> dict | None:
        """The lock's owner as its file says; None when the file is empty or unreadable (half-written)."""
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) and "pid" in owner else None
        except (OSError, ValueError):
            return None

    def _start_renewing(self) -> None:
        self._renewing.clear()

        def renew() -> None:
            while not self._renewing.wait(RENEW_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._renewer = threading.Thread(target=renew, name="dgc-runlock-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        if not self.held:
            return
        self._renewing.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None
        # unlink while still holding it: a process waiting on the old file notices (inode check) and retries
        self.path.unlink(missing_ok=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self.held = False
