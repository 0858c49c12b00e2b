"""Tables and plots from run directories, with the paper's numbers beside ours.

    python -m dgc.repro.report --table cpu-fmnist          # the runs under results/runs/cpu-fmnist/ -> results/
    python -m dgc.repro.report 'runs/fmnist_resnet20/*/*' --name mine   # any run directories (paths or globs)
    python -m dgc.repro.report runs/multirun/20261202-183532   # the runs a `python -m dgc.train -m` sweep made
    python -m dgc.repro.report --list                      # the tables and the runs each one needs

Writes ``<out>/<name>.md`` (the table with notes), ``<out>/<name>.csv`` (the same numbers, machine
readable), ``<out>/<name>-steps.png`` (the headline metric after each evaluation, per method) and
``<out>/<name>-ratio.png`` (the headline metric against the compression ratio, ours and the paper's).
``<out>`` is ``results/`` for ``--table`` with the runs under ``results/runs/`` (the shipped tables, what
``make report TABLE=...`` writes), else ``runs/reports/``. The headline metric follows the task's kind:
image -> top-1 (higher is better), language -> perplexity, speech -> WER (lower is better).

A row whose run is not done yet (no ``summary.json``) is shown as "not run" and named in one warning line
with the command that makes it; the exit status is 0 unless no row has a run at all (one line, exit 1).
A run that is unreadable or of another task than its row's is an error: nothing is written.
Run directories given as paths are labelled by what they are: the compression and the settings (from
their ``config.yaml``) that tell them apart from the other runs of the same task. A sweep's folder
(``runs/multirun/<time>``) or its ``run_dirs.txt`` stands for the run directories the sweep made. The
tables are defined in :mod:`dgc.repro.tables`; :mod:`dgc.repro.sweep` makes their runs.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from dgc import atomic
from dgc.costmodel.hardware import WORKLOADS
from dgc.repro import checkpoint, frontier_cost, plots
from dgc.repro.locate import MULTIRUN_RECORD
from dgc.repro.rows import Paper, Row
from dgc.repro.rundir import read_records
from dgc.repro.tables import HEADLINE, METRICS, TABLES, Run, Table, get_table

#: where the Makefile (and the shipped tables) keep the runs and the reports
MAKE_RUNS_ROOT, MAKE_OUT = "results/runs", "results"
#: settings that do not change what a run computes: never part of a run directory's label
NOT_IN_LABELS = (
    "run_dir", "resume", "resume_allow", "logger", "timeout_s", "data.root", "data.loader_workers",
    "sync.costmodel", "train.progress", "train.log_every", "train.checkpoint_every", "train.checkpoint_minutes",
)  # fmt: skip


class ReportError(Exception):
    """A run is missing or unreadable (one line, naming it)."""


# -- reading -------------------------------------------------------------------------------------------
def _kind(run_dir: Path, summary: dict[str, Any]) -> str:
    config = run_dir / "config.yaml"
    if config.is_file():
        kind = (yaml.safe_load(config.read_text()) or {}).get("task", {}).get("kind")
        if kind in HEADLINE:
            return kind
    metrics = summary.get("metrics", {})
    return next((k for k, m in HEADLINE.items() if m in metrics), "image")


def load_run(row: Row, run_dir: Path) -> Run:
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from exc
    log = run_dir / "metrics.jsonl"
    evals = [r for r in read_records(log) if r.get("kind") == "eval"] if log.is_file() else []
    return Run(row, run_dir, summary, _kind(run_dir, summary), evals)


def sweep_hint(table: Table, runs_root: str, out: str) -> str:
    """The command that makes a table's missing runs, keeping (and resuming) the ones it has."""
    sweep = shlex.join(
        ["python", "-m", "dgc.repro.sweep", table.name, "--skip-done", "--runs-root", runs_root, "--out", out]
    )
    if Path(runs_root) == Path(MAKE_RUNS_ROOT) and Path(out) == Path(MAKE_OUT):
        return f"`make {table.name} SWEEP_ARGS=--skip-done` (or `{sweep}`)"
    return f"`{sweep}`"


