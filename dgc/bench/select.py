"""``python -m dgc.bench select``: the cost of DGC's compression step against exact top-k.

One flat tensor of ``--numel`` values (default: ResNet-50's 25,557,032 gradient
values as if they were one tensor) and, in the same run and on the same data,
three timings per round:

* ``dgc``: the library's full DGC compression of the tensor: ``DGC.select``
  (momentum correction ``u = m u + g; v += u`` with m = 0.9, sampled-threshold
  selection, momentum masking ``u[idx] = 0``), then the gather ``v[idx]`` and
  ``v[idx] = 0``, exactly what :meth:`SparseCompressor.exchange` does per
  tensor before encoding. Split into ``accumulate`` (the momentum correction),
  ``select`` (selection and momentum masking) and ``gather_mask``;
* ``topk``: ``torch.topk(v.abs(), k, sorted=False)`` on the accumulator ``v``;
* ``pass``: ``torch.sum(v)``, one read of every element: the floor any method
  that looks at every value pays.

Inputs: every round draws a fresh normal gradient (untimed, before the round's
timed regions), so ``v`` is a real accumulator that grows over rounds as in
training and the selection never sees the same tensor twice. ``topk`` and
``pass`` read the current ``v`` (the residual after the latest DGC step, or
before it, depending on the order of the round). The three measurements are
interleaved round-robin, with the order rotated every round, so machine noise
hits them alike. One warm-up round (buffers, first-call costs) is not timed.
Reported times are medians over ``--repeats`` rounds, in milliseconds (``min_ms`` and the
``*_min`` ratios: the fastest round of each, for a machine shared with other work).

DGC's options are its defaults (threshold sampled every step, as in the paper); with the
native kernel (:mod:`dgc.kernels`) the momentum correction, the comparison with the sampled
threshold and the collection of the positions are one pass (``accumulate``), and ``select``
is the sampling, the threshold and what follows.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from dgc.bench.common import (
    density_arg,
    emit,
    int_arg,
    log,
    now,
    positive_int_arg,
    resolve_device,
    run_info,
    synchronizer,
)
from dgc.compressors import DGC
from dgc.compressors.base import Item
from dgc.select import target_count
from dgc.timing import Phases

RESNET50_NUMEL = 25_557_032
MOMENTUM = 0.9
MEASURES = ("dgc", "topk", "pass")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "select",
        help="time DGC's compression step against exact top-k and one memory pass",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--numel", type=positive_int_arg, default=RESNET50_NUMEL, help="tensor size (default: %(default)s)")
    p.add_argument("--density", type=density_arg, default=0.001, help="fraction selected, in (0, 1] (default: 0.001)")
    p.add_argument("--repeats", type=positive_int_arg, default=7, help="timed rounds; medians (default: 7)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int_arg, default=0, help="seed of the gradients and the sampling (default: 0)")
    p.add_argument("--out", default="runs/bench/select.json", help="JSON output (default: %(default)s)")
    return p


def bench_select(
    numel: int = RESNET50_NUMEL, density: float = 0.001, repeats: int = 7, device: str = "cpu", seed: int = 0
) -> dict[str, Any]:
    """Run the benchmark and return its result (see the module docstring)."""
    dev = resolve_device(device)
    info = run_info("select", dev)
    sync = synchronizer(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    k = target_count(numel, density)

    comp = DGC(density=density, seed=seed)
    param = torch.zeros(numel, device=dev)
    grad = torch.empty(numel, device=dev)
    item = Item(name="w", param=param, grad=grad, momentum=MOMENTUM)

    # time the momentum correction inside DGC.select without copying its code:
    # an instance attribute shadows the method that select calls
    split: dict[str, float] = {}
    accumulate_count = comp.accumulate_count

    def timed_accumulate_count(it: Item, threshold: float | None, k: int):  # noqa: ANN202
        sync()
        t0 = now()
        out = accumulate_count(it, threshold, k)
        sync()
        split["accumulate"] = now() - t0
        return out

    comp.accumulate_count = timed_accumulate_count  # type: ignore[method-assign]

    last: dict[str, Any] = {}

    def run_dgc() -> dict[str, float]:
        phases = Phases()
        sync()
        t0 = now()
        idx, v = comp.select(item, density, phases)
        sync()
        t1 = now()
        values = v[idx]
        v[idx] = 0
        sync()
        t2 = now()
        last.update(selected=int(idx.numel()), adaptations=int(phases.counters.get("adaptations", 0)))
        last["values"] = values  # keep the gather alive until the round ends
        return {
            "dgc": t2 - t0,
            "accumulate": split["accumulate"],
            "select": t1 - t0 - split["accumulate"],
            "gather_mask": t2 - t1,
        }

    def accumulator() -> torch.Tensor:
        return comp.state["w"]["v"]

    def run_topk() -> dict[str, float]:
        v = accumulator()
        sync()
        t0 = now()
        top = torch.topk(v.abs(), k, sorted=False)
        sync()
        t1 = now()
        del top
        return {"topk": t1 - t0}

    def run_pass() -> dict[str, float]:
        v = accumulator()
        sync()
        t0 = now()
        total = torch.sum(v)
        sync()
        t1 = now()
        del total
        return {"pass": t1 - t0}

    runners = {"dgc": run_dgc, "topk": run_topk, "pass": run_pass}
    times: dict[str, list[float]] = {key: [] for key in ("dgc", "accumulate", "select", "gather_mask", "topk", "pass")}
    orders = []
    log(f"select: numel={numel} density={density} k={k} device={dev} threads={torch.get_num_threads()}")
    for r in range(repeats + 1):  # round 0 warms up
        torch.randn(numel, generator=gen, device=dev, out=grad)  # fresh gradient, untimed
        if r == 0:
            run_dgc()
            run_topk()
            run_pass()
            continue
        order = MEASURES[(r - 1) % 3 :] + MEASURES[: (r - 1) % 3]
        orders.append("/".join(order))
        row: dict[str, float] = {}
        for name in order:
            row.update(runners[name]())
        for key, seconds in row.items():
            times[key].append(seconds * 1e3)
        log(f"  round {r}/{repeats}: " + " ".join(f"{key}={row[key] * 1e3:.1f}ms" for key in ("dgc", "topk", "pass")))

    med = {key: statistics.median(vals) for key, vals in times.items()}
    return {
        **info,
        "numel": numel,
        "density": density,
        "k": k,
        "momentum": MOMENTUM,
        "repeats": repeats,
        "warmup_rounds": 1,
        "seed": seed,
        "inputs": "fresh normal gradient each round (drawn untimed); v accumulates across rounds",
        "dgc_ms": med["dgc"],
        "accumulate_ms": med["accumulate"],
        "select_ms": med["select"],
        "gather_mask_ms": med["gather_mask"],
        "topk_ms": med["topk"],
        "pass_ms": med["pass"],
        "dgc_over_topk": med["dgc"] / med["topk"],
        "dgc_over_pass": med["dgc"] / med["pass"],
        # the fastest round of each: less sensitive to other processes on a shared machine
        "min_ms": {key: min(vals) for key, vals in times.items()},
        "dgc_over_topk_min": min(times["dgc"]) / min(times["topk"]),
        "dgc_over_pass_min": min(times["dgc"]) / min(times["pass"]),
        "selected": last["selected"],
        "adaptations": last["adaptations"],
        "sample_ratio": comp.sample_ratio,
        "round_orders": orders,
        "runs_ms": times,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = bench_select(args.numel, args.density, args.repeats, args.device, args.seed)
    emit(result, args.out)
    return result
