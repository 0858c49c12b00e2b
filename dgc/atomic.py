"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Everything the project writes that someone else may read (run directories, results, benchmark
JSON, plots, built corpora) goes through here: write to a temporary file in the target's folder,
flush it to disk, then rename it over the target (``os.replace`` is atomic on POSIX).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_with(
    path: str | os.PathLike[str], write: Callable[[str], None], before_replace: Callable[[], None] | None = None
) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it over ``path``
    (``before_replace()`` runs between the two, once the new content is complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; results are not
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return write_with(path, write)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike[str], obj: Any, **dumps: Any) -> Path:
    """``obj`` as indented JSON with a final newline (``dumps``: more ``json.dumps`` options)."""
    return write_text(path, json.dumps(obj, indent=2, **dumps) + "\n")


def save_figure(path: str | os.PathLike[str], fig: Any, **savefig: Any) -> Path:
    """A matplotlib figure as an image (format from the suffix); the figure is closed, saved or not."""
    import matplotlib.pyplot as plt

    fmt = Path(path).suffix.lstrip(".") or "png"
    try:
        return write_with(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig))
    finally:
        plt.close(fig)


@contextmanager
def directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder in a temporary sibling and rename it to ``path`` when the block succeeds.

    An existing ``path`` is replaced; on an error nothing is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
