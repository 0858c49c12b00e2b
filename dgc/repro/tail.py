"""How runs ended, from their ``metrics.jsonl`` and ``summary.json``: the mean training loss over the last steps,
the mean of each validation metric over the last evaluations, and the final (test) metrics; one line per run.

    python -m dgc.repro.tail results/runs/cpu-speech/none-s0 results/runs/cpu-speech/dgc-w1-c400-updates-s0

A lower training loss with a higher test loss than another run's is over-fitting; the mean of the last
evaluations says more than the last one alone (one evaluation moves by a point or more between epochs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dgc.repro.rundir import read_records


def _records(run_dir: Path) -> list[dict]:
    log = run_dir / "metrics.jsonl"
    try:
        return read_records(log)
    except OSError as exc:
        raise ValueError(f"cannot read {log}: {exc.strerror or exc}") from exc


def summarize(run_dir: Path, train_steps: int = 1000, evals: int = 10) -> dict:
    """The end of one run: ``train_loss`` (mean over the logged steps after ``last step - train_steps``),
    ``<metric>@last<evals>`` for each validation metric (``dev_*``, ``val_*``: the mean over the last ``evals``
    evaluations that logged it) and the final metrics of ``summary.json`` (None where it has none yet)."""
    if train_steps < 1 or evals < 1:
        raise ValueError(f"--train-steps and --evals must be at least 1 (got {train_steps} and {evals})")
    records = _records(run_dir)
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("train_loss"), int | float)]
    if not train:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} logs no training step")
    last = max(r["step"] for r in train)
    window = [r["train_loss"] for r in train if r["step"] > last - train_steps]
    out: dict = {"run": str(run_dir), "steps": last, "train_loss": sum(window) / len(window)}
    by_metric: dict[str, list[float]] = {}
    for r in records:
        if r.get("kind") != "eval":
            continue
        for key, value in r.items():
            if key.startswith(("dev_", "val_")) and isinstance(value, int | float):
                by_metric.setdefault(key, []).append(float(value))
    for key, values in by_metric.items():
        tail = values[-evals:]
        out[f"{key}@last{len(tail)}"] = sum(tail) / len(tail)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {}
    out["final"] = summary.get("metrics")
    return out


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dgc.repro.tail", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="run directories (with metrics.jsonl)")
    parser.add_argument("--train-steps", type=int, default=1000, help="training steps averaged (default: 1000)")
    parser.add_argument("--evals", type=int, default=10, help="last evaluations averaged (default: 10)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of text")
    args = parser.parse_args(argv)
    try:
        rows = [summarize(d, args.train_steps, args.evals) for d in args.run_dirs]
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        final = row.pop("final")
        parts = [f"{k} {_fmt(v)}" for k, v in row.items() if k != "run"]
        if final:
            parts.append("final " + ", ".join(f"{k} {_fmt(v)}" for k, v in final.items()))
        else:
            parts.append("no summary.json yet")
        print(f"{row['run']}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
