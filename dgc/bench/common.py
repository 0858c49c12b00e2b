"""Shared helpers of the benchmarks: argument checks, run metadata, JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import torch

from dgc import atomic, distributed
from dgc.repro import presets

#: measured besides the compression presets: name -> (preset, overrides)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dgc_int32": ("dgc", ("compression.wire_indices=int32",)),
    "dgc_fp16": ("dgc", ("compression.wire_values=fp16",)),
    "dgc_rice": ("dgc", ("compression.wire_indices=rice",)),
    # the frontier's chunk-selection arm (cpu-frontier): fp16 values, as its DGC arm (dgc_fp16)
    "dgc_chunk_fp16": ("dgc_chunk", ("compression.wire_values=fp16",)),
    # and every tensor through it (biases, BatchNorm too): one fixed-size allgather per step, nothing else
    "dgc_chunk_one": ("dgc_chunk", ("compression.wire_values=fp16", "sync.policy.min_ndim=1")),
    # the frontier's DGC arms with the values left dense in the compressor's message (sync.pack=dense), and chunk
    # selection with the agreement there too (sync.pack=all): one collective per step
    "dgc_packed": ("dgc", ("compression.wire_values=fp16", "sync.pack=dense")),
    "dgc_chunk_packed": ("dgc_chunk", ("compression.wire_values=fp16", "sync.pack=dense")),
    "dgc_chunk_packed_all": ("dgc_chunk", ("compression.wire_values=fp16", "sync.pack=all")),
    # and DeMo so, as cpu-frontier ran it (flat tiles; it has no dense rest: its agreement alone rides in its allgather)
    "demo_packed_all": ("demo", ("sync.pack=all", "compression.mean=workers", "compression.tiles=flat")),
    # DeMo and SparseLoCo as cpu-frontier ran them (dgc.repro.frontier): flat tiles; biases and BatchNorm dense
    "demo_flat": ("demo", ("compression.mean=workers", "compression.tiles=flat")),
    "sparseloco_dense_rest": ("sparseloco", ("sync.policy.min_ndim=2",)),
    # the scale-out exchanges (dgc.exchanges); hierarchical takes the ranks per machine from the launcher
    "dgc_hierarchical": ("dgc", ("sync.exchange=hierarchical",)),
    "dgc_sparse_allreduce": ("dgc", ("sync.exchange=sparse_allreduce",)),
}


class BenchError(Exception):
    """A problem the user can fix (bad option, missing device): reported in one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (``prog: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def configurations() -> dict[str, tuple[str, tuple[str, ...]]]:
    """What the benchmarks can measure, in output order: every preset, each variant after its preset."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name in presets.names():
        out[name] = (name, ())
        out.update({v: spec for v, spec in VARIANTS.items() if spec[0] == name})
    return out


def configuration(name: str, density: float | None = None) -> presets.Preset:
    """The preset of configuration ``name``; sparse methods at ``density`` when given."""
    if name not in configurations():
        raise BenchError(f"unknown method {name!r}; valid: {','.join(configurations())}")
    base, overrides = configurations()[name]
    spec = presets.preset(base, overrides)
    if density is not None and "density" in {f.name for f in fields(spec.compression)}:
        spec = presets.preset(base, (*overrides, f"compression.density={density}"))
    return spec


def non_default(config: Any) -> dict[str, Any]:
    """The fields of a dataclass that differ from their defaults (``name`` left out)."""
    default = type(config)()
    return {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if f.name != "name" and getattr(config, f.name) != getattr(default, f.name)
    }


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
    try:
        return distributed.resolve_device(name)
    except ValueError:
        built = torch.version.cuda or "no CUDA"
        raise BenchError(
            f"--device {name}: CUDA is not available here (torch {torch.__version__}, built with {built})"
        ) from None


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


def emit(result: dict[str, Any], out: str | os.PathLike[str]) -> str:
    """Print ``result`` as one JSON object on stdout and write the same text to ``out``."""
    text = json.dumps(result, indent=2, allow_nan=False) + "\n"
    try:
        path = atomic.write_text(out, text)
    except OSError as e:
        raise BenchError(f"cannot write {out}: {e}") from None
    sys.stdout.write(text)
    sys.stdout.flush()
    log(f"wrote {path}")
    return text
