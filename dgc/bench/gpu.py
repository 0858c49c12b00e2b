"""``python -m dgc.bench gpu`` (``make gpu-check``): the whole GPU check as one command.

Made for a short slot on a cold accelerator machine: every part has a share of ``--budget-s``
(default 480 s), and a part that would start after the budget is spent is recorded as skipped.
Parts, in order, each writing one JSON under ``--out-dir`` (default ``runs/gpu``; the Makefile
passes ``results/gpu``):

1. ``tests.json``: the ``gpu``-marked tests (``pytest -m gpu``): CUDA results equal the CPU's,
   sampling stays on the device. Counts of passed/failed/skipped and the tail of the output.
2. ``tasks.json``: a few steps of every task through ``python -m dgc.train`` on the device
   (``train.bf16=true`` on CUDA), on tiny data written for the check (the formats the tasks read;
   ``kjv_lstm`` and ``synth_deepspeech`` use their real data when ``make data`` made it, else are
   recorded as skipped); then a world of one under torchrun (NCCL on CUDA) with the DDP comm hook,
   and a run stopped after 4 steps and resumed to 6 (``resume=true``) on the device.
3. ``collectives.json``: every collective on a real process group, which a world of one otherwise skips:
   ``DGC_COLLECTIVES_AT_WORLD_1=1`` (:mod:`dgc.distributed`) makes a group of one (NCCL on CUDA, gloo in
   the self-test) and keeps the collectives; each exchange (flat, sparse_allreduce, hierarchical), the
   DDP hook and a dense compressor, each run to 4 steps with checkpoints, then resumed to 6; on a GPU also the
   overlapped DDP hook, chunk selection, DeMo, DiLoCo and SparseLoCo (``GPU_COLLECTIVE_RUNS``). With two
   GPUs or more, the same with 2 ranks under torchrun.
4. ``select_<model>.json``: :mod:`dgc.bench.select` on the gradient size of ResNet-50, AlexNet and
   the PTB LSTM: DGC's compress step against exact ``torch.topk`` and one memory pass, interleaved.
5. ``cluster_<n>.json``: with root and ``ip netns``, the emulated 1 Gbps cluster bench
   (:mod:`dgc.bench.cluster`) at 4 and 8 nodes, one core per rank or more.

Then ``summary.json`` and ``summary.md`` (a table of every part). The exit status is 0 when no part
failed (skipped parts are not failures), 1 otherwise.

Without a GPU, the command says so in one line and exits with status 2. ``--self-test`` runs the same
logic on the CPU with tiny sizes (one task, small tensors, no cluster), so CI keeps it working.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dgc import atomic
from dgc.bench.common import BenchError, log, positive_int_arg, run_info
from dgc.distributed import COLLECTIVES_AT_WORLD_1

ROOT = Path(__file__).resolve().parents[2]
#: gradient sizes timed by the select part: (name, numel); the PTB LSTM is Zaremba's large model
SELECT_SHAPES = (("resnet50", 25_557_032), ("alexnet", 61_100_840), ("lstm", 66_034_000))
TASKS = (
    "fmnist_resnet20",
    "cifar10_resnet20",
    "cifar10_resnet110",
    "imagenet_resnet50",
    "imagenet_alexnet",
    "ptb_lstm",
    "kjv_lstm",
    "an4_deepspeech",
    "librispeech_deepspeech",
    "synth_deepspeech",
)
#: tasks whose data cannot be faked here: their real data home (``make data``) or a skip
REAL_DATA = {"kjv_lstm": "kjv", "synth_deepspeech": "synth_speech"}
TINY = ["train.max_steps=2", "data.limit=16", "data.eval_limit=8", "train.batch_size=4", "train.eval_batch_size=8"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gpu", help="the GPU check (make gpu-check)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out-dir", default="runs/gpu", help="where the JSON files and summary go (default runs/gpu)")
    p.add_argument("--budget-s", type=positive_int_arg, default=480, help="time for all parts (default 480)")
    p.add_argument("--self-test", action="store_true", help="run the check's logic on the CPU with tiny sizes")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of the parts (default: all)")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


# -- tiny data ------------------------------------------------------------------------------------
def _writers() -> SimpleNamespace:
    """The tiny data writers of the checkout's tests/ (an installed package has none)."""
    sys.path.insert(0, str(ROOT))
    try:
        from dgc.tasks.tiny_data import (
            write_an4,
            write_cifar10,
            write_fmnist,
            write_imagefolder,
            write_librispeech,
            write_ptb,
        )
    except ImportError as exc:
        raise BenchError(f"the tiny data writers live in the checkout's tests/ ({exc}); run from a checkout") from None
    finally:
        sys.path.pop(0)
    return SimpleNamespace(cifar10=write_cifar10, fmnist=write_fmnist, imagefolder=write_imagefolder, ptb=write_ptb,
                           an4=write_an4, librispeech=write_librispeech)  # fmt: skip


