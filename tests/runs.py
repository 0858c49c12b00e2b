"""Running ``python -m dgc.train`` in a real subprocess, and comparing run directories (tests only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tests.privatefs import die_with_parent

TINY = [
    "task=fmnist_resnet20",
    "device=cpu",
    "train.batch_size=4",
    "train.eval_batch_size=16",
    "train.progress=false",
]


def cli(
    args: list[str],
    cwd: Path,
    torchrun: bool = False,
    env: dict | None = None,
    timeout: float = 300,
    nproc: int = 0,
    inside: Callable[[list[str]], list[str]] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dgc.train`` in ``cwd``: in one process, under ``torchrun --nproc_per_node=2`` (``torchrun``),
    or as ``python -m dgc.train --nproc N`` (``nproc``); ``inside`` wraps the command line (e.g. to enter a
    namespace), and the command then dies with the test."""
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dgc.train"]
    elif nproc:
        cmd = [sys.executable, "-m", "dgc.train", "--nproc", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "dgc.train"]
    # no crash hook and no launcher variables (RANK, WORLD_SIZE, SLURM_*) from whatever runs the tests
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DGC_FAULTS")
    full_env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    cwd.mkdir(parents=True, exist_ok=True)
    argv = [*cmd, *args] if inside is None else inside([*cmd, *args])
    preexec = None if inside is None else die_with_parent
    return subprocess.run(
        argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec
    )


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def load(run_dir: Path, name: str = "checkpoint.pt") -> dict:
    return torch.load(run_dir / name, map_location="cpu", weights_only=True)


def assert_same_tree(a, b, path="") -> None:
    """Equal nested dicts/lists of tensors and plain values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def assert_same_training(a: Path, b: Path) -> None:
    """Two runs that trained identically: model, optimizer, every rank's compression state, and the log."""
    sa, sb = load(a), load(b)
    assert sa["counters"]["step"] == sb["counters"]["step"]
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert_same_tree(sa["optimizer"], sb["optimizer"])
    assert len(sa["ranks"]) == len(sb["ranks"])
    for ra, rb in zip(sa["ranks"], sb["ranks"]):
        assert ra["compression"]["compressor"]["tensors"]  # DGC keeps residuals and momenta
        # compression state, RNG and (with several workers) each worker's BatchNorm statistics
        assert_same_tree(ra, rb)
    keys = ("step", "epoch", "train_loss", "lr", "density", "sent_bytes")
    assert [[r[k] for k in keys] for r in records(a, "train")] == [[r[k] for k in keys] for r in records(b, "train")]
    keys = ("step", "epoch", "loss", "top1", "top5")
    assert [[r[k] for k in keys] for r in records(a, "eval")] == [[r[k] for k in keys] for r in records(b, "eval")]
    steps = [r["step"] for r in records(b, "train")]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
