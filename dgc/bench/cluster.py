"""``python -m dgc.bench cluster``: gradient exchange on an emulated bandwidth-limited cluster.

Needs root. The command re-runs itself, one rank per node, under ``launch/netcluster.py``
(network namespaces joined by a bridge, every link shaped to ``--rate`` in both directions with
a token bucket; see that script), and rank 0 collects the measurements of all ranks.

Exchange mode (default): real parameter shapes (``--model``: torchvision ``resnet50`` or
``alexnet`` with ``weights=None``; ``lstm``, the PTB language model of Zaremba et al. (2 LSTM
layers of 1500 units, 10k vocabulary, embedding tied to the decoder); ``tiny``, a small MLP for
tests) and seeded random gradients, a fresh one every step and the same for every method (each
rank draws its own). Every method has its own :class:`dgc.GradientSync` (default policy: tensors
with dim > 1 compressed, the rest averaged dense in fp32) and a :class:`dgc.SGD` (momentum 0.9;
DGC keeps the momentum). Per step, the methods run one after another in an order rotated every
step, each after a barrier; a step's ``exchange_s`` is the wall time of ``sync.step()``
(compress, communicate, decompress), the slowest rank's. ``--warmup`` steps per method are not
timed (first-call costs; DGC's residuals fill up), then medians over ``--steps`` steps.
DGC runs at its final density (0.001) from the first step: the measurement is "after warm-up".

Reported per method: ``exchange_s``, ``compress_s``, ``communicate_s`` and ``decompress_s``
(medians over steps of the slowest rank; ``communicate_s`` includes waiting for slower ranks
inside the collectives), ``sent_bytes`` per rank and step (rank 0, last step), ``wire_ratio``,
``speedup_vs_none`` and ``speedup_vs_fp16`` (ratios of median exchange times in this run).

End-to-end mode (``--e2e``): real training steps through the trainer (:class:`dgc.repro.trainer.Trainer`,
the code ``python -m dgc.train`` runs) on Fashion-MNIST with ``fmnist_wide``, an AlexNet-shaped
net for 28x28 grey images (two 5x5 convolutions, then 6272-2048-2048-10 fully connected: 17.3M
parameters, 69 MB of fp32 gradient, whose compute per step is small next to a dense exchange on
1 Gbps). One trainer per method, stepped alternately, each step after a barrier. ``local`` is
the no-communication reference: the same job on the same ranks (compression ``none``) with the
exchange skipped entirely (``sync.step()`` does nothing: each rank steps with its own gradient),
i.e. the same per-worker compute and nothing else.
Reported per method: medians of the slowest rank's ``step_s``, ``compute_s``, ``compress_s``,
``communicate_s`` (the trainer's own split, as in ``metrics.jsonl``) and ``step_over_local``.

With N ranks on fewer cores, ranks compete for the CPU: compression and compute are slower than
on a machine per rank, and slowest-rank timings include that contention (recorded: cores, load
average before and after).

Output: one JSON (``runs/bench/cluster.json``, ``cluster_e2e.json`` with ``--e2e``; ``--out``) and a
plot next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dgc import atomic, seeding
from dgc.bench.common import (
    BenchError,
    configuration,
    configurations,
    emit,
    int_arg,
    log,
    non_default,
    positive_int_arg,
    run_info,
)
from dgc.bench.ddp_e2e import DDP_METHODS, DEFAULT_DDP_METHODS, run_ddp_e2e
from dgc.bench.ddp_e2e import comm_ratio as ddp_comm_ratio
from dgc.bench.emulated import NodeLink, e2e_config, setup_record, summarize

NETCLUSTER = Path(__file__).resolve().parents[2] / "launch" / "netcluster.py"
MODELS = ("resnet50", "alexnet", "lstm", "tiny")
DEFAULT_METHODS = "none,fp16,powersgd,topk,dgc"
DEFAULT_E2E_METHODS = "local,none,fp16,powersgd,dgc"


#: exchange methods by name: every compression preset and the benchmark variants (dgc.bench.common)
METHODS = tuple(configurations())
#: end-to-end methods: "local" is the no-communication reference
E2E_METHODS = ("local", *METHODS)


def build_shapes(name: str, seed: int = 0) -> nn.Module:
    """A module holding the parameters (shapes) of model ``name``."""
    from dgc.tasks.models import build_model

    torch.manual_seed(seed)
    if name in ("resnet50", "alexnet"):
        import torchvision

        return torchvision.models.get_model(name, weights=None)
    if name == "lstm":  # Zaremba et al.'s large PTB model: 2 x 1500 LSTM, 10k vocabulary, tied
        return build_model("lstm_lm", vocab_size=10_000)
    if name == "tiny":
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    raise BenchError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")


# -- arguments ------------------------------------------------------------------------------
def _methods_arg(valid: tuple[str, ...]):  # noqa: ANN202
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown method {', '.join(unknown) or text!r}; valid: {','.join(valid)}")
        return list(dict.fromkeys(names))

    return parse


def nodes_arg(text: str) -> int:
    value = positive_int_arg(text)
    if value > 64:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 64], got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cluster",
        help="gradient exchange (or training steps, --e2e) on an emulated cluster with shaped links (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=nodes_arg, default=4, help="machines, one namespace each (default: 4)")
    p.add_argument("--ranks-per-node", type=nodes_arg, default=1, help="ranks per machine (default: 1)")
    p.add_argument("--rate", default="1gbit", help="link rate per direction, tc syntax (default: 1gbit)")
    p.add_argument("--model", choices=MODELS, default="resnet50", help="parameter shapes (default: resnet50)")
    p.add_argument("--steps", type=positive_int_arg, default=5, help="timed steps per method; medians (default: 5)")
    p.add_argument("--warmup", type=int_arg, default=2, help="untimed steps per method first (default: 2)")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, of {','.join(METHODS)} (default: {DEFAULT_METHODS}; "
        f"with --e2e also local, default {DEFAULT_E2E_METHODS})",
    )
    p.add_argument("--e2e", action="store_true", help="time real training steps through the trainer instead")
    p.add_argument(
        "--ddp",
        action="store_true",
        help="with --e2e: DDP as users run it (its allreduce, bf16 and PowerSGD hooks) against DGC's hook, "
        f"serial and overlapped (dgc.bench.ddp_e2e; methods {DEFAULT_DDP_METHODS})",
    )
    p.add_argument("--comm-ratios", type=ratios_arg, default=None,
                   help="with --ddp: run at the link rates where DDP fp32's traffic takes these multiples of the "
                        "compute-only step (e.g. 0.5,2,8), found by a calibration run at --rate; one JSON")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int_arg, default=32, help="--e2e: batch per worker (default: 32)")
    p.add_argument("--threads", type=positive_int_arg, default=1, help="threads per rank (default: 1)")
    p.add_argument("--seed", type=int_arg, default=0, help="seed of shapes and gradients (default: 0)")
    p.add_argument("--out", default=None, help="JSON output (default: runs/bench/cluster.json or cluster_e2e.json)")
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def ratios_arg(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be numbers > 0 separated by commas (e.g. 0.5,2,8), got {text!r}")
    return values


def resolve_methods(args: argparse.Namespace) -> list[str]:
    if (args.ddp or args.comm_ratios) and not args.e2e:
        raise BenchError("--ddp and --comm-ratios go with --e2e")
    if args.comm_ratios and not args.ddp:
        raise BenchError("--comm-ratios goes with --ddp (the rates are DDP fp32's)")
    if args.ddp:
        valid, default = DDP_METHODS, DEFAULT_DDP_METHODS
    else:
        valid, default = (E2E_METHODS, DEFAULT_E2E_METHODS) if args.e2e else (tuple(METHODS), DEFAULT_METHODS)
    text = args.methods or default
    try:
        return _methods_arg(valid)(text)
    except argparse.ArgumentTypeError as e:
        raise BenchError(f"--methods: {e}") from None


def default_out(args: argparse.Namespace) -> str:
    name = "cluster_e2e_ddp" if args.ddp else "cluster_e2e" if args.e2e else "cluster"
    return args.out or f"runs/bench/{name}.json"


# -- the launcher side ----------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, methods: list[str], raw: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "dgc.bench", "cluster",
        "--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node), "--rate", args.rate,
        "--model", args.model,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--methods", ",".join(methods),
        "--batch-size", str(args.batch_size), "--threads", str(args.threads), "--seed", str(args.seed),
        "--worker", "--worker-out", str(raw),
    ]  # fmt: skip
    return argv + (["--e2e"] if args.e2e else []) + (["--ddp"] if args.ddp else [])


def launch(args: argparse.Namespace) -> dict[str, Any]:
    methods = resolve_methods(args)
    if os.geteuid() != 0:
        raise BenchError("cluster needs root (it builds network namespaces with launch/netcluster.py); run it as root")
    if not NETCLUSTER.is_file():
        raise BenchError(f"{NETCLUSTER} not found: the cluster bench runs from a source checkout")
    load_before = os.getloadavg()
    started = time.perf_counter()
    if args.comm_ratios:
        result = launch_at_ratios(args, methods)
    else:
        result = launch_one(args, methods)
    info = run_info("cluster", "cpu")
    info["threads"] = args.threads
    result = {
        **info,
        **result,
        "wall_s": time.perf_counter() - started,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    return result


def launch_one(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    """One run of the ranks under netcluster at ``args.rate``; rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="dgc-cluster-") as tmp:
        raw = Path(tmp) / "result.json"
        cmd = [
            sys.executable, str(NETCLUSTER), "--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node),
            "--rate", args.rate,
            "--threads", str(args.threads), "--", *worker_argv(args, methods, raw),
        ]  # fmt: skip
        log(f"cluster: {' '.join(cmd[1:6])} ... ({len(methods)} methods, model {args.model})")
        try:
            stdout_fd = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout_fd = None
        proc = subprocess.run(cmd, stdout=stdout_fd, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise BenchError(f"the cluster run failed (exit status {proc.returncode}); see the messages above")
        if not raw.is_file():
            raise BenchError("the cluster run wrote no result")
        return json.loads(raw.read_text())


def launch_at_ratios(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    """--comm-ratios: a calibration run (local and ddp at ``args.rate``) gives the compute-only step and the bytes
    DDP puts on a machine's link per step; each ratio r then runs at the rate where those bytes take r compute-only
    steps. Every run is one netcluster launch; one JSON holds them all."""
    calibration = launch_one(argparse.Namespace(**{**vars(args), "steps": max(3, args.steps // 2)}), ["local", "ddp"])
    local_s = calibration["methods"]["local"]["step_s"]
    link_bytes = calibration["methods"]["ddp"]["link_bytes"]
    if not link_bytes:
        raise BenchError("the calibration run measured no bytes on the links (no veth counter): cannot set the rates")
    runs = []
    for ratio in args.comm_ratios:
        mbit = max(1, round(link_bytes * 8 / (ratio * local_s) / 1e6))
        log(f"cluster: DDP fp32 traffic {link_bytes / 1e6:.1f} MB per machine and step, compute-only step "
            f"{local_s:.3f} s: {ratio:g}x compute at {mbit} mbit/s")  # fmt: skip
        result = launch_one(argparse.Namespace(**{**vars(args), "rate": f"{mbit}mbit"}), methods)
        result["comm_ratio_target"] = ratio
        result["comm_ratio_measured"] = ddp_comm_ratio(result)
        runs.append(result)
    return {"mode": "e2e-ddp-ratios", "calibration": calibration, "runs": runs}


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.worker:
        worker(args)
        return None
    result = launch(args)
    out = default_out(args)
    emit(result, out)
    if not args.no_plot:
        try:
            path = plot(result, Path(out).with_suffix(".png"))
            log(f"wrote {path}")
        except Exception as e:  # noqa: BLE001 - the JSON is the result; a plot failure is reported only
            log(f"cluster: no plot ({type(e).__name__}: {e})")
    return result


# -- the rank side --------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    from dgc.distributed import init_distributed, shutdown

    info = init_distributed("cpu")
    torch.set_num_threads(args.threads)
    methods = resolve_methods(args)
    try:
        if args.ddp:
            result = run_ddp_e2e(args, methods, info)
        else:
            result = run_e2e(args, methods, info) if args.e2e else run_exchange(args, methods, info)
    except BaseException:
        shutdown(clean=False)
        raise
    if info.is_main and args.worker_out:
        atomic.write_json(args.worker_out, result, allow_nan=False)
    shutdown()


def run_exchange(args: argparse.Namespace, methods: list[str], info) -> dict[str, Any]:  # noqa: ANN001
    import torch.distributed as dist

    import dgc

    model = build_shapes(args.model, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    grad_buf = torch.zeros(total)
    start = 0
    for p in params:  # every gradient is a view of one buffer, refilled with one copy
        p.grad = grad_buf[start : start + p.numel()].view_as(p)
        start += p.numel()
    syncs, specs = {}, {name: configuration(name) for name in methods}
    for name, spec in specs.items():
        sync = dgc.GradientSync.from_config(spec.sync, model, dgc.build_compressor(spec.compression))
        dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)  # gives DGC its momentum
        syncs[name] = sync
    gen = seeding.generator(args.seed, info.rank)
    fresh = torch.empty(total)
    records: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    last: dict[str, Any] = {}
    if info.is_main:
        log(f"cluster: {args.model} {total} values, {info.world_size} ranks at {args.rate}, methods {methods}")
    link = NodeLink()
    for step in range(args.warmup + args.steps):
        torch.randn(total, generator=gen, out=fresh)
        order = methods[step % len(methods) :] + methods[: step % len(methods)]
        for name in order:
            grad_buf.copy_(fresh)
            dist.barrier()
            before = link.sent()
            t0 = time.perf_counter()
            stats = syncs[name].step()
            wall = time.perf_counter() - t0
            dist.barrier()  # every rank of the machine has sent what it sends
            if step >= args.warmup:
                records[name].append(
                    {
                        "exchange_s": wall,
                        "compress_s": stats.compress_s,
                        "communicate_s": stats.communicate_s,
                        "decompress_s": stats.decompress_s,
                        "internode_bytes": float(link.sent() - before),
                    }
                )
            last[name] = stats
        if info.is_main:
            log(f"  step {step + 1}/{args.warmup + args.steps}" + (" (warm-up)" if step < args.warmup else ""))
    gathered: list[Any] = [None] * info.world_size
    mine = {"records": records, "sent": {m: last[m].sent_bytes for m in methods},
            "recv": {m: last[m].recv_bytes for m in methods}, "link": link.measures}  # fmt: skip
    dist.all_gather_object(gathered, mine)
    per_rank = [g["records"] for g in gathered]
    summary = summarize(per_rank, methods, ["exchange_s", "compress_s", "communicate_s", "decompress_s"])
    nodes = [g for g in gathered if g["link"]]  # local rank 0 of each machine read its link
    for m in methods:
        per_node = [statistics.median(r["internode_bytes"] for r in g["records"][m]) for g in nodes]
        summary[m]["internode_bytes"] = statistics.mean(per_node) if per_node else None
    base = summary.get("none", {}).get("exchange_s")
    half = summary.get("fp16", {}).get("exchange_s")
    for name in methods:
        stats = last[name]
        row = summary[name]
        row.update(
            compressor=specs[name].compression.name,
            options=non_default(specs[name].compression),
            policy=non_default(specs[name].sync.policy),
            sent_bytes=stats.sent_bytes,
            sent_bytes_max_rank=max(g["sent"][name] for g in gathered),
            dense_sent_bytes=stats.dense_sent_bytes,
            recv_bytes=stats.recv_bytes,
            recv_bytes_max_rank=max(g["recv"][name] for g in gathered),
            exchange=specs[name].sync.exchange,
            agreement=syncs[name].exchange.agreement,
            dense_bytes=stats.dense_bytes,
            wire_ratio=stats.dense_bytes / stats.sent_bytes if stats.sent_bytes else None,
            collectives=stats.collectives,
            values_sent=stats.values_sent,
            compressed_numel=stats.compressed_numel,
            speedup_vs_none=base / row["exchange_s"] if base else None,
            speedup_vs_fp16=half / row["exchange_s"] if half else None,
        )
    return {
        "mode": "exchange",
        "model": args.model,
        "numel": total,
        "tensors": len(params),
        **setup_record(args, info),
        "methods": summary,
    }


# -- end to end -----------------------------------------------------------------------------
def run_e2e(args: argparse.Namespace, methods: list[str], info) -> dict[str, Any]:  # noqa: ANN001
    import torch.distributed as dist

    from dgc.comm import Comm
    from dgc.repro.trainer import Trainer

    trainers, batches = {}, {}
    with tempfile.TemporaryDirectory(prefix="dgc-e2e-") as tmp:  # never written: the runs are not opened
        for name in methods:
            config = e2e_config(name, args.batch_size, args.seed, os.path.join(tmp, name))
            # the reference exchanges nothing: each rank steps with its own gradient
            trainers[name] = Trainer(config, info, comm=Comm.local() if name == "local" else None)
            batches[name] = trainers[name].task.train_batches(0)
    numel = sum(p.numel() for p in trainers[methods[0]].model.parameters())
    if info.is_main:
        log(f"cluster e2e: fmnist_wide {numel} parameters, batch {args.batch_size} per rank, methods {methods}")
    records: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    sent: dict[str, int] = {}
    for step in range(args.warmup + args.steps):
        order = methods[step % len(methods) :] + methods[: step % len(methods)]
        for name in order:
            dist.barrier()
            row = trainers[name].train_step(batches[name])
            sent[name] = int(row["sent_bytes"])
            if step >= args.warmup:
                records[name].append({k: float(row[k]) for k in ("step_s", "compute_s", "compress_s", "communicate_s")})
        if info.is_main:
            log(f"  step {step + 1}/{args.warmup + args.steps}" + (" (warm-up)" if step < args.warmup else ""))
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, records)
    summary = summarize(gathered, methods, ["step_s", "compute_s", "compress_s", "communicate_s"])
    local = summary.get("local", {}).get("step_s")
    for name in methods:
        row = summary[name]
        row["sent_bytes"] = sent[name] if name != "local" else 0
        row["dense_bytes"] = numel * 4
        row["step_over_local"] = row["step_s"] / local if local else None
        spec = configuration("none" if name == "local" else name)
        row["compression"] = "none (exchange skipped)" if name == "local" else spec.compression.name
        row["options"] = {} if name == "local" else non_default(spec.compression)
    return {
        "mode": "e2e",
        "task": "fmnist_wide",
        "model": "fmnist_wide (conv 1-64-128, fc 6272-2048-2048-10)",
        "numel": numel,
        "batch_size_per_rank": args.batch_size,
        **setup_record(args, info),
        "methods": summary,
    }


# -- plot -----------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> Path:
    if result["mode"].startswith("e2e-ddp"):
        from dgc.bench.ddp_e2e import plot_exposed

        return plot_exposed(result, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    methods = list(result["methods"])
    rows = [result["methods"][m] for m in methods]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(methods) + 1.6))
    y = range(len(methods))
    if result["mode"] == "e2e":
        # the bar is the median step; its parts are the medians of compute, compress and communicate, scaled
        # to fill it (medians of parts need not add up to the median of their sums)
        parts = [("compute_s", "compute"), ("compress_s", "compress"), ("communicate_s", "communicate")]
        scale = [r["step_s"] / max(sum(r[k] for k, _ in parts), 1e-12) for r in rows]
        left = [0.0] * len(methods)
        for key, label in parts:
            widths = [r[key] * f for r, f in zip(rows, scale)]
            ax.barh(list(y), widths, left=left, label=label)
            left = [a + b for a, b in zip(left, widths)]
        for i, r in enumerate(rows):
            ax.text(r["step_s"], i, f"  {r['step_s']:.2f} s ({r['step_over_local']:.2f}x)", va="center", fontsize=8)
        ax.set_xlim(0, max(r["step_s"] for r in rows) * 1.35)
        ax.set_xlabel("step time, slowest rank (s, median); parts in proportion to their medians")
        ax.set_title(
            f"{result['task']}, {result['nodes']} nodes at {result['rate']}, batch {result['batch_size_per_rank']}/rank"
        )
        ax.legend(loc="lower right", fontsize=8)
    else:
        times = [r["exchange_s"] for r in rows]
        ax.barh(list(y), times, color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlim(min(times) / 1.5, max(times) * 3)  # room for the labels
        # labelled ticks at 1, 2 and 5 of every decade, so even a span under one decade reads
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s")
        )
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for i, r in enumerate(rows):
            x = r.get("speedup_vs_none")
            speed = f", {x:.1f}x" if x and x < 10 else f", {x:.0f}x" if x else ""
            ax.text(r["exchange_s"], i, f"  {r['exchange_s'] * 1e3:.0f} ms{speed}", va="center", fontsize=8)
        ax.set_xlabel("gradient exchange per step, slowest rank (log scale)")
        size = f"{result['numel'] / 1e6:.1f}M values"
        r = result.get("ranks_per_node", 1)
        where = f"{result['machines']} machines x {r} ranks" if r > 1 else f"{result['nodes']} nodes"
        ax.set_title(f"{result['model']} ({size}), {where} at {result['rate']}")
    ax.set_yticks(list(y), methods)
    ax.invert_yaxis()
    fig.tight_layout()
    atomic.save_figure(path, fig, dpi=110)
    return path