def tiny_data(root: Path) -> dict[str, str]:
    """Write tiny data sets for the tasks that read public formats; returns ``{task: data.root}``."""
    w = _writers()
    cifar = str(w.cifar10(root / "cifar10", per_batch=8, n_test=8))
    imagenet = str(w.imagefolder(root / "imagenet", classes=2, per_class_train=4, per_class_val=2, size=64))
    libri = root / "librispeech"
    w.librispeech(libri, {"train-clean-100": 4, "train-clean-360": 2, "train-other-500": 2,
                          "test-clean": 2, "test-other": 2})  # fmt: skip
    return {
        "fmnist_resnet20": str(w.fmnist(root / "fmnist", n_train=32, n_test=16)),
        "cifar10_resnet20": cifar,
        "cifar10_resnet110": cifar,
        "imagenet_resnet50": imagenet,
        "imagenet_alexnet": imagenet,
        "ptb_lstm": str(w.ptb(root / "ptb")),
        "an4_deepspeech": str(w.an4(root / "an4")),
        "librispeech_deepspeech": str(libri),
    }


def real_data(task: str) -> str | None:
    home = Path(os.environ.get("DGC_DATA", ROOT / "data")) / REAL_DATA[task]
    return str(home) if home.exists() and any(home.iterdir()) else None


# -- parts ----------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float, cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
        text += f"\n(stopped after {timeout:.0f} s)"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return {"command": " ".join(cmd), "rc": rc, "wall_s": round(time.perf_counter() - t0, 2),
            "last_line": lines[-1] if lines else "", "tail": "\n".join(lines[-15:])}  # fmt: skip


def _pytest_counts(text: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}


def part_tests(ctx: Context) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/"]
    res = _run(cmd, ctx.left(), ROOT)
    counts = _pytest_counts(res["tail"])
    ok = res["rc"] == 0 or (res["rc"] == 5 and ctx.self_test)  # 5: nothing collected/ran
    if not ctx.self_test and counts.get("passed", 0) == 0:
        ok = False  # on the device the gpu tests must run, not skip
    return {**res, **counts, "ok": ok}


def part_tasks(ctx: Context) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="dgc-gpu-data-"))
    runs = Path(tempfile.mkdtemp(prefix="dgc-gpu-runs-"))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    try:
        roots = tiny_data(data_dir)
        device = ["device=cpu"] if ctx.self_test else ["device=cuda", "train.bf16=true"]
        train = [sys.executable, "-m", "dgc.train", "compression=dgc", "train.progress=false", *device]
        rows: list[dict[str, Any]] = []
        tasks = ("fmnist_resnet20",) if ctx.self_test else TASKS
        for task in tasks:
            root = roots.get(task) or real_data(task)
            if root is None:
                why = f"no data: `make data` writes data/{REAL_DATA[task]}"
                rows.append({"name": task, "ok": None, "skipped": why})
                continue
            cmd = [*train, f"task={task}", f"data.root={root}", *TINY, f"run_dir={runs / task}"]
            rows.append({"name": task, **_run(cmd, ctx.left(), ROOT, env)})
        fm = ["task=fmnist_resnet20", f"data.root={roots['fmnist_resnet20']}", *TINY[1:]]
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "dgc.train"]
        hook = [*run, "compression=dgc", "train.progress=false", "sync.ddp_hook=true", *device, *fm,
                "train.max_steps=2", f"run_dir={runs / 'hook'}"]  # fmt: skip
        rows.append({"name": "ddp_hook_world_1", **_run(hook, ctx.left(), ROOT, env)})
        rows.append({"name": "resume", **_run_resumed([*train, *fm], runs / "resume", ctx, env)})
        for row in rows:
            if "rc" in row:
                row["ok"] = row["rc"] == 0 and row.get("ok_steps", True)
        return {"device": "cpu" if ctx.self_test else "cuda", "runs": rows,
                "ok": all(r["ok"] is not False for r in rows)}  # fmt: skip
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)


