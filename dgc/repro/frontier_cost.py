"""The frontier's arms on real links: accuracy against bytes, and each method's step time at 1 to 25 Gb/s.

Two outputs of ``python -m dgc.repro.report --table cpu-frontier`` (besides the table's own), made from the same
run directories:

* ``<table>-bytes.png``: the headline metric against the bytes one worker sends per step (log scale), one point per
  arm (the mean over its seeds, bars: their spread), and the frontier: the arms no other arm beats on both (as few
  or fewer bytes and as high or higher accuracy), joined by a step line;
* ``<table>-projection.md``: each arm's step time projected for ResNet-50 on H100s (:data:`hardware.RESNET50`: 51.8
  ms of compute per step, assumed from published throughput), one GPU per worker, :data:`WORKERS` workers, on a
  network of :data:`LINKS_GBPS` per worker with :data:`LATENCIES_MS` per message (a LAN and a link between
  regions; the constants are the grid's, nothing is fitted here). The same numbers go into the plot's second panel.

How an arm is priced (:func:`arm_cost`, :func:`step_s`):

* bytes of one exchange: ResNet-50's own, measured by ``python -m dgc.bench wire --model resnet50``
  (``results/bench/wire.json``, beside the runs folder ``results/runs``: each preset's message on ResNet-50's
  gradient, indices and headers included, at the preset's final density: no warm-up) for the bench
  configuration that is the arm's compression settings (its preset and its ``compression.*`` / ``sync.*``
  overrides). An arm the bench has no configuration for, or without the file: ResNet-50's fp32 gradient
  divided by the wire ratio measured on the frontier's runs (ResNet-20, warm-up included), marked in the
  table. An arm with local steps (DiLoCo, SparseLoCo: ``local_steps`` H in the run's summary) sends one
  exchange every H steps;
* collectives per exchange: :data:`COLLECTIVES`, what the library issues per exchange, in order (a test checks
  their number against :class:`dgc.GradientSync`'s own count): DGC's message lengths, its message and the values
  it sends dense (BatchNorm, biases: ``dense_rest`` of the workload, in an allreduce of their own); the payload is
  the arm's bytes less those (split evenly where two collectives carry it: PowerSGD's P and Q). The
  dense fp32 and bf16 arms are priced as users run them, with DDP's buckets overlapped with the backward pass
  (:func:`dgc.costmodel.hardware.step_s`); every other arm exchanges after the backward pass, as the trainer
  does: nothing is hidden (PyTorch's PowerSGD hook would overlap; ours does not);
* a ring allreduce of S bytes (dense, bf16, PowerSGD, DiLoCo, the values sent dense) costs ``2 (N-1)`` message
  latencies and puts ``2 (N-1)/N S`` on each worker's link; an allgather (DGC, DeMo, SparseLoCo) ``N-1`` latencies
  and receives ``(N-1) S`` (:func:`dgc.costmodel.hardware.allreduce_s`, ``allgather_s``);
* the agreement (:mod:`dgc.sync`): every exchange through :class:`dgc.GradientSync` starts with one allreduce of
  :data:`AGREEMENT_BYTES` flag bytes (a non-finite gradient on any worker, stop and checkpoint requests), priced
  like any allreduce: all latency. An arm that exchanges every step pays it every step; an arm of local steps once
  per exchange (its inner steps send nothing, :meth:`dgc.LocalSteps.before_step`); the DDP arms none (DDP as users
  run it agrees on nothing);
* left out, alike for every arm: the compressors' own GPU work (DGC's is under 1 ms per step on an H100 by
  :mod:`dgc.costmodel.hardware`; DeMo's DCT is not measured on a GPU here).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dgc.costmodel import hardware
from dgc.costmodel.hardware import Link, Profile, Workload
from dgc.sync.agreement import AGREEMENT_BYTES

#: the links of the projection: Gbit/s per worker and direction, and the latency of one message (ms)
LINKS_GBPS = (1.0, 10.0, 25.0)
LATENCIES_MS = (0.1, 30.0)
#: workers in the projection: the frontier's own
WORKERS = 4
#: the collectives of one exchange of each compression preset, in order (the compressors' ``steps``; their number
#: is dgc.GradientSync's count, tests/test_frontier_cost.py): "allreduce" / "allgather" carry the payload, "lengths"
#: is AllgatherBytes' allgather of the message lengths (8 bytes each), "rest" the allreduce of the values sent dense
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "none": ("allreduce",), "bf16": ("allreduce",), "diloco": ("allreduce",), "diloco_bf16": ("allreduce",),
    "powersgd": ("allreduce", "allreduce", "rest"), "dgc": ("lengths", "allgather", "rest"),
    "dgc_chunk": ("allgather", "rest"), "demo": ("allgather",), "sparseloco": ("allgather", "rest"),
}  # fmt: skip

#: wire-bench configurations the frontier table does not run, priced by the bench-only projection beside its arms
#: (no accuracy): what DGC's step would be in one collective, every tensor (biases, BatchNorm too) in its chunk
#: selection's fixed-size message: no lengths message, no allreduce of the values left dense
WHAT_IF: dict[str, str] = {
    "dgc_chunk_one": "DGC, chunk selection, every tensor in one message (not run)",
    # the values left dense inside the compressor's message (sync.pack=dense), and the agreement too (sync.pack=all):
    # the arms' own arithmetic, so their accuracy (tests/test_packing.py), one and two collectives fewer
    "dgc_packed": "DGC, dense values in its message (DGC's arithmetic)",
    "dgc_chunk_packed": "DGC chunk selection, dense values in its message (its arithmetic)",
    "dgc_chunk_packed_all": "DGC chunk selection, dense values and agreement in its message (its arithmetic)",
    "demo_packed_all": "DeMo, agreement in its message (its arithmetic)",
}


class FrontierCostError(ValueError):
    """An arm the projection cannot price (one line, naming what is valid)."""


def link_profile(gbps: float, latency_ms: float) -> Profile:
    """One GPU per worker, each on its own network link of ``gbps`` with ``latency_ms`` per message."""
    link = Link(gbps, latency_ms * 1e3, f"{gbps:g} Gb/s, {latency_ms:g} ms per message: the projection's grid")
    return Profile(f"{gbps:g}gbps-{latency_ms:g}ms", f"{gbps:g} Gb/s, {latency_ms:g} ms", 1, link, link,
                   base_latency_us=0.0)  # fmt: skip


@dataclass(frozen=True)
class ArmCost:
    method: str
    compression: str
    #: steps per exchange (1: every step's gradient; H: local steps)
    every: int
    #: the wire ratio measured on the frontier (dense fp32 bytes / bytes sent, per step)
    wire_ratio: float
    #: bytes one worker puts into an exchange, priced on the workload's gradient
    nbytes: float
    #: its collectives per exchange (:data:`COLLECTIVES`) and the bytes of its values sent dense (in ``nbytes``)
    collectives: tuple[str, ...]
    rest_bytes: float
    #: "ddp" (DDP's overlapped buckets) or "serial" (after the backward pass)
    kind: str
    #: where ``nbytes`` comes from: the wire bench's configuration of that name on ResNet-50, or "" (the ratio)
    bench: str = ""

    #: the agreement rides in the compressor's message (``sync.pack=all``): no allreduce of its own
    agreement_in_message: bool = False

    @property
    def agreements(self) -> float:
        """The agreement's allreduces per step: one per exchange, none for DDP or where it rides in the message."""
        return 0.0 if self.kind == "ddp" or self.agreement_in_message else 1.0 / self.every


