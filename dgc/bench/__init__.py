"""Benchmarks: ``python -m dgc.bench {select,wire,ops,cluster,costmodel,gpu}``.

* ``select``: DGC's compression step on one large tensor against exact top-k and
  one plain memory pass, interleaved in one run (:mod:`dgc.bench.select`);
* ``wire``: bytes per step of every compressor on a torchvision model's
  gradient shapes, in a single process (:mod:`dgc.bench.wire`);
* ``ops``: ATen operations and host synchronizations of one gradient exchange, counted on the CPU: what
  a GPU pays per step in launches and stalls (:mod:`dgc.bench.ops`);
* ``cluster``: exchange time of every method (or real training steps, ``--e2e``) on an
  emulated cluster of network namespaces with shaped links; needs root (:mod:`dgc.bench.cluster`);
* ``costmodel``: the cost model (:mod:`dgc.costmodel`) calibrated on ``cluster`` runs and projected to
  real clusters; ``--explain`` prints what ``sync.exchange=auto`` picks (:mod:`dgc.bench.costmodel`);
* ``gpu``: the whole GPU check in one command, ``make gpu-check`` (:mod:`dgc.bench.gpu`; JSON files
  and a summary under ``--out-dir``; ``--self-test`` runs it on the CPU).

Each prints one JSON object on stdout and writes the same text, atomically, to
``runs/bench/<name>.json`` (``--out`` overrides, e.g. ``results/bench/...`` as the Makefile does;
``cluster`` also writes a plot next to it). Progress goes to stderr.
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from dgc.extras import require

require("repro", "python -m dgc.bench")

from dgc.bench import cluster, costmodel, gpu, ops, select, wire
from dgc.bench.common import BenchError, OneLineParser

COMMANDS = {"select": select, "wire": wire, "ops": ops, "cluster": cluster, "costmodel": costmodel, "gpu": gpu}


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m dgc.bench",
        description="DGC benchmarks; each writes one JSON result (see `python -m dgc.bench <command> --help`).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out and Path(args.out).is_dir():
        parser.error(f"argument --out: {args.out!r} is a folder; give a file path")
    try:
        COMMANDS[args.command].run(args)
    except BenchError as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["COMMANDS", "BenchError", "build_parser", "main"]
