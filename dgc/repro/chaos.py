"""A chaos run: one training run hit by random faults, relaunched with the same command line each time,
compared with the same run left alone.

    python -m dgc.repro.chaos                       # make chaos: 2 ranks, fmnist_resnet20 DGC, 320 steps, 12 faults
    python -m dgc.repro.chaos --faults 10 --seed 3 --out /tmp/chaos

The job is ``python -m dgc.train --nproc 2 task=fmnist_resnet20 compression=dgc ... resume=auto``, with a
checkpoint every ``--checkpoint-every`` steps. Faults (:mod:`dgc.repro.faults` and files touched between
launches), drawn at random with ``--seed``:

* ``usr1`` (Slurm's warning, on one rank), ``term`` (a preemption, on every rank): the job stops at a step
  boundary after a checkpoint and exits 75;
* ``kill``: SIGKILL of one rank: the job fails, the next launch resumes from the last checkpoint;
* ``launcher-kill``: SIGKILL of the launcher (``python -m dgc.train --nproc``) itself: its workers stop after a
  checkpoint (they die with it) and free the run's lock; ``launcher-usr1``: SIGUSR1 to the launcher alone,
  passed on to the workers: exit 75;
* ``corrupt``: after a stop, the latest checkpoint loses its end: the next launch falls back to the previous one;
* ``torn``: after a stop, the log's last line is cut short (a full disk): the next launch drops it;
* ``stale-lock``: after a stop, ``.lock`` names a live process that is not the run (PID 1) as its holder: the
  next launch takes it over;
* ``half-tmp``: after a stop, a half-written checkpoint lies under its temporary name (a kill during a save):
  removed by the next launch;
* ``unrenamed``: after a stop, the latest checkpoint lies under its temporary name and the one before is both
  latest and previous (a kill between a save's two renames): the next launch finishes the save, losing nothing;
* ``nan``, ``inf``: a non-finite gradient value on one rank at a fixed step (a bad batch): the step is
  skipped on every rank. These recur at the same steps in every launch and in the reference, so they
  are part of the run being reproduced.

Every launch uses the same command line; after the last one the run must match the reference bit for
bit: model, optimizer, every rank's compression state and RNG, and the logged losses, rates, bytes and
evaluations. Writes ``<out>/chaos.json`` (every launch: its faults, exit status, the step it resumed at,
the steps it lost) and ``<out>/chaos.md``; exits 1 when the runs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dgc import atomic
from dgc.repro import checkpoint

PROCESS_FAULTS = ("usr1", "term", "kill", "launcher-kill", "launcher-usr1")
#: faults of the launcher process, sent from here (the others are the workers' own, through DGC_FAULTS)
LAUNCHER_FAULTS = {"launcher-kill": signal.SIGKILL, "launcher-usr1": signal.SIGUSR1}
FILE_FAULTS = ("corrupt", "torn", "stale-lock", "half-tmp", "unrenamed")
DATA_FAULTS = ("nan", "inf")
#: logged fields that are the same in a reproduced run (times are not)
SAME_TRAIN = ("step", "epoch", "train_loss", "lr", "density", "sent_bytes", "wire_ratio", "skipped")
SAME_EVAL = ("step", "epoch", "loss", "top1", "top5", "wire_ratio")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dgc.repro.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=320, help="optimizer steps of the run (default: 320)")
    p.add_argument("--faults", type=int, default=12, help="faults to inject (default: 12, every kind once)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint interval in steps (default: 20)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default: 0)")
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary folder, removed at the end)")
    p.add_argument("--out", default="runs/reliability", help="report folder (default: %(default)s; make: results/)")
    p.add_argument("extra", nargs="*", help="more dgc.train overrides for both runs")
    args = p.parse_args(argv)
    if args.steps < 4 * args.checkpoint_every or args.faults < 1 or args.nproc < 2:
        p.error("--steps must be at least 4 checkpoint intervals, --faults >= 1 and --nproc >= 2")
    return args


def schedule(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The interrupting faults in launch order, and the recurring data faults (``DGC_FAULTS`` items)."""
    rng = random.Random(args.seed)
    kinds = [*PROCESS_FAULTS, *FILE_FAULTS, *DATA_FAULTS]
    drawn = kinds[: min(args.faults, len(kinds))] + [rng.choice(kinds) for _ in range(args.faults - len(kinds))]
    rng.shuffle(drawn)
    data = sorted(rng.sample(range(5, args.steps - 5), drawn.count("nan") + drawn.count("inf")))
    data_faults = [f"{k}@{s}:{rng.randrange(args.nproc)}" for k, s in zip([k for k in drawn if k in DATA_FAULTS], data)]
    launches, pending_file = [], []
    for kind in drawn:
        if kind in FILE_FAULTS:
            pending_file.append(kind)  # applied after the next stop
        elif kind in PROCESS_FAULTS:
            launches.append({"fault": kind, "files": pending_file})
            pending_file = []
    if pending_file:  # file faults need a stop before them: one more signal
        launches.append({"fault": "usr1", "files": pending_file, "extra": True})
    return launches, data_faults