def collectives_of(compression: str, overrides: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The collectives of one exchange of preset ``compression`` with ``overrides``: :data:`COLLECTIVES`, less the
    allreduce of the values left dense where the policy compresses every tensor of a model without 0-d parameters
    (``sync.policy.min_ndim=1`` or 0: biases and BatchNorm too, as ResNet-50's) or where they travel in the
    compressor's message (``sync.pack=dense`` or ``all``: their bytes go with its payload)."""
    return _collectives(compression, _sync_of(compression, overrides))


def _sync_of(compression: str, overrides: tuple[str, ...]) -> Any:
    """The ``sync`` settings of preset ``compression`` with the ``sync.*`` of ``overrides``."""
    from dgc.repro import presets

    if compression not in COLLECTIVES:
        raise FrontierCostError(f"no price for compression {compression!r}: valid: {', '.join(COLLECTIVES)}")
    return presets.preset(compression, [o for o in overrides if o.startswith("sync.")]).sync


def _collectives(compression: str, sync: Any) -> tuple[str, ...]:
    every_tensor = sync.policy.min_ndim <= 1 and sync.policy.min_numel <= 1
    return tuple(c for c in COLLECTIVES[compression] if not ((every_tensor or sync.pack != "none") and c == "rest"))


def arm_cost(method: str, compression: str, local_steps: int, wire_ratio: float, steps: int | None = None,
             w: Workload = hardware.RESNET50, measured: tuple[str, float] | None = None,
             overrides: tuple[str, ...] = ()) -> ArmCost:  # fmt: skip
    """What one arm sends per exchange on workload ``w``: ``measured`` (the wire bench's configuration and its bytes
    per exchange on ``w``) when given, else from the run's wire ratio (per step, over ``steps`` steps: a run of
    local steps also exchanges at its end, ``ceil(steps / H)`` exchanges in all). ``overrides``: the arm's
    settings beyond its preset (:func:`collectives_of`)."""
    sync = _sync_of(compression, overrides)
    collectives = _collectives(compression, sync)
    if measured is None and (not wire_ratio or wire_ratio <= 0):
        raise FrontierCostError(f"{method}: no measured wire ratio (the run has no bytes per step)")
    every = max(int(local_steps or 0), 1)
    per_exchange = steps / math.ceil(steps / every) if steps else every
    bench, nbytes = measured if measured else ("", 4 * w.numel * per_exchange / wire_ratio)
    if not w.dense_rest:  # a workload whose every tensor is compressed (GPT-2 with min_ndim=1): no allreduce of a rest
        collectives = tuple(c for c in collectives if c != "rest")
    rest = min(4.0 * w.dense_rest, nbytes) if "rest" in collectives else 0.0
    kind = "ddp" if compression in ("none", "bf16") and every == 1 else "serial"
    return ArmCost(method, compression, every, wire_ratio, nbytes, collectives, rest, kind, bench, sync.pack == "all")


def wire_bench(path: Path, w: Workload = hardware.RESNET50) -> dict[str, float]:
    """Bytes per exchange of each wire-bench configuration on ``w`` (``{}`` without the file, or when it is another
    model's or was run at one ``--density`` for every preset instead of each preset's own)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    if data.get("numel") != w.numel or data.get("density") is not None:
        return {}
    return {name: float(row["sent_bytes"]) for name, row in data.get("compressors", {}).items()}


def bench_name(compression: str, overrides: tuple[str, ...]) -> str | None:
    """The wire bench's configuration that is preset ``compression`` with the ``compression.*`` and ``sync.*`` of
    ``overrides`` (a run's other overrides do not change its bytes), if there is one."""
    from dgc.bench.common import configurations

    wanted = (compression, frozenset(o for o in overrides if o.startswith(("compression.", "sync."))))
    return next((n for n, (base, extra) in configurations().items() if (base, frozenset(extra)) == wanted), None)


def bench_bytes(compression: str, overrides: tuple[str, ...], wire: dict[str, float]) -> tuple[str, float] | None:
    """The wire bench's configuration for these settings (:func:`bench_name`) and its bytes per exchange in ``wire``
    (:func:`wire_bench`), or None where the bench has no such configuration."""
    name = bench_name(compression, overrides)
    return (name, wire[name]) if name is not None and name in wire else None


def exchange_s(arm: ArmCost, p: Profile, workers: int) -> float:
    """One exchange of ``arm`` (not DDP's) over ``workers`` workers of profile ``p``: each of its collectives."""
    carriers = sum(c in ("allreduce", "allgather") for c in arm.collectives)
    payload = (arm.nbytes - arm.rest_bytes) / carriers
    sizes = {"allreduce": payload, "allgather": payload, "lengths": 8.0, "rest": arm.rest_bytes}
    return sum((hardware.allgather_s if c in ("allgather", "lengths") else hardware.allreduce_s)(p, sizes[c], workers)
               for c in arm.collectives)  # fmt: skip


def step_s(arm: ArmCost, p: Profile, workers: int = WORKERS, w: Workload = hardware.RESNET50) -> float:
    """The mean step of ``arm``: the compute, and its exchanges spread over the steps between them."""
    if arm.kind == "ddp":
        method = "ddp_bf16" if arm.compression == "bf16" else "ddp_fp32"
        return hardware.step_s(p, w, method, workers)["step_s"]
    agree = arm.agreements * hardware.agreement_s(p, workers)
    return w.compute_s + exchange_s(arm, p, workers) / arm.every + agree


def projection(arms: list[ArmCost], workers: int = WORKERS, w: Workload = hardware.RESNET50) -> dict[str, Any]:
    """Every arm's step (seconds) on every link of the grid."""
    links = [(g, lat) for lat in LATENCIES_MS for g in LINKS_GBPS]
    return {
        "workload": w.name, "compute_s": w.compute_s, "compute_source": w.compute_source, "workers": workers,
        "links": [{"gbps": g, "latency_ms": lat} for g, lat in links],
        "arms": [dict(asdict(a), step_s=[step_s(a, link_profile(g, lat), workers, w) for g, lat in links])
                 for a in arms],
    }  # fmt: skip


def frontier(points: list[tuple[float, float]], higher: bool = True) -> list[int]:
    """The indices of the points (bytes, metric) no other point beats on both: as few or fewer bytes and as good or
    better a metric (higher, or lower where ``higher`` is false: a loss), better on one. Sorted by bytes."""
    sign = 1.0 if higher else -1.0
    pts = [(b, sign * a) for b, a in points]
    keep = [
        i for i, (b, a) in enumerate(pts)
        if not any(b2 <= b and a2 >= a and (b2 < b or a2 > a) for j, (b2, a2) in enumerate(pts) if j != i)
    ]  # fmt: skip
    return sorted(keep, key=lambda i: points[i][0])


# -- the outputs of a frontier table ------------------------------------------------------------------------------
def arms_of(methods: list[dict[str, Any]], local_steps: dict[str, int],
            measured: dict[str, tuple[str, float]] | None = None,
            overrides: dict[str, tuple[str, ...]] | None = None,
            w: Workload = hardware.RESNET50) -> list[tuple[dict[str, Any], ArmCost]]:  # fmt: skip
    """The report's per-method records that ran, each with its price (``local_steps``: H per method label;
    ``measured``: the wire bench's configuration and bytes per exchange on ResNet-50 per method label, if any;
    ``overrides``: each method's train overrides)."""
    out = []
    for rec in methods:
        if rec["steps"] is None or rec["wire_ratio"] is None:
            continue
        out.append((rec, arm_cost(rec["method"], rec["compression"], local_steps.get(rec["method"], 0),
                                  rec["wire_ratio"], rec["steps"], w=w,
                                  measured=(measured or {}).get(rec["method"]),
                                  overrides=(overrides or {}).get(rec["method"], ()))))  # fmt: skip
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


#: how far from dense fp32's headline metric an arm may be and still count as keeping it: points of accuracy, or
#: nats per token of a loss (lower is better)
KEEPS = 1.0
KEEPS_LOSS = 0.02
#: how the projection names its workload
WORKLOAD_LABELS = {hardware.RESNET50.name: "ResNet-50", hardware.GPT2_124M.name: "GPT-2 124M"}


def fastest(headline: str, priced: list[tuple[dict[str, Any], ArmCost]], proj: dict[str, Any],
            links: list[str], higher: bool = True) -> list[str]:  # fmt: skip
    """Per link: the fastest arm, and the fastest that keeps dense fp32's metric within :data:`KEEPS` (a loss:
    :data:`KEEPS_LOSS`)."""
    keeps = KEEPS if higher else KEEPS_LOSS
    dense = next((rec[headline] for rec, arm in priced if arm.compression == "none" and arm.every == 1), None)
    keeping = [i for i, (rec, _) in enumerate(priced)
               if dense is not None and rec[headline] is not None
               and (rec[headline] >= dense - keeps if higher else rec[headline] <= dense + keeps)]  # fmt: skip
    out = []
    for c, link in enumerate(links):
        step = [row["step_s"][c] for row in proj["arms"]]
        best = min(range(len(priced)), key=step.__getitem__)
        line = f"- {link}: fastest {priced[best][1].method} ({_ms(step[best])} ms)"
        if keeping:
            kept = min(keeping, key=step.__getitem__)
            unit = "point" if higher else "nats"
            line += (f"; fastest within {keeps:g} {unit} of dense fp32's {headline}: {priced[kept][1].method} "
                     f"({_ms(step[kept])} ms)")  # fmt: skip
        out.append(line)
    return out


def to_markdown(title: str, headline: str, priced: list[tuple[dict[str, Any], ArmCost]], proj: dict[str, Any],
                command: str, higher: bool = True) -> str:  # fmt: skip
    links = [f"{x['gbps']:g} Gb/s, {x['latency_ms']:g} ms" for x in proj["links"]]
    model = WORKLOAD_LABELS.get(proj["workload"], proj["workload"])
    head = ["method", headline, "H", f"bytes/exchange ({model})", *links]
    lines = [f"# {title}: projected step time (ms), {model} on H100s, {proj['workers']} workers", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for (rec, arm), row in zip(priced, proj["arms"], strict=True):
        acc = rec[headline]
        cells = [arm.method, f"{acc:.2f}" if acc is not None else "-", str(arm.every) if arm.every > 1 else "-",
                 f"{arm.nbytes / 2**20:,.2f} MB" + ("" if arm.bench else " *"),
                 *(_ms(s) for s in row["step_s"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *fastest(headline, priced, proj, links, higher), ""]
    lines += [
        f"Compute: {proj['compute_s'] * 1e3:.1f} ms per step ({proj['compute_source']}). Each arm's bytes: its "
        f"message on {model}'s gradient, by the wire bench of {model} (results/bench/wire.json: "
        "`python -m dgc.bench wire --model resnet50`; "
        "the configuration with the arm's compression settings, at their final density); * where the bench has no "
        f"such configuration (or measured another model): {model}'s fp32 gradient over the arm's wire ratio "
        "measured on this table's runs (warm-up included). Dense fp32 and bf16 as DDP overlaps them "
        "with the backward pass, every other arm after the backward pass, as the trainer runs it, each exchange after "
        f"the workers' agreement (one allreduce of {AGREEMENT_BYTES} bytes); an exchange of H local steps spread over "
        "its H steps. The model and what it leaves out: `dgc/repro/frontier_cost.py`.",
        "", f"Made by `{command}`.",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(title: str, headline: str, label: str, priced: list[tuple[dict[str, Any], ArmCost]],
         proj: dict[str, Any], higher: bool = True) -> bytes:  # fmt: skip
    """The headline metric against bytes per worker per step, the frontier drawn; beside it each arm's projected
    step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dgc.repro import plots

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5))
    # an arm without the headline metric (a run that never read the test split) has its bar, not a point
    shown = [i for i, (rec, _) in enumerate(priced) if rec[headline] is not None]
    points = [(priced[i][0]["sent_mb"] * 2**20, priced[i][0][headline]) for i in shown]
    for i, (x, y) in zip(shown, points, strict=True):
        rec, arm = priced[i]
        ax.errorbar([x], [y], yerr=rec.get(f"{headline}_sd") or 0.0, fmt="o", color=f"C{i % 10}", capsize=3,
                    label=arm.method)  # fmt: skip
    edge = frontier(points, higher)
    if len(edge) > 1:
        xs, ys = [points[i][0] for i in edge], [points[i][1] for i in edge]
        ax.step(xs, ys, where="post", color="0.4", linestyle="--", linewidth=1, label="frontier")
    ax.set_xscale("log")
    better = "higher" if higher else "lower"
    ax.set(xlabel="bytes one worker sends per step (log)", ylabel=f"{label} ({better} is better)",
           title=f"{'accuracy' if higher else 'loss'} against bytes (mean over seeds, bars: spread)")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    width = 0.8 / max(len(priced), 1)
    for i in range(len(priced)):
        row = proj["arms"][i]["step_s"]
        bars.bar([c + (i + 0.5 - len(priced) / 2) * width for c in range(len(row))], [s * 1e3 for s in row], width,
                 color=f"C{i % 10}")  # fmt: skip
    bars.axhline(proj["compute_s"] * 1e3, color="0.3", linewidth=1, linestyle=":")
    bars.set_xticks(range(len(proj["links"])),
                    [f"{x['gbps']:g} Gb/s\n{x['latency_ms']:g} ms" for x in proj["links"]])  # fmt: skip
    bars.set_yscale("log")
    bars.set(
        ylabel="projected step (ms, log; dotted: compute only)",
        title=f"projected step: {WORKLOAD_LABELS.get(proj['workload'], proj['workload'])} on H100s, "
        f"{proj['workers']} workers, per link and message latency",
    )
    bars.grid(alpha=0.3, axis="y", which="both")
    handles, labels = ax.get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    plots.suptitle(fig, title)
    return plots.png(fig)


def outputs(name: str, title: str, headline: str, label: str, methods: list[dict[str, Any]],
            local_steps: dict[str, int], command: str,
            overrides: dict[str, tuple[str, ...]] | None = None, wire: dict[str, float] | None = None,
            higher: bool = True, w: Workload = hardware.RESNET50, workers: int = WORKERS,
            ) -> dict[str, bytes]:  # fmt: skip
    """The files a frontier table adds to its report (nothing when no arm has run yet). ``overrides``: each method's
    train overrides, to find its wire-bench configuration in ``wire`` (:func:`wire_bench`'s bytes per exchange);
    ``higher``: whether the headline metric is better higher; ``w``, ``workers``: what the projection prices."""
    measured = {rec["method"]: bench_bytes(rec["compression"], (overrides or {}).get(rec["method"], ()), wire or {})
                for rec in methods}  # fmt: skip
    priced = arms_of(methods, local_steps, {m: b for m, b in measured.items() if b is not None}, overrides, w)
    if not priced:
        return {}
    proj = projection([arm for _, arm in priced], workers, w)
    return {
        f"{name}-bytes.png": plot(title, headline, label, priced, proj, higher),
        f"{name}-projection.md": to_markdown(title, headline, priced, proj, command, higher).encode(),
        f"{name}-projection.json": (json.dumps(proj, indent=2) + "\n").encode(),
    }


# -- python -m dgc.repro.frontier_cost: the projection from the wire bench alone (no runs needed) -------------------
def bench_only(table_name: str, wire_path: Path, workers: int = WORKERS) -> str:
    """The projection of table ``table_name``'s arms from ``wire_path`` alone, on ``workers`` workers: bytes and step
    times, no accuracy (what ``python -m dgc.repro.report --table`` adds once the runs are done)."""
    from dgc.bench.common import configurations
    from dgc.repro import presets
    from dgc.repro.tables import get_table

    table = get_table(table_name)
    if not table.frontier:
        frontiers = ", ".join(sorted(_frontier_table_names()))
        raise FrontierCostError(f"table {table_name} is not a frontier table; valid: {frontiers}")
    wire = wire_bench(wire_path)
    if not wire:
        raise FrontierCostError(
            f"{wire_path}: no wire bench of ResNet-50 at each preset's density; make it with "
            f"python -m dgc.bench wire --model resnet50 --out {wire_path}"
        )
    priced = []
    for row in {r.method: r for r in table.rows}.values():  # one row per method (the seeds differ only)
        measured = bench_bytes(row.compression, row.overrides, wire)
        if measured is None:
            raise FrontierCostError(f"{row.method}: {wire_path} has no configuration with its compression settings "
                                    f"({row.compression} {' '.join(row.overrides)})")  # fmt: skip
        every = presets.preset(row.compression, [o for o in row.overrides if o.startswith("local_steps.")])
        arm = arm_cost(row.method, row.compression, every.local_steps.every, 0.0, measured=measured,
                       overrides=row.overrides)  # fmt: skip
        priced.append(({"method": row.method, table.metrics[0]: None}, arm))
    for name, method in WHAT_IF.items():  # the settings the table does not run, where the bench has them
        if name in wire:
            compression, overrides = configurations()[name]
            arm = arm_cost(method, compression, 0, 0.0, measured=(name, wire[name]), overrides=overrides)
            priced.append(({"method": method, table.metrics[0]: None}, arm))
    proj = projection([arm for _, arm in priced], workers)
    command = f"python -m dgc.repro.frontier_cost --table {table_name} --wire {wire_path}"
    command += f" --workers {workers}" if workers != WORKERS else ""
    return to_markdown(table.title, table.metrics[0], priced, proj, command)


def _frontier_table_names() -> list[str]:
    from dgc.repro.tables import TABLES

    return [name for name, t in TABLES.items() if t.frontier]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m dgc.repro.frontier_cost", description=bench_only.__doc__)
    p.add_argument("--table", default="cpu-frontier", help="a frontier table (default: %(default)s)")
    p.add_argument("--wire", type=Path, default=Path("results/bench/wire.json"),
                   help="the wire bench's JSON on ResNet-50 (default: %(default)s)")  # fmt: skip
    p.add_argument("--workers", type=int, default=WORKERS, help="workers, one GPU each (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        if args.workers < 2:
            raise FrontierCostError(f"--workers must be an integer >= 2, got {args.workers}")
        print(bench_only(args.table, args.wire, args.workers), end="")
    except (FrontierCostError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


__all__ = [
    "AGREEMENT_BYTES", "COLLECTIVES", "KEEPS", "LATENCIES_MS", "LINKS_GBPS", "WORKERS", "ArmCost", "FrontierCostError",
    "WHAT_IF", "arm_cost", "arms_of", "bench_bytes", "bench_name", "collectives_of",
    "exchange_s", "fastest", "frontier", "link_profile", "outputs",
    "projection", "step_s", "wire_bench",
]  # fmt: skip

if __name__ == "__main__":
    main()
