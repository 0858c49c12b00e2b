"""The plots of a table (:mod:`dgc.repro.report`): the headline metric against the step and against the
compression ratio, one panel per group, the seeds of a method averaged. The curves against the step show the
validation counterpart of the headline where every run logged it along the way (runs with
``train.test_eval=end`` read the test split only at their end), with an inset of the second half where the first
evaluations squash the curves."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from dgc.repro.rows import Row
from dgc.repro.tables import HEADLINE, METRICS, VALIDATION, Run, Table


def sd(values: list[float]) -> float | None:
    """The sample standard deviation (None below two values)."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def _groups(table: Table) -> list[str]:
    return list(dict.fromkeys(r.group for r in table.rows))


def _panels(count: int):  # noqa: ANN202 - matplotlib figure and axes
    """A row of ``count`` plot panels on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, count, figsize=(5.5 * count, 4.8), squeeze=False)


def png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    # "tight" grows the image to what is drawn: the legends under the panels and long panel titles
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def suptitle(fig: Any, title: str) -> None:
    """The table's title over the panels, wrapped to the figure's width (a long title would be cut off)."""
    width = max(40, int(fig.get_figwidth() * 11))
    fig.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=10)


def _zoom_second_half(ax: Any, curves: list[tuple[list, list, list, list, str]], higher: bool) -> None:
    """An inset with the second half of the run's curves (steps, mean, low, high, colour: the bands' bounds and
    the main line's colour) when they span under a quarter of the
    panel's range: the early evaluations set the axis and squash where the methods part. It sits where the
    curves are not: upper right for a falling (lower-is-better) metric, lower right for a rising one."""
    steps = [s for c in curves for s in c[0]]
    if not steps:
        return
    half = (min(steps) + max(steps)) / 2
    late = [v for c in curves for s, lo, hi in zip(c[0], c[2], c[3]) if s >= half for v in (lo, hi)]
    every = [v for c in curves for v in (*c[2], *c[3])]
    if len(late) < 4 or max(every) == min(every) or (max(late) - min(late)) >= 0.25 * (max(every) - min(every)):
        return
    inset = ax.inset_axes([0.42, 0.08, 0.55, 0.42] if higher else [0.42, 0.5, 0.55, 0.42])
    for xs, mean, low, high, color in curves:
        keep = [j for j, s in enumerate(xs) if s >= half]
        inset.plot([xs[j] for j in keep], [mean[j] for j in keep], marker="o", ms=2, lw=1, color=color)
        inset.fill_between([xs[j] for j in keep], [low[j] for j in keep], [high[j] for j in keep], color=color,
                           alpha=0.2, lw=0)  # fmt: skip
    inset.set_title("second half", fontsize=7, pad=2)
    inset.tick_params(labelsize=6)
    inset.grid(alpha=0.3)


def _legend(ax: Any) -> None:
    """The panel's legend under its axes, where long method names cover no curve."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)


def _by_method(runs: list[Run]) -> dict[str, list[Run]]:
    """A group's runs by method (the seeds of a method together), in table order."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.row.method, []).append(run)
    return out


def _curve(runs: list[Run], metric: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max of ``metric`` over the runs, at the evaluations every run made."""
    series = []
    for run in runs:
        points = {e["step"]: float(e[metric]) for e in run.evals if isinstance(e.get(metric), int | float)}
        if not points and run.metric(metric) is not None:
            points = {int(run.summary.get("steps", 0)): float(run.metric(metric))}  # type: ignore[arg-type]
        series.append(points)
    steps = sorted(set.intersection(*(set(p) for p in series))) if series else []
    values = [[p[s] for p in series] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def curve_metric(runs: list[Run], headline: str) -> str:
    """What the step curves of ``runs`` show: the headline's validation metric when every run logged it at more
    than one evaluation, else the headline."""
    val = VALIDATION.get(headline)
    logged = [sum(isinstance(e.get(val), int | float) for e in run.evals) for run in runs] if val else []
    return val if logged and min(logged) > 1 else headline  # type: ignore[return-value]


def _has_paper(table: Table) -> bool:
    return any(r.paper.metrics for r in table.rows)


def _paper_on_axes(table: Table) -> bool:
    """The paper's numbers share our axes only at full scale (the CPU analogs train other data)."""
    return table.full_scale


def plot_steps(table: Table, runs: list[Run]) -> bytes:
    """The headline metric at each evaluation against the step, one panel per group, one line per method (the
    mean over its seeds, the band their range); at full scale the paper's final value dashed in the same colour."""
    groups = _groups(table)
    fig, axes = _panels(len(groups))
    for ax, group in zip(axes[0], groups):
        group_runs = [r for r in runs if r.row.group == group]
        metric = curve_metric(group_runs, group_runs[0].headline) if group_runs else HEADLINE["image"]
        dashed = banded = False
        curves = []
        for method, method_runs in _by_method(group_runs).items():
            steps, mean, low, high = _curve(method_runs, metric)
            label = method if len(method_runs) == 1 else f"{method} (mean of {len(method_runs)})"
            (line,) = ax.plot(steps, mean, marker="o", ms=3, label=label)
            curves.append((steps, mean, low, high, line.get_color()))
            if len(method_runs) > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, lw=0)
                banded = True
            paper = method_runs[0].row.paper.metrics
            if _paper_on_axes(table) and metric in paper:
                ax.axhline(paper[metric], ls="--", lw=0.8, color=line.get_color())
                dashed = True
        label, higher = METRICS.get(metric, (metric, True))
        _zoom_second_half(ax, curves, higher)
        legend = f"{'higher' if higher else 'lower'} is better" + ("; band: range over seeds" if banded else "")
        legend += "; dashed: paper" if dashed else ""
        ax.set(xlabel="step", ylabel=label, title=f"{group}\n({legend})")
        ax.grid(alpha=0.3)
        if group_runs:
            _legend(ax)
    other_data = not _paper_on_axes(table) and _has_paper(table)
    caveat = " (the paper's numbers: in the table, other data)" if other_data else ""
    suptitle(fig, table.title + caveat)
    return png(fig)