def table_runs(table: Table, runs_root: Path) -> tuple[list[Run], list[Row]]:
    """The runs of ``table`` under ``runs_root/<table>/<key>`` that are done, and the rows whose run is not
    (no ``summary.json``: shown as not run). ReportError when a run is unreadable or of another task."""
    dirs = {r.key: runs_root / table.name / r.key for r in table.rows}
    missing = [r for r in table.rows if not (dirs[r.key] / "summary.json").is_file()]
    runs = []
    for row in table.rows:
        if row in missing:
            continue
        run = load_run(row, dirs[row.key])
        if run.summary.get("task") != row.task:
            raise ReportError(
                f"{dirs[row.key]} is a run of task {run.summary.get('task')!r}, the table wants {row.task!r}"
            )
        runs.append(run)
    return runs, missing


def _listed(path: Path) -> list[Path]:
    """The run directories a sweep's record lists (one per line; ``#`` starts a comment)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None
    return [Path(line.strip()) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _expand(pattern: str) -> list[Path]:
    """The run directories one command-line argument stands for: a run directory, a glob of them, a sweep's
    record (``run_dirs.txt``) or the sweep folder holding one."""
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    out: list[Path] = []
    for match in map(Path, matches):
        record = match / MULTIRUN_RECORD
        if match.is_file() and (match.name == MULTIRUN_RECORD or not glob.has_magic(pattern)):
            out += _listed(match)
        elif match.is_dir() and record.is_file() and not (match / "summary.json").exists():
            out += _listed(record)
        elif match.is_dir():
            out.append(match)
    if not out:
        raise ReportError(f"no run directory matches {pattern!r}")
    return out


def _settings(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """What a run was made with: its config.yaml, flattened (``train.max_steps``), less what changes nothing."""
    try:
        config = checkpoint.flatten(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        config = {}
    keep = {k: v for k, v in config.items() if not any(k == n or k.startswith(f"{n}.") for n in NOT_IN_LABELS)}
    keep["world_size"] = summary.get("world_size")
    keep.pop("compression.name", None)
    return keep


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list | dict) else str(value)


def labels(runs: list[tuple[Path, dict[str, Any]]]) -> list[tuple[str, int | None]]:
    """``(label, seed)`` of each ``(run directory, summary)``: the compression, then every setting whose value
    differs between the runs of the same task (``compression.*`` ones between the runs of the same
    compression), e.g. ``dgc train.max_steps=30``. A differing ``seed`` is not in the label but returned:
    rows that differ only in it are one method, averaged over the seeds. Runs still alike are told apart
    by their directory's name."""
    settings = [_settings(d, s) for d, s in runs]
    tasks = [s.get("task") for _, s in runs]
    comps = [str(s.get("compression", "?")) for _, s in runs]
    missing = object()
    out = []
    for i in range(len(runs)):
        peers = [j for j in range(len(runs)) if tasks[j] == tasks[i]]
        shown, seed = [], None
        for key in settings[i]:
            among = [j for j in peers if comps[j] == comps[i]] if key.startswith("compression.") else peers
            if len({_shown(settings[j].get(key, missing)) for j in among}) < 2:
                continue
            if key == "seed" and isinstance(settings[i][key], int):
                seed = settings[i][key]
            else:
                shown.append(f"{key}={_shown(settings[i][key])}")
        out.append((" ".join([comps[i], *shown]), seed))
    alike = [sum(1 for j, other in enumerate(out) if tasks[j] == tasks[i] and other == mine) > 1
             for i, mine in enumerate(out)]  # fmt: skip
    return [(f"{label} ({d.name})", seed) if same else (label, seed)
            for (d, _), (label, seed), same in zip(runs, out, alike, strict=True)]  # fmt: skip


