"""Make the runs of one table (see :mod:`dgc.repro.tables`), then its report.

    python -m dgc.repro.sweep cpu-fmnist                          # here: one torchrun after another, then the report
    python -m dgc.repro.sweep table2-cifar --launcher slurm data.root=/data/cifar10   # one sbatch job per run
    python -m dgc.repro.sweep cpu-kjv --dry-run                   # print the commands only
    python -m dgc.repro.sweep cpu-fmnist --only dgc train.max_steps=20 --runs-root /tmp/runs --out /tmp/results

Each run is ``python -m dgc.train <row overrides> <extra overrides> run_dir=<runs-root>/<table>/<key>``;
extra overrides (after the table name) apply to every run and win over the row's;
``--data-root cifar10=/data/cifar10`` sets ``data.root`` of the runs whose task starts with
``cifar10`` (tables that mix data sets need one per data set). A run directory
left by an earlier sweep is removed first; ``--skip-done`` keeps the finished ones instead and continues
an unfinished one that left a checkpoint (``resume=auto``), so a stopped sweep picks up where it was.

``--launcher local`` (default here) runs ``torchrun --standalone --nproc_per_node=<world size>``
sequentially on this machine (``OMP_NUM_THREADS`` = CPUs / ranks unless set) and stops at the first
failure; then ``python -m dgc.repro.report --table <table>`` writes ``<out>/<table>.{md,csv}`` and plots.

``--launcher slurm`` submits each run with ``launch/slurm/train_1node.sbatch`` (world size <=
``--gpus-per-node``) or ``train_multinode.sbatch`` (``ceil(world size / gpus-per-node)`` nodes), run
directory fixed per job, and then a report job that waits for all of them
(``--dependency=afterok``); each job's log is ``runs/slurm/<job name>-<job id>.out``. ``--cpu`` submits
them without GPUs (gloo); ``--sbatch=ARG`` passes options such as ``--sbatch=--partition=gpu
--sbatch=--time=48:00:00`` on. Submit from the repository root.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from dgc.repro.rows import Row
from dgc.repro.tables import TABLES, Table, get_table

SLURM_DIR = Path("launch/slurm")
#: where the Slurm job logs go (``<job name>-<job id>.out``), relative to the submit directory, as the sbatch
#: scripts' own default; created before submitting (Slurm does not create it, and a job whose log cannot be
#: opened fails at start)
SLURM_LOGS = Path("runs/slurm")
#: the files a run directory holds a checkpoint in (dgc.repro.checkpoint keeps the last two)
CHECKPOINTS = ("checkpoint.pt", "checkpoint.prev.pt")


def _run_dir(args: argparse.Namespace, table: Table, row: Row) -> Path:
    return Path(args.runs_root) / table.name / row.key


def _prepare(run_dir: Path, skip_done: bool, dry_run: bool) -> str:
    """What to do with a row's run directory: ``"done"`` (finished, kept with ``skip_done``), ``"resume"``
    (unfinished with a checkpoint, continued with ``skip_done``) or ``"fresh"`` (anything left removed)."""
    if skip_done and (run_dir / "summary.json").is_file():
        return "done"
    if skip_done and any((run_dir / name).is_file() for name in CHECKPOINTS):
        return "resume"
    if run_dir.exists() and not dry_run:
        shutil.rmtree(run_dir)
    return "fresh"


def train_overrides(row: Row, extra: list[str], run_dir: Path) -> list[str]:
    """The dgc.train arguments of one run: the row's, the sweep's extra ones (which win), the run directory;
    each key once (the last value given)."""
    last = {o.split("=", 1)[0]: o for o in [*row.train_overrides(), "train.progress=false", *extra]}
    last.pop("run_dir", None)
    return [*last.values(), f"run_dir={run_dir}"]


def local_command(row: Row, world_size: int, extra: list[str], run_dir: Path) -> list[str]:
    """One run on this machine through dgc.train's own launcher (``--nproc``: a mistake is one line, not torchrun's
    report, and the workers die with it)."""
    return [sys.executable, "-m", "dgc.train", "--nproc", str(world_size), *train_overrides(row, extra, run_dir)]


def slurm_command(
    table: Table, row: Row, world_size: int, extra: list[str], run_dir: Path, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """The sbatch command line of one run and the environment it needs (NPROC: ranks per node)."""
    per_node = args.gpus_per_node
    nodes = max(1, math.ceil(world_size / per_node))
    if world_size % nodes:
        raise ValueError(f"{table.name}/{row.key}: world size {world_size} does not split over {nodes} nodes")
    script = SLURM_DIR / ("train_1node.sbatch" if nodes == 1 else "train_multinode.sbatch")
    options = [
        "--parsable",
        f"--job-name=dgc-{table.name}-{row.key}",
        f"--nodes={nodes}",
        f"--gpus-per-node={0 if args.cpu else world_size // nodes}",
        f"--output={SLURM_LOGS}/%x-%j.out",
        *args.sbatch,
    ]
    overrides = train_overrides(row, extra, run_dir)
    return ["sbatch", *options, str(script), *overrides], {"NPROC": str(world_size // nodes)}


def extra_overrides(row: Row, args: argparse.Namespace) -> list[str]:
    """``data.root`` from the first ``--data-root PREFIX=PATH`` whose prefix starts the row's task, then the
    overrides given on the command line."""
    roots = [f"data.root={path}" for prefix, path in args.data_root if row.task.startswith(prefix)]
    return [*roots[:1], *args.overrides]


def _to_run(table: Table, rows: list[Row], args: argparse.Namespace) -> Iterator[tuple[Row, int, Path, list[str]]]:
    """``(row, world size, run directory, extra overrides)`` of each row to run now: finished ones are kept
    and unfinished ones resumed with --skip-done."""
    for row in rows:
        run_dir = _run_dir(args, table, row)
        what = _prepare(run_dir, args.skip_done, args.dry_run)
        if what == "done":
            print(f"[sweep] {table.name}/{row.key}: done, kept ({run_dir})", file=sys.stderr)
            continue
        extra = extra_overrides(row, args)
        if what == "resume":
            print(f"[sweep] {table.name}/{row.key}: unfinished, resuming from its checkpoint", file=sys.stderr)
            extra = [*extra, "resume=auto"]
        yield row, args.world_size or row.world_size, run_dir, extra


def run_local(table: Table, rows: list[Row], args: argparse.Namespace) -> None:
    for row, world_size, run_dir, extra in _to_run(table, rows, args):
        cmd = local_command(row, world_size, extra, run_dir)
        print(f"[sweep] {table.name}/{row.key}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        if args.dry_run:
            continue
        threads = str(max(1, (os.cpu_count() or 1) // world_size))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            raise SystemExit(f"error: run {table.name}/{row.key} failed (exit {done.returncode}); see above")


def submit_slurm(table: Table, rows: list[Row], args: argparse.Namespace) -> list[str]:
    jobs = []
    for row, world_size, run_dir, extra in _to_run(table, rows, args):
        cmd, env = slurm_command(table, row, world_size, extra, run_dir, args)
        print(f"[sweep] {table.name}/{row.key}: NPROC={env['NPROC']} {shlex.join(cmd)}", file=sys.stderr, flush=True)
        if args.dry_run:
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        SLURM_LOGS.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: sbatch failed for {table.name}/{row.key}: {done.stderr.strip()}")
        jobs.append(done.stdout.strip().split(";")[0])
        print(f"[sweep] submitted job {jobs[-1]}", file=sys.stderr)
    return jobs


def report_args(table: Table, args: argparse.Namespace) -> list[str]:
    return ["--table", table.name, "--runs-root", args.runs_root, "--out", args.out]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dgc.repro.sweep",
        description=__doc__.splitlines()[0],
        epilog=f"tables: {', '.join(TABLES)} (python -m dgc.repro.report --list shows their runs)",
    )
    p.add_argument("table", help="the table to make")
    p.add_argument("overrides", nargs="*", help="dgc.train overrides for every run, e.g. data.root=/data/cifar10")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="PREFIX=PATH",
        help="data.root=PATH for the runs whose task starts with PREFIX (repeatable), e.g. cifar10=/data/cifar10",
    )
    p.add_argument("--only", default="", help="comma-separated row keys (default: all rows)")
    p.add_argument(
        "--runs-root",
        default="runs/tables",
        help="run directories: <runs-root>/<table>/<key> (default: runs/tables; make: results/runs)",
    )
    p.add_argument("--out", default="runs/reports", help="where the report goes (default: runs/reports; make: results)")
    p.add_argument("--world-size", type=int, default=0, help="ranks of every run (default: the table's)")
    p.add_argument("--gpus-per-node", type=int, default=4, help="slurm: GPUs (ranks) per node (default: 4)")
    p.add_argument("--cpu", action="store_true", help="slurm: submit without GPUs (CPU ranks, gloo)")
    p.add_argument("--sbatch", action="append", default=[], help="slurm: one more sbatch option (repeatable)")
    p.add_argument(
        "--skip-done",
        action="store_true",
        help="keep finished runs (summary.json) and resume unfinished ones from their checkpoint instead of redoing",
    )
    p.add_argument("--no-report", action="store_true", help="make the runs only")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_intermixed_args(argv)
    try:
        args.table = get_table(args.table)
    except ValueError as exc:
        p.error(str(exc))
    keys = [r.key for r in args.table.rows]
    args.only = [k for k in args.only.split(",") if k]
    bad = [k for k in args.only if k not in keys]
    if bad:
        p.error(f"unknown row {', '.join(bad)} of {args.table.name}; valid: {', '.join(keys)}")
    if args.world_size < 0 or args.gpus_per_node < 1:
        p.error("--world-size must be >= 0 and --gpus-per-node >= 1")
    bad = [d for d in args.data_root if "=" not in d]
    if bad:
        p.error(f"--data-root wants PREFIX=PATH, got {' '.join(bad)}")
    args.data_root = [tuple(d.split("=", 1)) for d in args.data_root]
    bad = [o for o in args.overrides if "=" not in o or o.startswith("-")]
    if bad:
        p.error(f"not a dgc.train override (key=value): {' '.join(bad)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table: Table = args.table
    rows = [r for r in table.rows if not args.only or r.key in args.only]
    if args.launcher == "slurm" and not args.dry_run and shutil.which("sbatch") is None:
        raise SystemExit(
            f"error: --launcher slurm submits with sbatch, which is not on PATH here: run this on a Slurm login node; "
            f"or run the rows one after another on this machine (make {table.name} LAUNCHER=local, or --launcher "
            "local); --dry-run prints the sbatch commands"
        )
    if args.launcher == "local":
        run_local(table, rows, args)
        if args.no_report or args.dry_run:
            return
        from dgc.repro.report import main as report

        report([*report_args(table, args), *(["--partial"] if args.only else [])])
        return
    jobs = submit_slurm(table, rows, args)
    if args.no_report or (not jobs and not args.dry_run):
        return
    cmd, report_cmd = report_job(table, args, jobs or ["<the runs' job ids>"])
    if args.dry_run:
        print(f"[sweep] report job: {shlex.join(cmd)}", file=sys.stderr)
        return
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: submitting the report job failed: {done.stderr.strip()}")
    print(f"[sweep] report job {done.stdout.strip()} runs `{report_cmd}` once jobs {', '.join(jobs)} have ended "
          "(the report marks the rows that did not finish)")  # fmt: skip


def report_job(table: Table, args: argparse.Namespace, jobs: list[str]) -> tuple[list[str], str]:
    """The sbatch command of the report job and the report command it wraps: after every run's job has ended,
    whatever its outcome (``afterany``: a failed run must not leave the report pending forever), with the runs'
    ``--sbatch`` options (partition, account, ...)."""
    report_cmd = shlex.join([sys.executable, "-m", "dgc.repro.report", *report_args(table, args), "--partial"])
    cmd = [
        "sbatch", "--parsable", f"--job-name=dgc-report-{table.name}", f"--dependency=afterany:{':'.join(jobs)}",
        "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--time=30", f"--output={SLURM_LOGS}/%x-%j.out",
        *args.sbatch, f"--wrap={report_cmd}",
    ]  # fmt: skip
    return cmd, report_cmd


if __name__ == "__main__":
    main()