def _run_resumed(cmd: list[str], run_dir: Path, ctx: Context, env: dict[str, str]) -> dict[str, Any]:
    """``cmd`` to 4 steps with a checkpoint every 2, then resumed to 6: the second run's row, ``ok_steps``
    when the log ends at step 6."""
    cmd = [*cmd, "train.checkpoint_every=2", f"run_dir={run_dir}"]
    a = _run([*cmd, "train.max_steps=4"], ctx.left(), ROOT, env)
    b = _run([*cmd, "train.max_steps=6", "resume=true"], ctx.left(), ROOT, env)
    steps = _last_step(run_dir)
    return {**b, "rc": a["rc"] or b["rc"], "first_rc": a["rc"], "last_step": steps, "ok_steps": steps == 6}


def _last_step(run_dir: Path) -> int | None:
    """The last optimizer step the run's metrics record, or None."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line).get("step", -1)))
        except (ValueError, AttributeError):
            continue
    return max(steps) if steps else None


#: the collectives part's runs: (name, overrides)
COLLECTIVE_RUNS = (
    ("flat", ["compression=dgc", "sync.exchange=flat"]),
    ("sparse_allreduce", ["compression=dgc", "sync.exchange=sparse_allreduce"]),
    ("hierarchical", ["compression=dgc", "sync.exchange=hierarchical", "sync.ranks_per_node=1"]),
    ("ddp_hook", ["compression=dgc", "sync.ddp_hook=true"]),
    ("powersgd", ["compression=powersgd"]),
)
#: the same on a GPU only (each passes on the CPU: a slow test; the self-test runs only the first of all): the
#: overlapped DDP hook (its CUDA events and futures), chunk selection, DeMo, local steps (DiLoCo, SparseLoCo), on NCCL
GPU_COLLECTIVE_RUNS = (
    ("ddp_hook_overlap", ["compression=dgc", "sync.ddp_hook=true", "sync.overlap=true"]),
    ("dgc_chunk", ["compression=dgc_chunk"]),
    ("demo", ["compression=demo"]),
    ("diloco", ["compression=diloco", "local_steps.every=2"]),
    ("sparseloco", ["compression=sparseloco", "local_steps.every=2"]),
)


def part_collectives(ctx: Context) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="dgc-gpu-data-"))
    runs = Path(tempfile.mkdtemp(prefix="dgc-gpu-runs-"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "2", COLLECTIVES_AT_WORLD_1: "1"})
    fm = str(_writers().fmnist(data_dir / "fmnist", n_train=32, n_test=16))
    device = ["device=cpu"] if ctx.self_test else ["device=cuda", "train.bf16=true"]
    base = ["task=fmnist_resnet20", f"data.root={fm}", "train.progress=false", *device, *TINY[1:]]
    launchers = [("world_1", [sys.executable, "-m", "dgc.train"])]
    if not ctx.self_test and torch.cuda.device_count() >= 2:
        launchers.append(("2_ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node=2", "-m", "dgc.train"]))  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        for where, launch in launchers:
            # the self-test checks this part's logic with the first run (each run passes on the CPU: a slow test)
            for name, extra in COLLECTIVE_RUNS[:1] if ctx.self_test else COLLECTIVE_RUNS + GPU_COLLECTIVE_RUNS:
                row = _run_resumed([*launch, *base, *extra], runs / f"{where}-{name}", ctx, env)
                rows.append({"name": f"{where} {name}", **row, "ok": row["rc"] == 0 and row["ok_steps"]})
        backend = "gloo" if ctx.self_test else "nccl"
        return {"backend": backend, "runs": rows, "ok": all(r["ok"] for r in rows)}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)


def part_select(ctx: Context) -> dict[str, Any]:
    from dgc.bench.select import bench_select

    shapes = (("tiny", 200_000),) if ctx.self_test else SELECT_SHAPES
    rows = []
    for name, numel in shapes:
        if ctx.left() < 10:
            rows.append({"name": name, "ok": None, "skipped": "out of time"})
            continue
        res = bench_select(numel, 0.001, 3 if ctx.self_test else 20, "cpu" if ctx.self_test else "cuda", 0)
        atomic.write_json(ctx.out_dir / f"select_{name}.json", res)
        rows.append({"name": name, "numel": numel, "dgc_ms": res["dgc_ms"], "topk_ms": res["topk_ms"],
                     "pass_ms": res["pass_ms"], "dgc_over_topk": res["dgc_over_topk"],
                     "dgc_over_pass": res["dgc_over_pass"], "ok": True})  # fmt: skip
    return {"runs": rows, "ok": True}


def part_cluster(ctx: Context) -> dict[str, Any]:
    if ctx.self_test:
        return {"ok": None, "skipped": "not in the self-test"}
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return {"ok": None, "skipped": "needs root and ip netns"}
    cores = os.cpu_count() or 1
    rows = []
    for nodes in (4, 8):
        if ctx.left() < 90:
            rows.append({"name": f"{nodes} nodes", "ok": None, "skipped": "out of time"})
            continue
        out = ctx.out_dir / f"cluster_{nodes}.json"
        threads = str(max(1, cores // nodes))
        cmd = [sys.executable, "-m", "dgc.bench", "cluster", "--nodes", str(nodes), "--model", "resnet50",
               "--threads", threads, "--methods", "none,fp16,powersgd,dgc", "--out", str(out)]  # fmt: skip
        res = _run(cmd, ctx.left(), ROOT)
        row: dict[str, Any] = {"name": f"{nodes} nodes", **res, "ok": res["rc"] == 0}
        if res["rc"] == 0:
            methods = json.loads(out.read_text())["methods"]
            row["exchange_s"] = {m: r["exchange_s"] for m, r in methods.items()}
            row["dgc_speedup_vs_none"] = methods["dgc"].get("speedup_vs_none")
        rows.append(row)
    return {"runs": rows, "ok": all(r["ok"] is not False for r in rows)}


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "tests": part_tests,
    "tasks": part_tasks,
    "collectives": part_collectives,
    "select": part_select,
    "cluster": part_cluster,
}


class Context:
    def __init__(self, out_dir: Path, budget_s: float, self_test: bool):
        self.out_dir, self.budget_s, self.self_test = out_dir, budget_s, self_test
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def summary_markdown(result: dict[str, Any]) -> str:
    lines = [f"# GPU check ({result['device_name'] or 'CPU self-test'}, {result['timestamp_utc']})", "",
             f"`{result['command']}`, {result['wall_s']:.0f} s; status: {'ok' if result['ok'] else 'FAILED'}", "",
             "| part | item | result | detail |", "|---|---|---|---|"]  # fmt: skip
    for name, part in result["parts"].items():
        rows = part.get("runs") or [part]
        for row in rows:
            state = "skipped" if row.get("ok") is None else "ok" if row.get("ok") else "FAILED"
            if name == "select" and "dgc_ms" in row:
                detail = (f"dgc {row['dgc_ms']:.2f} ms, topk {row['topk_ms']:.2f} ms, pass {row['pass_ms']:.2f} ms; "
                          f"dgc/topk {row['dgc_over_topk']:.3f}, dgc/pass {row['dgc_over_pass']:.2f}")  # fmt: skip
            elif name == "tests":
                detail = ", ".join(
                    f"{v} {k}" for k, v in part.items() if k in ("passed", "failed", "skipped", "errors")
                )
            elif "exchange_s" in row:
                detail = ", ".join(f"{m} {s * 1e3:.0f} ms" for m, s in row["exchange_s"].items())
            else:
                detail = row.get("skipped") or (f"{row.get('wall_s', 0):.0f} s" + (
                    "" if row.get("ok") else f": {row.get('last_line', '')[:120]}"))  # fmt: skip
            lines.append(f"| {name} | {row.get('name', '')} | {state} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise BenchError(f"unknown part {bad[0]!r}; valid: {', '.join(PARTS)}")
    if not args.self_test and not torch.cuda.is_available():
        raise BenchError("no CUDA device here: the GPU check needs one (--self-test checks the script on the CPU)")
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create {out_dir}: {exc.strerror}") from None
    ctx = Context(out_dir, args.budget_s, args.self_test)
    info = run_info("gpu", "cpu" if args.self_test else "cuda")
    results: dict[str, Any] = {}
    for name in parts:
        if ctx.left() <= 5:
            results[name] = {"ok": None, "skipped": "out of time"}
            continue
        log(f"gpu check: {name} ({ctx.left():.0f} s left)")
        try:
            results[name] = PARTS[name](ctx)
        except BenchError as exc:
            results[name] = {"ok": False, "error": str(exc)}
        atomic.write_json(out_dir / f"{name}.json", results[name])
        log(f"gpu check: {name}: {'ok' if results[name]['ok'] is not False else 'FAILED'}")
    ok = all(part.get("ok") is not False for part in results.values())
    result = {**info, "self_test": args.self_test, "budget_s": args.budget_s,
              "wall_s": time.perf_counter() - ctx.start, "parts": results, "ok": ok}  # fmt: skip
    atomic.write_json(out_dir / "summary.json", result)
    atomic.write_text(out_dir / "summary.md", summary_markdown(result))
    log(f"wrote {out_dir / 'summary.md'}")
    print(summary_markdown(result), end="")
    if not ok:
        raise SystemExit(1)
    return result
