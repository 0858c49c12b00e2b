"""A small tmpfs that only this test's processes see, and that cannot outlive them (tests only).

The mount lives in a mount namespace of its own (``unshare --mount --propagation private``), held by one
holder process that waits on a pipe from the test: when the test ends, or is killed with SIGKILL, the pipe
closes, the holder exits, and the kernel drops the namespace with its mount as soon as the last process
inside it is gone. Nothing is ever mounted in the root namespace, so nothing is left there to unmount.

Commands run inside with :meth:`PrivateTmpfs.command` (``nsenter`` into the namespace); the test reads and
writes files there through :meth:`PrivateTmpfs.outside` (``/proc/<holder>/root/...``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# runs in the new namespace: mount, say so, then hold the namespace until stdin closes
HOLDER = """
import subprocess, sys
where, size = sys.argv[1], sys.argv[2]
proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True, text=True)
print("ready" if proc.returncode == 0 else "failed " + " ".join(proc.stderr.split()), flush=True)
sys.stdin.read()
"""
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (kept across exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def available() -> str | None:
    """Why a private tmpfs cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    missing = [t for t in ("unshare", "nsenter", "mount") if shutil.which(t) is None]
    return f"needs {' and '.join(missing)} (util-linux)" if missing else None


class PrivateTmpfs:
    """``with PrivateTmpfs(path, "24m") as fs:`` a tmpfs of that size on ``path``, seen only through ``fs``."""

    def __init__(self, where: Path, size: str):
        self.where, self.size = Path(where).resolve(), size
        self.holder: subprocess.Popen[str] | None = None

    def __enter__(self) -> PrivateTmpfs:
        self.where.mkdir(parents=True, exist_ok=True)
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", HOLDER, str(self.where)]
        self.holder = subprocess.Popen(
            [*cmd, self.size], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent
        )
        answer = self.holder.stdout.readline().strip()
        if answer != "ready":
            self.__exit__()
            raise OSError(f"cannot mount a private tmpfs on {self.where}: {answer or 'the holder exited'}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.holder is not None:
            self.holder.stdin.close()  # the holder exits; the namespace goes with the last process in it
            self.holder.wait(timeout=30)
            self.holder.stdout.close()

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (the current directory is kept)."""
        return ["nsenter", f"--target={self.pid}", "--mount", "--", *argv]

    def outside(self, path: Path) -> Path:
        """Where ``path`` (as the processes inside see it) is for this process."""
        return Path(f"/proc/{self.pid}/root") / Path(path).resolve().relative_to("/")


def mounted_anywhere(where: Path) -> list[int]:
    """Pids of every process, in any mount namespace, that sees a mount on ``where`` or below it."""
    where = str(Path(where).resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "mountinfo").read_text().splitlines()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        targets = (line.split()[4] for line in lines)
        if any(t == where or t.startswith(where + "/") for t in targets):
            pids.append(int(entry.name))
    return pids


def here(where: Path) -> list[str]:
    """What ``findmnt`` lists on ``where`` or below it in this process's own mount namespace."""
    where = str(Path(where).resolve())
    out = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True, check=True).stdout
    return [t for t in out.split() if t == where or t.startswith(where + "/")]