def tokens_per_step(run: Run) -> float | None:
    """Tokens all workers read in one step of a causal-LM run (world size x batch x accumulate x context), from its
    ``config.yaml``; None where it is not one."""
    import yaml

    path = run.run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
        context = cfg["model"]["args"]["block_size"]
        train = cfg["train"]
        return float(run.summary["world_size"] * train["batch_size"] * train.get("accumulate", 1) * context)
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def _loss_points(run: Run, metric: str) -> tuple[list[int], list[float], list[int], list[float]]:
    """(steps, training loss) of the run's log lines and (steps, ``metric``) of its evaluations."""
    from dgc.repro.rundir import read_records

    log = run.run_dir / "metrics.jsonl"
    train = [r for r in read_records(log) if r.get("kind") == "train"] if log.is_file() else []
    points = [(int(r["step"]), float(r["train_loss"])) for r in train if isinstance(r.get("train_loss"), int | float)]
    evals = [(int(e["step"]), float(e[metric])) for e in run.evals if isinstance(e.get(metric), int | float)]
    return [a for a, _ in points], [b for _, b in points], [a for a, _ in evals], [b for _, b in evals]


def plot_tokens(table: Table, runs: list[Run]) -> bytes:
    """A language model's loss against the tokens read (left) and against the bytes one worker sent (right, log):
    per method its first seed's training loss (a thin line, the mean of each log line's steps) and every seed's
    validation loss at its evaluations (markers). Bytes at a step: the step times the run's mean bytes per step
    over all its steps (dense bytes over ``wire_ratio_all_steps``: the warm-up included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    metric = VALIDATION.get(runs[0].headline, runs[0].headline) if runs else "val_loss"
    for i, (method, method_runs) in enumerate(_by_method(runs).items()):
        color = f"C{i % 10}"
        for k, run in enumerate(method_runs):
            tokens = tokens_per_step(run)
            ratio = run.summary.get("wire_ratio_all_steps")
            dense = run.summary.get("dense_bytes_per_step")
            if tokens is None:
                continue
            per_step = dense / ratio if dense and ratio else None
            steps, train, eval_steps, values = _loss_points(run, metric)
            label = method if k == 0 else None
            if k == 0 and steps:
                by_tokens.plot([s * tokens / 1e6 for s in steps], train, lw=0.7, alpha=0.6, color=color)
                if per_step:
                    by_bytes.plot([s * per_step for s in steps], train, lw=0.7, alpha=0.6, color=color)
            by_tokens.plot([s * tokens / 1e6 for s in eval_steps], values, "o", ms=4, color=color, label=label)
            if per_step:
                by_bytes.plot([s * per_step for s in eval_steps], values, "o", ms=4, color=color)
    label = METRICS.get(metric, (metric, False))[0]
    by_tokens.set(xlabel="tokens read by all workers (millions)", ylabel=f"{label}; lines: training loss",
                  title="loss against tokens (lower is better)")  # fmt: skip
    by_bytes.set_xscale("log")
    by_bytes.set(xlabel="bytes one worker has sent (log)", ylabel=label, title="loss against bytes sent")
    for ax in (by_tokens, by_bytes):
        ax.grid(alpha=0.3, which="both")
    handles, labels = by_tokens.get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    suptitle(fig, table.title)
    return png(fig)


def paper_ratio_of(row: Row) -> float | None:
    """Where the paper's point of a row goes on the ratio axis: its ratio, 1 for a dense run, else None
    (Table 2 gives no ratio for its sparse rows: those are left out rather than drawn at 1x)."""
    return row.paper.ratio or (1.0 if row.compression == "none" else None)


def plot_ratio(table: Table, runs: list[Run]) -> bytes:
    """The headline metric against the compression ratio (log): ours filled (mean over seeds, bars: their
    standard deviation), at full scale the paper's hollow."""
    groups = _groups(table)
    fig, axes = _panels(len(groups))
    for ax, group in zip(axes[0], groups):
        group_runs = [r for r in runs if r.row.group == group]
        metric = group_runs[0].headline if group_runs else HEADLINE["image"]
        for i, (method, method_runs) in enumerate(_by_method(group_runs).items()):
            color = f"C{i % 10}"
            points = [(r.ratio[0], r.metric(metric)) for r in method_runs]
            points = [(x, y) for x, y in points if x is not None and y is not None]
            if points:
                ys = [y for _, y in points]
                ax.errorbar([sum(x for x, _ in points) / len(points)], [sum(ys) / len(ys)], yerr=sd(ys) or 0.0,
                            fmt="o", color=color, capsize=3, label=f"{method} (ours)")  # fmt: skip
            row = method_runs[0].row
            paper_ratio = paper_ratio_of(row)
            if _paper_on_axes(table) and metric in row.paper.metrics and paper_ratio is not None:
                ax.scatter([paper_ratio], [row.paper.metrics[metric]], facecolors="none", edgecolors=color,
                           label=f"{method} (paper)")  # fmt: skip
        ax.set_xscale("log")
        label, higher = METRICS.get(metric, (metric, True))
        ax.set(xlabel="compression ratio (dense / sent bytes)", ylabel=label,
               title=f"{group}\n({'higher' if higher else 'lower'} is better)")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            _legend(ax)
    suptitle(fig, table.title)
    return png(fig)
