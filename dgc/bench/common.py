"""Shared helpers of the benchmarks: argument checks, run metadata, atomic JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import torch

#: the compact configuration (conf/compression/dgc_compact.yaml says the same): DGC's values in fp16
#: with Rice-coded index gaps, the tensors it leaves dense (BatchNorm, biases) in 1 bit per value with
#: error feedback; ``COMPACT_ALL_POLICY`` makes every tensor sparse instead
COMPACT_OPTIONS: dict[str, Any] = {"wire_values": "fp16", "wire_indices": "rice"}
COMPACT_POLICY: dict[str, Any] = {"dense_values": "1bit"}
COMPACT_ALL_POLICY: dict[str, Any] = {"min_ndim": 1}


class BenchError(Exception):
    """A problem the user can fix (bad option, missing device): reported in one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (``prog: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def log(message: str) -> None:
    """Progress and info go to stderr; stdout carries only the JSON result."""
    print(message, file=sys.stderr, flush=True)


# -- argument types -----------------------------------------------------------------
def density_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if math.isnan(value) or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


# -- devices and timing -----------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda``; a BenchError when CUDA is asked for and not usable."""
    if name == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA"
        raise BenchError(f"--device cuda: CUDA is not available here (torch {torch.__version__}, built with {built})")
    return torch.device(name)


def synchronizer(device: torch.device):  # noqa: ANN201 - returns a no-argument callable
    """A function that waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def now() -> float:
    return time.perf_counter()


# -- metadata and output ----------------------------------------------------------------
def run_info(bench: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """What every result records about the run (no host name)."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "bench": bench,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        },
        "argv": list(sys.argv),
        "command": command_line(),
        "timestamp_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return info


def command_line() -> str:
    """The command as typed, for ``python -m dgc.bench`` (whose ``sys.argv[0]`` is a file path)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "bench":
        argv = ["python", "-m", "dgc.bench", *argv[1:]]
    return shlex.join(argv)


def finite(x: float) -> float | None:
    """JSON has no inf/nan: those become null."""
    return x if math.isfinite(x) else None


def write_json_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a result file is not
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def emit(result: dict[str, Any], out: str | os.PathLike[str]) -> str:
    """Print ``result`` as one JSON object on stdout and write the same text to ``out``."""
    text = json.dumps(result, indent=2, allow_nan=False) + "\n"
    try:
        path = write_json_atomic(out, text)
    except OSError as e:
        raise BenchError(f"cannot write {out}: {e}") from None
    sys.stdout.write(text)
    sys.stdout.flush()
    log(f"wrote {path}")
    return text