def command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "dgc.train", "--nproc", str(args.nproc),
        "task=fmnist_resnet20", "compression=dgc", "device=cpu", "train.progress=false", "train.log_every=10",
        f"train.max_steps={args.steps}", f"train.checkpoint_every={args.checkpoint_every}", "data.limit=12800",
        "data.eval_limit=1000",
        "train.checkpoint_minutes=0", "compression.wire_values=fp16", "resume=auto", f"run_dir={run_dir}",
        *args.extra,
    ]  # fmt: skip


def launch(cmd: list[str], faults: list[str], log: Path, launcher: tuple[str, int, Path] | None = None) -> int:
    """Run the job once with ``faults`` (``DGC_FAULTS``); ``launcher``: ``(kind, step, run_dir)`` of a signal to
    the launcher once the run's log reaches ``step``. Returns the launcher's exit status once its workers are
    gone too."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["DGC_FAULTS"] = ",".join(faults)
    env.setdefault("OMP_NUM_THREADS", "1")
    # what a killed launcher cannot remove (its temporary folder) goes with the work folder
    env["TMPDIR"] = str(log.parent)
    with open(log, "a") as f:
        f.write(f"\n$ DGC_FAULTS={env['DGC_FAULTS']} {' '.join(cmd)}\n")
        f.flush()
        job = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            if launcher is not None:
                _signal_at(job, LAUNCHER_FAULTS[launcher[0]], launcher[1], launcher[2])
            return job.wait()
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()


def _signal_at(job: subprocess.Popen, signum: int, step: int, run_dir: Path) -> None:
    """Send ``signum`` to the launcher once ``run_dir``'s log has a step >= ``step``; after a SIGKILL, wait for
    its workers (they stop after a checkpoint, having lost their launcher) before the next launch."""
    log = run_dir / "metrics.jsonl"
    while job.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(line).get("step", 0) >= step for line in lines[-3:] if line.endswith("}")):
            break
        time.sleep(0.2)
    else:
        return
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    job.send_signal(signum)
    job.wait()
    deadline = time.monotonic() + 120
    while any(_running(int(pid)) for pid in workers):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: the workers {workers} outlived their launcher by 2 minutes")
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def checkpoint_step(run_dir: Path) -> int:
    """The step of the checkpoint a launch resumes from (the newest usable one)."""
    _, state, _ = checkpoint.choose(run_dir) if run_dir.is_dir() else (None, None, [])
    return int(state["counters"]["step"]) if state else 0


def apply_file_fault(kind: str, run_dir: Path) -> None:
    latest, previous = run_dir / checkpoint.LATEST, run_dir / checkpoint.PREVIOUS
    if kind == "corrupt":
        latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    elif kind == "torn":
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"kind": "train", "step": 99999, "lo')
    elif kind == "stale-lock":
        (run_dir / ".lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": "chaos"}))
    elif kind == "half-tmp":
        data = latest.read_bytes()
        (run_dir / f".{checkpoint.LATEST}.chaos-half.tmp").write_bytes(data[: len(data) // 2])
    elif kind == "unrenamed" and previous.exists():
        os.replace(latest, run_dir / f".{checkpoint.LATEST}.chaos-unrenamed.tmp")
        shutil.copyfile(previous, latest)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def compare(ref: Path, run: Path) -> dict[str, bool]:
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (ref, run))

    def records(d: Path, kind: str, keys: tuple[str, ...]) -> list[list]:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line]
        return [[r.get(k) for k in keys] for r in rows if r["kind"] == kind]

    return {
        "model": same(a["model"], b["model"]),
        "optimizer": same(a["optimizer"], b["optimizer"]),
        "compression_state_and_rng_of_every_rank": same(a["ranks"], b["ranks"]),
        "counters": same(a["counters"]["step"], b["counters"]["step"]),
        "train_log": records(ref, "train", SAME_TRAIN) == records(run, "train", SAME_TRAIN),
        "eval_log": records(ref, "eval", SAME_EVAL) == records(run, "eval", SAME_EVAL),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.work:
        chaos(args, Path(args.work), argv)
        return
    with tempfile.TemporaryDirectory(prefix="dgc-chaos-") as tmp:
        try:
            chaos(args, Path(tmp), argv)
        except BaseException:  # the runs go with the folder; their log is kept beside the report
            if (Path(tmp) / "chaos.log").exists():
                Path(args.out).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(tmp) / "chaos.log", Path(args.out) / "chaos.log")
                print(f"[chaos] the launches' output: {Path(args.out) / 'chaos.log'}", file=sys.stderr)
            raise


def chaos(args: argparse.Namespace, work: Path, argv: list[str] | None) -> None:
    """The reference run and the faulted run in ``work``; the report in ``args.out``."""
    launches, data_faults = schedule(args)
    work.mkdir(parents=True, exist_ok=True)
    ref_dir, run_dir, log = work / "reference", work / "chaos", work / "chaos.log"
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    rng = random.Random(args.seed + 1)
    print(f"[chaos] reference run ({args.steps} steps, data faults {data_faults or 'none'}) in {ref_dir}", flush=True)
    started = time.monotonic()
    if launch(command(args, ref_dir), data_faults, log) != 0:
        raise SystemExit("error: the reference run failed; see the launches' output")
    reference_s = time.monotonic() - started
    report: list[dict[str, Any]] = []
    for i, plan in enumerate([*launches, {"fault": None, "files": []}]):
        at = checkpoint_step(run_dir)
        if plan["fault"] is None:
            faults = []
        else:
            # somewhere ahead of the checkpoint, and never in the last interval (the run would end first)
            step = rng.randrange(at + 2, max(at + 3, args.steps - args.checkpoint_every))
            rank = f":{rng.randrange(args.nproc)}" if plan["fault"] in ("usr1", "kill") else ""
            faults = [f"{plan['fault']}@{step}{rank}"]
        outside = (plan["fault"], step, run_dir) if plan["fault"] in LAUNCHER_FAULTS else None
        worker_faults = [] if outside else faults
        mark = log.stat().st_size
        status = launch(command(args, run_dir), [*data_faults, *worker_faults], log, launcher=outside)
        # where the launch really resumed, as it said (its own start-up may have finished a save: recover())
        said = re.findall(r"resuming \S+ at step (\d+)", log.read_bytes()[mark:].decode(errors="replace"))
        resumed = int(said[0]) if said else 0
        if report:  # the steps the previous launch did that this one did again
            report[-1]["steps_lost"] = report[-1]["steps_done"] - resumed
        entry = {"launch": i + 1, "faults": faults, "resumed_at": resumed, "exit": status,
                 "checkpoint_after": checkpoint_step(run_dir), "file_faults_after": plan["files"]}  # fmt: skip
        if status == 0:
            report.append(entry)
            break
        for kind in plan["files"]:
            apply_file_fault(kind, run_dir)
        # the steps done before the fault that the next launch has to redo: a killed rank dies after its
        # step; a signal stops every rank one step later; a corrupt checkpoint sends it back one more
        kind, step = plan["fault"], int(faults[0].split("@")[1].split(":")[0])
        # a signal to the launcher lands when the log shows the step, and the workers stop after a checkpoint
        entry["steps_done"] = entry["checkpoint_after"] if outside else step if kind == "kill" else step + 1
        report.append(entry)
        after = entry["checkpoint_after"]
        print(f"[chaos] launch {i + 1}: {faults or 'no fault'} -> exit {status}, checkpoint at {after}, "
              f"then {plan['files'] or 'no file fault'}", flush=True)  # fmt: skip
    else:
        raise SystemExit("error: the chaos run did not finish")
    result = compare(ref_dir, run_dir)
    summary = {
        "command": " ".join(command(args, Path("<run_dir>"))),
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "ranks": args.nproc,
        "seed": args.seed,
        "data_faults_every_launch": data_faults,
        "launches": report,
        "faults_injected": sum(len(e["faults"]) + len(e["file_faults_after"]) for e in report) + len(data_faults),
        "max_steps_lost": max((e.get("steps_lost", 0) for e in report), default=0),
        "identical_to_reference": result,
        "reference_wall_s": reference_s,
        "total_wall_s": time.monotonic() - started,
    }
    out = Path(args.out)
    atomic.write_json(out / "chaos.json", summary)
    atomic.write_text(out / "chaos.md", to_markdown(summary, argv if argv is not None else sys.argv[1:]))
    print((out / "chaos.md").read_text())
    if not all(result.values()):
        raise SystemExit(f"error: the chaos run differs from the reference: {result}")


def to_markdown(s: dict[str, Any], argv: list[str]) -> str:
    lines = [
        f"# Chaos run: {s['ranks']} ranks, {s['steps']} steps, a checkpoint every {s['checkpoint_every']}",
        "",
        f"Data faults in every launch and in the reference (a skipped step each): {', '.join(s['data_faults_every_launch']) or 'none'}.",  # noqa: E501
        "",
        "| launch | fault (kind@step:rank) | resumed at | exit | steps done | checkpoint after | then | steps lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in s["launches"]:
        lines.append(
            f"| {e['launch']} | {', '.join(e['faults']) or '-'} | {e['resumed_at']} | {e['exit']} | "
            f"{e.get('steps_done', '-')} | {e['checkpoint_after']} | {', '.join(e['file_faults_after']) or '-'} | "
            f"{e.get('steps_lost', '-')} |"
        )
    verdict = ", ".join(f"{k}: {'identical' if v else 'DIFFERENT'}" for k, v in s["identical_to_reference"].items())
    lines += [
        "",
        f"{s['faults_injected']} faults; at most {s['max_steps_lost']} steps lost to one fault. "
        "Exit 75: stopped on a signal after a checkpoint; 1: a rank was killed; -9: the launcher was killed (its "
        "workers stopped after a checkpoint). Steps lost: done before the fault "
        "and done again by the next launch, which resumes from the newest usable checkpoint (after a corrupt "
        "latest one: the previous; after an unrenamed save: that one, finished at its start).",
        "",
        f"Against the uninterrupted reference: {verdict}.",
        "",
        f"Made by `python -m dgc.repro.chaos {' '.join(argv)}` in {s['total_wall_s'] / 60:.1f} min "
        f"(the reference alone: {s['reference_wall_s'] / 60:.1f} min).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
