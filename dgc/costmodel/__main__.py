"""``python -m dgc.costmodel``: the step-time model of real hardware (:mod:`dgc.costmodel.hardware`).

* ``--explain --profile h100-eth25 --machines 16``: every method's step, exposed communication and speed-up over
  one GPU at that size, the constants and their sources, and whether DGC pays there;
* ``--table [--out results/bench/projection.json]``: the projection of every profile over 1 to 128 machines of 8
  GPUs, as a markdown table (stdout) and JSON;
* ``--check``: the model's form against this machine's measured e2e runs (:mod:`dgc.costmodel.e2e`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dgc import atomic
from dgc.bench.common import positive_int_arg
from dgc.costmodel import hardware
from dgc.costmodel.hardware import METHODS, PROFILES, WORKLOADS

PROG = "python -m dgc.costmodel"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--explain", action="store_true", help="every method at one profile and machine count")
    mode.add_argument("--table", action="store_true", help="the projection of every profile, 1 to 128 machines")
    mode.add_argument("--check", action="store_true", help="the model against this machine's measured e2e runs")
    p.add_argument("--profile", choices=sorted(PROFILES), default="h100-ib400", help="(default: %(default)s)")
    p.add_argument("--machines", type=positive_int_arg, default=16, help="machines of 8 GPUs (default: %(default)s)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="resnet50", help="(default: %(default)s)")
    p.add_argument("--out", help="--table: also write the projection as JSON here")
    p.add_argument(
        "--e2e",
        nargs="+",
        default=["results/bench/cluster_e2e_ddp.json"],
        help="--check: e2e bench JSON files (default: %(default)s)",
    )
    p.add_argument(
        "--params",
        default="results/bench/costmodel.json",
        help="--check: the calibrated exchange model (default: %(default)s)",
    )
    return p  # fmt: skip


def explain(profile: str, machines: int, workload: str) -> str:
    p, w = PROFILES[profile], WORKLOADS[workload]
    line, rows = hardware.verdict(p, w, machines)
    n = machines * p.gpus_per_machine
    out = [f"{p.name}: {p.description}; {machines} machine(s), {n} GPUs",
           f"workload {w.name}: {w.numel:,} values, compute {w.compute_s * 1e3:.1f} ms per step ({w.compute_source})",
           "",
           f"{'method':22s} {'step ms':>9s} {'exposed ms':>11s} {'compress ms':>12s} {'network ms':>11s} "
           f"{'speed-up':>9s}"]  # fmt: skip
    for m, r in rows.items():
        out.append(f"{m:22s} {r['step_s'] * 1e3:9.2f} {r['exposed_s'] * 1e3:11.2f} {r['compress_s'] * 1e3:12.2f} "
                   f"{r['network_s'] * 1e3:11.2f} {r['speedup']:8.1f}x")  # fmt: skip
    out += ["", line, "", "constants:", f"  intra: {p.intra.gbps:g} Gbit/s per GPU, {p.intra.latency_us:g} us per hop",
            f"  inter: {p.inter.gbps:g} Gbit/s per machine, {p.inter.latency_us:g} us per hop ({p.inter.source})",
            *(f"  {note}" for note in p.notes)]  # fmt: skip
    return "\n".join(out)


def table(workload: str) -> tuple[str, dict]:
    proj = hardware.projection(WORKLOADS[workload])
    machines = proj["machines"]
    lines = [f"Speed-up over one GPU, {proj['workload']} ({proj['compute_source']})", ""]
    for name, prof in proj["profiles"].items():
        gpus = [m * prof["gpus_per_machine"] for m in machines]
        lines += [f"**{name}**: {prof['description']}", "",
                  "| method | " + " | ".join(f"{g} GPUs" for g in gpus) + " |",
                  "|---|" + "---:|" * len(gpus)]  # fmt: skip
        for method in METHODS:
            rows = prof["methods"][method]
            lines.append(f"| {method} | " + " | ".join(f"{r['speedup']:.0f}x" for r in rows) + " |")
        lines.append("")
    return "\n".join(lines), proj


def check(e2e: Sequence[str], params: str) -> tuple[str, float]:
    from dgc.costmodel.e2e import check_files

    lines, worst = [], 0.0
    for path in e2e:
        for r in check_files(path, params):
            worst = max(worst, abs(r["error"]))
            lines.append(f"{path}: {r['rate']:>9s} {r['method']:12s} measured {r['measured_s']:7.3f} s  "
                         f"predicted {r['predicted_s']:7.3f} s  ({r['error'] * 100:+.0f}%)")  # fmt: skip
    lines.append(f"largest error {worst * 100:.0f}% over {len(lines)} steps")
    return "\n".join(lines), worst


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.explain:
            print(explain(args.profile, args.machines, args.workload))
        elif args.table:
            text, proj = table(args.workload)
            print(text)
            if args.out:
                atomic.write_bytes(Path(args.out), (json.dumps(proj, indent=2) + "\n").encode())
                print(f"wrote {args.out}", file=sys.stderr)
        else:
            text, _ = check(args.e2e, args.params)
            print(text)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
