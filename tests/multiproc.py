"""Run a function in N real processes joined by a gloo process group on 127.0.0.1.

``run(fn, world_size, *args)`` starts the workers (forked from a server process: :data:`PRELOAD`), calls
``fn(rank, world_size, *args)`` in each after ``init_process_group``, and returns the per-rank return values
(anything ``torch.save`` can write). A failing worker fails the call with its traceback; no worker outlives the
call.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["DGC_TEST_RANK"] = str(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=_TIMEOUT
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
        # every rank is done with its collectives before any tears down its connections (os._exit below does: no
        # destroy_process_group, which under torch 2.4 hung now and then once the other ranks had left)
        dist.barrier()
        code = 0
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        code = 1
    # leave without running C++ static destructors: gloo's background threads can make the
    # interpreter's teardown abort ("terminate called without an active exception") after the
    # result is already written, which would fail an otherwise passing test at random
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_TIMEOUT = __import__("datetime").timedelta(seconds=120)

#: the workers are forked from one server process that has imported these once (``forkserver``): a fresh
#: interpreter per worker (``spawn``) would import torch again for every call, seconds each on 2 cores. Each worker
#: still starts from a state no test has touched; the server ends with the test session (it exits when its parent
#: does, even killed).
PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "dgc", "tests.multiproc"]
mp.set_forkserver_preload(PRELOAD)


def run(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as outdir:
        error = None
        try:
            mp.start_processes(
                _entry,
                args=(world_size, free_port(), outdir, fn, args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except Exception as exc:  # the per-rank traceback below says more
            error = exc
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} wrote no result: {error}")
            out = torch.load(path, weights_only=False)
            if "error" in out:
                raise RuntimeError(f"rank {rank} failed:\n{out['error']}")
            results.append(out["ok"])
        if error is not None:
            raise RuntimeError(f"workers failed: {error}")
        return results


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found through /proc's parent links; Linux only). Found
    before anything is killed: torchrun starts its workers in sessions of their own, out of its process group."""
    parents: dict[int, list[int]] = {}
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            with open(f"/proc/{stat}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(stat))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
