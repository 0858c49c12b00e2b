"""The main job: dense vs DGC on Fashion-MNIST with 4 CPU workers, then a table and a plot.

    python -m dgc.repro.demo                       # what `make demo` runs (about 15 minutes on 2 cores)
    python -m dgc.repro.demo --epochs 1 --workers 2 --methods none,topk,dgc

Each method is one ``torchrun --standalone -m dgc.train task=fmnist_resnet20 ...`` run with
the same seed, data and number of steps; DGC runs at density 0.001 after a short warm-up.
Writes ``results/demo/{table.md,table.csv,demo.png}`` and keeps each run's directory
(config, metrics, summary) under ``results/demo/runs/<method>/``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from dgc import atomic
from dgc.repro import presets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dgc.repro.demo", description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,dgc", help="comma-separated compressors (default: none,dgc)")
    p.add_argument("--workers", type=int, default=4, help="torchrun processes (default: 4)")
    p.add_argument("--epochs", type=float, default=4.0, help="epochs per run (default: 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="DGC density warm-up in epochs (default: 1)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo; make demo: results/demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("extra", nargs="*", help="further dgc.train overrides, e.g. data.limit=6000")
    args = p.parse_args(argv)
    from dgc.conf import options

    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in options("compression")]
    if bad or not methods:
        p.error(f"unknown method {', '.join(bad) or '(none)'}; valid: {', '.join(options('compression'))}")
    if args.workers < 1 or args.epochs <= 0:
        p.error("--workers must be >= 1 and --epochs > 0")
    args.methods = methods
    return args


def wire_overrides(method: str) -> list[str]:
    """Methods that send values (the sparse ones) send them in 16 bits (the rounding error stays in the
    residual): in fp32 the header, indices and dense BatchNorm part of ResNet-20 would cap DGC near 235x."""
    has_values = "wire_values" in {f.name for f in fields(presets.preset(method).compression)}
    return ["compression.wire_values=fp16"] if has_values else []


def run_method(method: str, args: argparse.Namespace, run_dir: Path) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
        "-m", "dgc.train", "task=fmnist_resnet20", f"compression={method}", f"run_dir={run_dir}",
        f"seed={args.seed}", f"train.epochs={args.epochs}", f"task.compression_warmup_epochs={args.warmup}",
        "train.log_every=20", *wire_overrides(method), *args.extra,
    ]  # fmt: skip
    print(f"[demo] {method}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise SystemExit(f"error: the {method} run failed (exit {done.returncode}); see the output above")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["launch_s"] = time.perf_counter() - started
    return summary


def table(summaries: dict[str, dict]) -> tuple[str, str]:
    header = ["method", "top1", "top5", "steps", "wire_ratio", "bytes_per_step", "dense_bytes_per_step", "wall_s"]
    rows = []
    for method, s in summaries.items():
        rows.append(
            [
                method,
                f"{s['metrics']['top1']:.2f}",
                f"{s['metrics']['top5']:.2f}",
                str(s["steps"]),
                f"{s['wire_ratio']:.1f}" if s["wire_ratio"] else "-",
                f"{s['bytes_per_step']:.0f}" if s["bytes_per_step"] else "-",
                f"{s['dense_bytes_per_step']:.0f}" if s["dense_bytes_per_step"] else "-",
                f"{s['wall_s']:.0f}",
            ]
        )
    md = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
    md += "".join("| " + " | ".join(r) + " |\n" for r in rows)
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *rows])
    return md, buf.getvalue()


def plot(run_dirs: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_bytes) = plt.subplots(1, 3, figsize=(15, 4))
    for method, run_dir in run_dirs.items():
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        train = [r for r in records if r["kind"] == "train"]
        evals = [r for r in records if r["kind"] == "eval"]
        ax_loss.plot([r["step"] for r in train], [r["train_loss"] for r in train], label=method)
        ax_acc.plot([r["step"] for r in evals], [r["top1"] for r in evals], marker="o", label=method)
        ax_bytes.semilogy([r["step"] for r in train], [r["sent_bytes"] for r in train], label=method)
    ax_loss.set(xlabel="step", ylabel="training loss", title="Training loss")
    ax_acc.set(xlabel="step", ylabel="top-1 (%)", title="Test top-1 after each epoch")
    ax_bytes.set(xlabel="step", ylabel="bytes sent per worker per step", title="Gradient exchange (log)")
    for ax in (ax_loss, ax_acc, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fmnist_resnet20: dense vs compressed, same seed and steps")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic.write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    run_dirs = {m: out / "runs" / m for m in args.methods}
    summaries = {m: run_method(m, args, run_dirs[m]) for m in args.methods}
    md, csv_text = table(summaries)
    epochs = sorted({round(s["epochs"], 2) for s in summaries.values()})
    scopes = sorted({s.get("wire_ratio_over", "steps after the compression warm-up") for s in summaries.values()})
    note = (
        f"\n{args.workers} workers (torchrun, gloo, CPU), {'/'.join(f'{e:g}' for e in epochs)} epochs each, "
        f"DGC density 0.001 after a {args.warmup:g}-epoch warm-up; wire_ratio and bytes_per_step are over the "
        f"{' or '.join(scopes)}. Command: python -m dgc.repro.demo "
        + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        + "\n"
    )
    atomic.write_text(out / "table.md", md + note)
    atomic.write_text(out / "table.csv", csv_text)
    plot(run_dirs, out / "demo.png")
    print(md + note)
    print(f"wrote {out / 'table.md'}, {out / 'table.csv'}, {out / 'demo.png'}")


if __name__ == "__main__":
    main()
