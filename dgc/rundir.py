"""Run directories: atomic writes, the metrics log, and choosing one directory for all ranks."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _atomic(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run ``write(tmp)`` on a temporary file next to ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _atomic(path, write)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def default_run_dir(task: str, compression: str) -> str:
    """A fresh ``runs/<task>/<compression>/<time>-<pid>[-N]`` (the jobs of a sweep share time and pid)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / task / compression / f"{stamp}-{os.getpid()}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return str(path)


class MetricsLog:
    """Append-only ``metrics.jsonl``: one JSON object per line (rank 0 only)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (written after the checkpoint a resumed run starts from)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        atomic_write(self.path, ("\n".join(keep) + "\n" if keep else "").encode())

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