def adhoc_runs(patterns: list[str], name: str) -> tuple[Table, list[Run], list[Path]]:
    """A table of any run directories (no paper numbers): one group per task, baseline = compression none;
    and the directories left out because their run is not done (no summary.json)."""
    dirs: list[Path] = []
    for pattern in patterns:
        dirs += [d for d in _expand(pattern) if d not in dirs]
    missing = [d for d in dirs if not (d / "summary.json").is_file()]
    done = [d for d in dirs if d not in missing]
    if not done:
        shown = ", ".join(map(str, missing[:4])) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ReportError(f"no finished run: {len(missing)} run director{'y has' if len(missing) == 1 else 'ies have'} "
                          f"no summary.json (unfinished?): {shown}")  # fmt: skip
    summaries = []
    for d in done:
        try:
            summaries.append(json.loads((d / "summary.json").read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"cannot read {d / 'summary.json'}: {exc}") from exc
    runs, rows = [], []
    for d, summary, (label, seed) in zip(done, summaries, labels(list(zip(done, summaries))), strict=True):
        task, comp = summary.get("task", "?"), summary.get("compression", "?")
        row = Row(d.name, task, label, task, comp, int(summary.get("world_size", 1)), baseline=comp == "none",
                  seed=seed)  # fmt: skip
        rows.append(row)
        runs.append(load_run(row, d))
    metrics = tuple(dict.fromkeys(r.headline for r in runs))
    table = Table(
        name, f"Runs: {', '.join(patterns)}", metrics, tuple(rows), "Run directories, no paper numbers", False
    )
    return table, runs, missing


# -- the table -----------------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt_mb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else (f"{value:.0f}x" if value >= 10 else f"{value:.1f}x")


def _baselines(runs: list[Run], table: Table) -> dict[tuple[str, int | None], tuple[Row | None, Run | None]]:
    """The reference row and run of each (group, seed)."""
    out: dict[tuple[str, int | None], tuple[Row | None, Run | None]] = {}
    for row in table.rows:
        if row.baseline and (row.group, row.seed) not in out:
            run = next((r for r in runs if r.row is row), None)
            out[(row.group, row.seed)] = (row, run)
    return out


def _delta(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def rows_of(table: Table, runs: list[Run]) -> list[dict[str, Any]]:
    """One record per row (run) of the table (runs that are missing under --partial have ours empty)."""
    by_row = {id(r.row): r for r in runs}
    bases = _baselines(runs, table)
    records = []
    for row in table.rows:
        run = by_row.get(id(row))
        base_row, base_run = bases.get((row.group, row.seed), (None, None))
        paper: Paper = row.paper
        ratio, all_steps = run.ratio if run else (None, False)
        rec: dict[str, Any] = {
            "group": row.group,
            "method": row.method,
            "key": row.key,
            "seed": row.seed,
            "task": row.task,
            "compression": row.compression,
            "world_size": run.summary.get("world_size") if run else row.world_size,
            "steps": run.summary.get("steps") if run else None,
        }
        for m in table.metrics:
            ours = run.metric(m) if run else None
            rec[f"paper_{m}"] = paper.metrics.get(m)
            rec[m] = ours
            rec[f"paper_delta_{m}"] = _delta(paper.metrics.get(m), base_row.paper.metrics.get(m)) if base_row else None
            rec[f"delta_{m}"] = _delta(ours, base_run.metric(m)) if base_run else None
        rec.update(
            paper_dense_mb=paper.dense_mb,
            paper_sent_mb=paper.sent_mb,
            paper_ratio=paper.ratio,
            dense_mb=run.mb("dense_bytes_per_step") if run else None,
            sent_mb=run.mb("bytes_per_step") if run else None,
            wire_ratio=ratio,
            wire_ratio_all_steps=all_steps,
            wall_s=run.summary.get("wall_s") if run else None,
            run_dir=str(run.run_dir) if run else "",
        )
        records.append(rec)
    return records


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def methods_of(table: Table, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per method of a group: the rows that differ only in the seed, averaged over the seeds run.

    ``<metric>`` is the mean, ``<metric>_sd`` the sample standard deviation over seeds, ``delta_<metric>``
    the mean of the per-seed differences to the reference row of the same seed.
    """
    methods: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records:
        methods.setdefault((rec["group"], rec["method"]), []).append(rec)
    out = []
    for (group, method), recs in methods.items():
        done = [r for r in recs if r["steps"] is not None]
        first = recs[0]
        agg: dict[str, Any] = {
            "group": group,
            "method": method,
            "seeds": [r["seed"] for r in done],
            "runs": len(recs),
            "compression": first["compression"],
            "world_size": first["world_size"],
            "steps": done[0]["steps"] if done else None,
        }
        for m in table.metrics:
            values = [r[m] for r in done if r[m] is not None]
            deltas = [r[f"delta_{m}"] for r in done if r[f"delta_{m}"] is not None]
            agg.update({m: _mean(values), f"{m}_sd": plots.sd(values), f"delta_{m}": _mean(deltas)})
            agg[f"delta_{m}_seeds"] = deltas
            agg[f"delta_{m}_se"], agg[f"delta_{m}_ci"] = paired(deltas)
            agg[f"paper_{m}"], agg[f"paper_delta_{m}"] = first[f"paper_{m}"], first[f"paper_delta_{m}"]
        for key in ("dense_mb", "sent_mb", "wire_ratio", "wall_s"):
            agg[key] = _mean([r[key] for r in done if r[key] is not None])
        agg["wire_ratio_all_steps"] = any(r["wire_ratio_all_steps"] for r in done)
        for key in ("paper_dense_mb", "paper_sent_mb", "paper_ratio"):
            agg[key] = first[key]
        out.append(agg)
    return out


def paired(deltas: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    """The standard error of the mean of per-seed differences and its two-sided 95% interval (Student's t with
    n-1 degrees of freedom; None below two seeds)."""
    spread = plots.sd(deltas)
    if spread is None:
        return None, None
    from scipy import stats

    se = spread / len(deltas) ** 0.5
    half = float(stats.t.ppf(0.975, len(deltas) - 1)) * se
    mean = sum(deltas) / len(deltas)
    return se, (mean - half, mean + half)


def _paired_metric(table: Table) -> str:
    """The metric the paired sections compare: the first of the table's that is a headline, else its first."""
    return next((m for m in table.metrics if m in HEADLINE.values()), table.metrics[0])


def _paired_lines(table: Table, methods: list[dict[str, Any]]) -> list[str]:
    """The headline metric's per-seed differences to the reference, with their standard error and 95% interval,
    for every method with two or more paired seeds."""
    m = _paired_metric(table)
    references = {(r.group, r.method) for r in table.rows if r.baseline}
    rows = [rec for rec in methods if (rec["group"], rec["method"]) not in references
            and len(rec[f"delta_{m}_seeds"]) >= 2 and rec[f"delta_{m}_ci"] is not None]  # fmt: skip
    if not rows:
        return []
    label = METRICS.get(m, (m, True))[0]
    head = "| group | method | Δ per seed | mean Δ | standard error | 95% interval (t) |"
    lines = ["", f"Paired differences in {label} to the reference row, seed by seed:", "", head, "|---" * 6 + "|"]
    for rec in rows:
        lo, hi = rec[f"delta_{m}_ci"]
        per_seed = ", ".join(f"{s}: {d:+.2f}" for s, d in zip(rec["seeds"], rec[f"delta_{m}_seeds"], strict=False))
        lines.append(f"| {rec['group']} | {rec['method']} | {per_seed} | {rec[f'delta_{m}']:+.2f} | "
                     f"{rec[f'delta_{m}_se']:.2f} | [{lo:+.2f}, {hi:+.2f}] |")  # fmt: skip
    return lines


def beside_lines(table: Table, records: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    """The headline metric's per-seed differences to the reference row, here and in ``table.paired_with``'s table
    (``other``: its records) for the same rows and seeds, for every method with a seed done in both."""
    name, infix = table.paired_with
    m = _paired_metric(table)
    there = {r["key"]: r[f"delta_{m}"] for r in other if r[f"delta_{m}"] is not None}
    references = {(r.group, r.method) for r in table.rows if r.baseline}
    pairs: dict[str, list[tuple[int | None, float, float]]] = {}
    for rec in records:
        key = rec["key"].replace(infix, "", 1)
        if (rec["group"], rec["method"]) in references or rec[f"delta_{m}"] is None or key not in there:
            continue
        pairs.setdefault(rec["method"], []).append((rec["seed"], rec[f"delta_{m}"], there[key]))
    if not pairs:
        return []
    label = METRICS.get(m, (m, True))[0]
    lines = ["", f"Beside {name} (the same rows and seeds, its own length): the difference in {label} to the "
             "reference row, seed by seed, here / there:", "",
             "| method | seeds | Δ here / Δ there, by seed | mean Δ here | mean Δ there, the same seeds |",
             "|---|---|---|---|---|"]  # fmt: skip
    for method, rows in pairs.items():
        per_seed = ", ".join(f"{seed}: {here:+.2f} / {then:+.2f}" for seed, here, then in rows)
        lines.append(f"| {method} | {len(rows)} | {per_seed} | {_mean([r[1] for r in rows]):+.2f} | "
                     f"{_mean([r[2] for r in rows]):+.2f} |")  # fmt: skip
    return lines


def matched_bytes(table: Table, records: list[dict[str, Any]], local_steps: dict[str, int] | None = None) -> list[str]:
    """A frontier table's DGC arms (each, e.g. DGC as published and DGC feeding AdamW) against the DiLoCo arm whose
    measured bytes per step are nearest theirs (the two byte counts and their ratio are named, and how many outer
    steps the DiLoCo arm made: ``local_steps``, each method's H from its runs): the headline metric's difference seed
    by seed, over the seeds both ran."""
    m = table.metrics[0]
    methods = methods_of(table, records)
    dgcs = [r for r in methods if r["compression"] in ("dgc", "dgc_chunk") and r["sent_mb"]]
    diloco = [r for r in methods if r["compression"].startswith("diloco") and r["sent_mb"]]
    if not dgcs or not diloco:
        return []
    by_seed = {(r["method"], r["seed"]): r[m] for r in records if r[m] is not None}
    label = METRICS.get(m, (m, True))[0]
    lines = []
    for dgc in dgcs:
        near = min(diloco, key=lambda r: abs(math.log(r["sent_mb"] / dgc["sent_mb"])))
        seeds = sorted({s for (method, s) in by_seed if method == dgc["method"]}
                       & {s for (method, s) in by_seed if method == near["method"]})  # fmt: skip
        if not seeds:
            continue
        deltas = [by_seed[(dgc["method"], s)] - by_seed[(near["method"], s)] for s in seeds]
        every = (local_steps or {}).get(near["method"])
        outer = ""
        if every and near["steps"]:
            n = near["steps"] // every
            outer = f"; its {near['steps']} steps at H = {every} are {n} outer step{'s' if n != 1 else ''}"
        per_seed = ", ".join(f"seed {s}: {d:+.2f}" for s, d in zip(seeds, deltas, strict=True))
        mean = sum(deltas) / len(deltas)
        se, ci = paired(deltas)
        spread = f"; standard error {se:.2f}, 95% interval [{ci[0]:+.2f}, {ci[1]:+.2f}]" if se is not None else ""
        lines += ["", f"At matched bytes: {dgc['method']} sends {_fmt_mb(dgc['sent_mb'])} MB/step, {near['method']} "
                  f"{_fmt_mb(near['sent_mb'])} MB/step ({near['sent_mb'] / dgc['sent_mb']:.2f}x DGC's, the DiLoCo arm "
                  f"nearest it{outer}). Difference in {label}, DGC minus DiLoCo: {per_seed}; mean {mean:+.2f}"
                  f"{spread}."]  # fmt: skip
    return lines


def to_csv(records: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]), lineterminator="\n")
    writer.writeheader()
    for rec in records:
        writer.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return buf.getvalue()


def has_paper(table: Table) -> bool:
    """Whether any row has a number from the paper (else the paper columns are left out)."""
    return any(r.paper.metrics or r.paper.sent_mb or r.paper.ratio for r in table.rows)


def _fmt_spread(mean: float | None, sd: float | None) -> str:
    return _fmt(mean) if sd is None else f"{_fmt(mean)} ± {sd:.2f}"


def to_markdown(
    table: Table,
    records: list[dict[str, Any]],
    command: str,
    beside: list[dict[str, Any]] | None = None,
    local_steps: dict[str, int] | None = None,
) -> str:
    """The table's markdown; ``beside``: the records of ``table.paired_with``'s table, when it has one;
    ``local_steps``: each method's H (0: none), from its runs."""
    paper = has_paper(table)
    seeded = any(r["seed"] is not None for r in records)
    methods = methods_of(table, records)
    head = ["", "method", "N", *(["seeds"] if seeded else []), "steps"]
    for m in table.metrics:
        label, higher = METRICS.get(m, (m, True))
        head += [f"{label} paper", f"{label} ours", "Δ paper", "Δ ours"] if paper else [label, "Δ"]
    head += ["MB/step paper", "MB/step ours", "ratio paper", "ratio ours"] if paper else ["MB/step", "ratio"]
    lines = [f"# {table.title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    group = None
    for rec in methods:
        seeds = f"{len(rec['seeds'])} of {rec['runs']}" if len(rec["seeds"]) < rec["runs"] else str(rec["runs"])
        steps = str(rec["steps"] if rec["steps"] is not None else "not run")
        cells = [rec["group"] if rec["group"] != group else "", rec["method"], str(rec["world_size"] or "-")]
        cells += [seeds, steps] if seeded else [steps]
        group = rec["group"]
        for m in table.metrics:
            ours = _fmt_spread(rec[m], rec[f"{m}_sd"])
            if paper:
                cells += [_fmt(rec[f"paper_{m}"]), ours, _signed(rec[f"paper_delta_{m}"]), _signed(rec[f"delta_{m}"])]
            else:
                cells += [ours, _signed(rec[f"delta_{m}"])]
        paper_mb = (
            f"{_fmt_mb(rec['paper_dense_mb'])} → {_fmt_mb(rec['paper_sent_mb'])}" if rec["paper_sent_mb"] else "-"
        )
        ours_mb = f"{_fmt_mb(rec['dense_mb'])} → {_fmt_mb(rec['sent_mb'])}" if rec["sent_mb"] is not None else "-"
        ratio = _fmt_ratio(rec["wire_ratio"]) + ("†" if rec["wire_ratio_all_steps"] and rec["wire_ratio"] else "")
        flagged |= bool(rec["wire_ratio_all_steps"] and rec["wire_ratio"])
        cells += [paper_mb, ours_mb, _fmt_ratio(rec["paper_ratio"]), ratio] if paper else [ours_mb, ratio]
        lines.append("| " + " | ".join(cells) + " |")
    directions = ", ".join(f"{METRICS.get(m, (m, True))[0]}: {'higher' if METRICS.get(m, (m, True))[1] else 'lower'}"
                           " is better" for m in table.metrics)  # fmt: skip
    notes = [
        "",
        f"{'Paper: ' if paper else ''}{table.source}. {directions}. "
        f"Δ: difference to the group's reference row{_references(table)}"
        + (", of the same seed, averaged over the seeds" if seeded else "")
        + ".",
        "MB/step: gradient bytes one worker sends per step (MB = 2**20 bytes), dense fp32 size → compressed; ours "
        "counts what went into the collectives (headers, indices and padding included) over the steps after the "
        "compression warm-up; ratio = dense / sent.",
    ]
    if seeded:
        notes.append("Ours: the mean over the seeds ± their sample standard deviation; each run is listed below.")
    if flagged:
        notes.append("†: the run ended inside the compression warm-up; the ratio is over all its steps.")
    if any(rec["steps"] is None for rec in records):
        notes.append("not run: its run directory had no summary.json (missing or unfinished) when this was made.")
    if seeded:
        notes += _paired_lines(table, methods)
        if table.frontier:
            notes += matched_bytes(table, records, local_steps)
        if beside:
            notes += beside_lines(table, records, beside)
        notes += ["", "Each run:", "", "| method | seed | steps | " + " | ".join(table.metrics) + " | ratio | run |",
                  "|" + "---|" * (len(table.metrics) + 5)]  # fmt: skip
        for rec in records:
            values = " | ".join(_fmt(rec[m]) for m in table.metrics)
            if rec["run_dir"]:
                notes.append(f"| {rec['method']} | {rec['seed']} | {rec['steps']} | {values} | "
                             f"{_fmt_ratio(rec['wire_ratio'])} | `{rec['run_dir']}` |")  # fmt: skip
            else:
                notes.append(f"| {rec['method']} | {rec['seed']} | not run | {values} | - | {rec['key']} |")
        notes += ["", f"Made by `{command}`."]
    else:
        notes += ["", f"Made by `{command}` from:", ""]
        notes += [f"- {rec['key']}: " + (f"`{rec['run_dir']}`" if rec["run_dir"] else "not run") for rec in records]
    return "\n".join(lines + notes) + "\n"


def _references(table: Table) -> str:
    refs = [r for r in table.rows if r.baseline]
    odd = [r for r in refs if r.compression != "none"]
    if odd and len(odd) == len(refs) > 1 and len({r.method for r in odd}) == 1:
        return f" (in every group: {odd[0].method})"
    return f" (the baseline; {'; '.join(f'{r.group}: {r.method}' for r in odd)})" if odd else " (the baseline)"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


# -- entry point ---------------------------------------------------------------------------------------
def build(
    table: Table, runs: list[Run], command: str, wire: Path | None = None, beside: list[Run] | None = None
) -> dict[str, bytes]:
    """Every output file's bytes, made in memory first (so a failure leaves nothing half-written). ``wire``: the
    wire bench's JSON a frontier table prices ResNet-50's bytes from (``bench/wire.json`` beside the runs folder);
    ``beside``: the finished runs of ``table.paired_with``'s table."""
    records = rows_of(table, runs)
    other = rows_of(get_table(table.paired_with[0]), beside) if table.paired_with and beside else None
    local_steps = {r.row.method: int(r.summary.get("local_steps") or 0) for r in runs}
    files = {
        f"{table.name}.md": to_markdown(table, records, command, other, local_steps).encode(),
        f"{table.name}.csv": to_csv(records).encode(),
        f"{table.name}-steps.png": plots.plot_steps(table, runs),
        f"{table.name}-ratio.png": plots.plot_ratio(table, runs),
    }
    if table.frontier and any(run.kind == "causal_lm" for run in runs):
        files[f"{table.name}-tokens.png"] = plots.plot_tokens(table, [run for run in runs if run.kind == "causal_lm"])
    if table.frontier:
        headline = table.metrics[0]
        overrides = {r.method: r.overrides for r in table.rows}
        measured = frontier_cost.wire_bench(wire, WORKLOADS[table.workload]) if wire is not None else {}
        label, higher = METRICS.get(headline, (headline, True))
        files.update(frontier_cost.outputs(table.name, table.title, headline, label, methods_of(table, records),
                                           local_steps, command, overrides, measured, higher,
                                           WORKLOADS[table.workload], table.workers))  # fmt: skip
    return files


def list_tables() -> str:
    lines = []
    for t in TABLES.values():
        scale = "full scale (GPU cluster)" if t.full_scale else "CPU scale"
        lines.append(f"{t.name}: {t.title} [{scale}]")
        lines += [f"    {r.key}: {' '.join(r.train_overrides())} (world size {r.world_size})" for r in t.rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dgc.repro.report", description=__doc__.splitlines()[0])
    p.add_argument(
        "runs", nargs="*", help="run directories or globs, or a sweep's folder or run_dirs.txt (instead of --table)"
    )
    p.add_argument("--table", help=f"one of: {', '.join(TABLES)}")
    p.add_argument("--name", default="report", help="output name for run directories given as paths (default: report)")
    p.add_argument(
        "--runs-root", default=MAKE_RUNS_ROOT, help="where --table finds <table>/<key>/ (default: results/runs)"
    )
    p.add_argument(
        "--out",
        help="output directory (default: results/ for --table with the runs under results/runs, as make does; "
        "else runs/reports/)",
    )
    p.add_argument("--partial", action="store_true", help="accepted for old scripts: missing runs are always marked")
    p.add_argument("--list", action="store_true", help="list the tables and their runs")
    args = p.parse_args(argv)
    if not args.list and bool(args.table) == bool(args.runs):
        p.error("give either --table NAME or run directories")
    if args.out is None:
        shipped = args.table and Path(args.runs_root) == Path(MAKE_RUNS_ROOT)
        args.out = MAKE_OUT if shipped else "runs/reports"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        print(list_tables())
        return
    command = "python -m dgc.repro.report " + " ".join(argv if argv is not None else sys.argv[1:])
    warnings = []
    try:
        if args.table:
            try:
                table = get_table(args.table)
            except ValueError as exc:
                raise ReportError(str(exc)) from exc
            runs, missing = table_runs(table, Path(args.runs_root))
            hint = sweep_hint(table, args.runs_root, args.out)
            if not runs:
                raise ReportError(
                    f"table {table.name}: none of its {len(table.rows)} runs is done (no summary.json under "
                    f"{Path(args.runs_root) / table.name}); make them with {hint}"
                )
            if missing:
                warnings.append(
                    f"table {table.name}: {len(missing)} of {len(table.rows)} runs not done yet, shown as not run: "
                    f"{', '.join(r.key for r in missing)} (no summary.json under {Path(args.runs_root) / table.name}); "
                    f"make them with {hint}"
                )
        else:
            table, runs, unfinished = adhoc_runs(args.runs, args.name)
            if unfinished:
                warnings.append(
                    f"left out {len(unfinished)} run director{'y' if len(unfinished) == 1 else 'ies'} without a "
                    f"summary.json (unfinished or failed): {', '.join(map(str, unfinished))}"
                )
        wire = Path(args.runs_root).parent / "bench" / "wire.json" if args.table else None
        beside = table_runs(get_table(table.paired_with[0]), Path(args.runs_root))[0] if table.paired_with else None
        files = build(table, runs, command, wire, beside)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    out = Path(args.out)
    for name, data in files.items():
        atomic.write_bytes(out / name, data)
    print(files[f"{table.name}.md"].decode())
    print(f"wrote {', '.join(str(out / n) for n in files)}", flush=True)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


if __name__ == "__main__":
    main()
