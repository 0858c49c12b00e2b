"""``python -m dgc.bench costmodel``: calibrate the cost model (:mod:`dgc.costmodel`) on cluster bench runs and
project it, or explain the exchange ``sync.exchange=auto`` picks for one setting.

``python -m dgc.bench costmodel results/bench/cluster_4x2.json results/bench/cluster_sar_2x1.json ...`` writes the
calibrated report (``--out``, default ``runs/bench/costmodel.json``; ``make bench-cluster``:
``results/bench/costmodel.json``) and its plot (``.png`` beside it: speed-up against the number of machines of 8
GPUs at 1, 10 and 25 Gbps), prints each measured exchange next to its prediction on stderr and a summary on
stdout. ``python -m dgc.bench costmodel --explain --machines 128 --ranks-per-node 8 --rate 1gbit`` prints the
predicted exchange of every DGC exchange for one setting and the one ``sync.exchange=auto`` picks, then the
speed-up over one worker of a whole step with ``--compute-s`` of compute.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dgc import atomic
from dgc.bench.common import BenchError, positive_int_arg
from dgc.costmodel import (
    StepBytes,
    calibrate,
    choose_exchange,
    leave_one_out,
    rate_bytes,
    scaled,
    speedups,
    workloads_from,
)

PROG = "python -m dgc.bench costmodel"
#: the plot's names of the projected methods (the dense one is priced as DDP runs it: no agreement)
LABELS = {"none": "fp32 allreduce (as DDP)", "dgc": "dgc (flat)"}


def plot(report: dict[str, Any], path: Path) -> Path:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proj = report["projection"]
    fig, axes = plt.subplots(1, len(proj["speedup"]), figsize=(5.2 * len(proj["speedup"]), 4.2), sharey=True)
    r = proj["ranks_per_node"]
    workers = [m * r for m in proj["machines"]]
    for ax, (rate, curves) in zip(axes, proj["speedup"].items()):
        for method, values in curves.items():
            ax.plot(proj["machines"], values, marker="o", ms=3, label=LABELS.get(method, method))
        ax.plot(proj["machines"], workers, color="grey", ls=":", lw=1, label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel(f"machines of {r} GPUs")
        ax.set_title(f"{proj['model']} at {rate}, compute {proj['compute_s']} s/step", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over one worker")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic.write_bytes(path, buf.getvalue())
    return path


MACHINES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
RATES = ("1gbit", "10gbit", "25gbit")


def _load(paths: Sequence[str]) -> list[dict[str, Any]]:
    results = []
    for f in paths:
        try:
            results.append(json.loads(Path(f).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise BenchError(f"cannot read {f}: {e}") from None
    return results


def explain(args: argparse.Namespace) -> None:
    """Print the exchange ``sync.exchange=auto`` would pick for one setting, from a calibrated report."""
    try:
        report = json.loads(Path(args.params).read_text())
        params, w = report["params"], StepBytes(**report["projection"]["workload"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise BenchError(f"cannot read the calibrated model {args.params}: {e}; make it with "
                         f"{PROG} <cluster bench JSON files>") from None  # fmt: skip
    if args.numel:
        w = scaled(w, args.numel)
    best, times, reason = choose_exchange(params, w, args.machines, args.ranks_per_node, args.rate,
                                          args.local_gbps * 1e9 / 8)  # fmt: skip
    # the choice compares exchange times alone; a training step adds the compute (no overlap), so the ratio of
    # the speed-ups (the projection's quantity, costmodel.png) is smaller than the ratio of the exchange times
    n, compute = args.machines * args.ranks_per_node, args.compute_s
    speedup = {name: n * compute / (compute + t) for name, t in times.items()}
    shown = ", ".join(f"{name} {s:.1f}x" for name, s in speedup.items())
    versus = f" ({best} {speedup[best] / speedup['flat']:.2f}x flat's)" if best != "flat" else ""
    print(f"exchange=auto -> {best}: {reason} (exchange time alone); a whole step with {compute:g} s of compute "
          f"per step (--compute-s, no overlap): speed-up over one worker {shown}{versus}")  # fmt: skip


def _rate(text: str) -> str:
    try:
        rate_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "costmodel",
        help="calibrate the cost model on cluster bench runs and project it; --explain: what exchange=auto picks",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("runs", nargs="*", help="cluster bench JSON files (exchange mode), e.g. at 2, 4 and 8 nodes")
    p.add_argument(
        "--compute-s",
        type=float,
        default=0.2,
        help="per-worker compute per step for the projection and --explain's speed-ups (default 0.2 s)",
    )
    p.add_argument("--out", default="runs/bench/costmodel.json", help="(default: %(default)s; make: results/bench)")
    p.add_argument(
        "--ranks-per-node",
        type=positive_int_arg,
        default=8,
        help="ranks per machine (projection, --explain; default 8)",
    )
    p.add_argument(
        "--local-gbps",
        type=float,
        default=400.0,
        help="a machine's local bus, Gbit/s per direction (projection, --explain; default 400 = 50 GB/s)",
    )
    p.add_argument("--explain", action="store_true", help="print the exchange auto picks for --machines etc.")
    p.add_argument("--machines", type=positive_int_arg, default=128, help="--explain: number of machines (default 128)")
    p.add_argument("--rate", type=_rate, default="1gbit", help="--explain: network rate per machine (default 1gbit)")
    p.add_argument("--numel", type=int, default=0, help="--explain: gradient values (default: the calibration model's)")
    p.add_argument("--params", default="results/bench/costmodel.json", help="--explain: the calibrated report")
    return p  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.explain:
        explain(args)
        return None
    if not args.runs:
        raise BenchError("give the cluster bench JSON files to calibrate on (or --explain)")
    results = _load(args.runs)
    params, obs = calibrate(results)
    loo = leave_one_out(results)
    w = workloads_from(obs)
    r, local = args.ranks_per_node, args.local_gbps * 1e9 / 8
    speed = {rate: speedups(params, w, rate, args.compute_s, MACHINES, r, local) for rate in RATES}
    report = {
        "model_description": "alpha-beta ring collectives + CPU seconds per value x contention; see dgc/costmodel.py",
        "calibrated_on": [str(f) for f in args.runs],
        "params": params,
        "observations": obs,
        "max_abs_error": max(abs(o["error"]) for o in obs),
        "leave_one_out": loo,
        "leave_one_out_max_abs_error": max((abs(o["error"]) for o in loo), default=None),
        "projection": {
            "model": max(results, key=lambda x: x["nodes"])["model"],
            "workload": w.__dict__,
            "compute_s": args.compute_s,
            "ranks_per_node": r,
            "local_gbps": args.local_gbps,
            "machines": MACHINES,
            "assumptions": f"{r} ranks per machine on a {args.local_gbps:g} Gbit/s local bus, one network link per "
            "machine; no CPU contention (CPU costs as calibrated, at contention 1)",
            "speedup": speed,
            "choice": {rate: [choose_exchange(params, w, M, r, rate, local)[0] for M in MACHINES] for rate in RATES},
        },
    }
    out = Path(args.out)
    atomic.write_bytes(out, (json.dumps(report, indent=2) + "\n").encode())
    plot(report, out.with_suffix(".png"))
    for o in obs:
        print(
            f"{o['method']:20s} N={o['nodes']:<2d} R={o['ranks_per_node']} measured {o['measured'] * 1e3:8.1f} ms  "
            f"predicted {o['predicted'] * 1e3:8.1f} ms  ({o['error'] * 100:+.0f}%)",
            file=sys.stderr,
        )
    for o in loo:
        print(
            f"held out: {o['method']:20s} N={o['nodes']:<2d} measured {o['measured'] * 1e3:8.1f} ms  "
            f"predicted {o['predicted'] * 1e3:8.1f} ms  ({o['error'] * 100:+.0f}%)",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "params": params,
                "max_abs_error": report["max_abs_error"],
                "leave_one_out_max_abs_error": report["leave_one_out_max_abs_error"],
            },
            indent=2,
        )
    )
    return report
