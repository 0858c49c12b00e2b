"""A cost model of one gradient exchange, calibrated on the emulated cluster.

Time of one collective among N workers, each on its own full-duplex link of bandwidth B
(bytes/s, per direction) to a switch, with a per-message latency alpha (seconds: software,
scheduling and the network's delay):

* ring allreduce of S bytes (reduce-scatter then allgather, what gloo runs for large buffers):
  ``2 (N-1) alpha + 2 (N-1)/N * S / B``, plus ``reduce_s_per_byte * S`` of arithmetic (the
  fp16 sum is done in software by gloo and is not free);
* ring allgather of S bytes per worker: ``(N-1) alpha + (N-1) S / B``: the volume each worker
  receives grows with N, the reason sparse exchanges stop scaling (peers.md, "no gain beyond a
  few hundred nodes");
* hierarchical (G workers per machine): dense reduce inside the machine over its bus
  (``2 (G-1)/G * S / B_local``), a sparse allgather between the N/G machines, a broadcast
  inside (``S / B_local``). Used for the projections only; the emulated cluster has one
  worker per machine.

A method's exchange is its collectives plus its CPU work (packing, selection, encoding,
decoding): ``cpu_s = (cpu_s_per_value * numel + cpu_s_per_message_byte * N * message_bytes)
* contention(N)`` (the second term, for sparse methods: decoding the N messages), where ``contention(N) =
max(1, N * threads / cores)`` is the slowdown of N ranks sharing ``cores`` cores (the emulated
cluster runs every rank on one machine; a real cluster has contention 1).

* ``none``: pack + ring allreduce of 4 bytes/value + unpack;
* ``fp16``: the same with 2 bytes/value (and gloo's fp16 summation);
* ``dgc``: selection and encoding, an allgather of the 8-byte message lengths, an allgather of
  the longest message, decoding and scatter-add of the N messages; the tensors sent dense
  (BatchNorm, biases) add a small fp32 allreduce, or with ``dense_values=1bit`` a small allgather;

Calibration (:func:`calibrate`) on measured runs (``python -m dgc.bench cluster`` at several
node counts), by least squares on relative errors: each method's CPU seconds per value from its
measured compress + decompress times, and the network (alpha, the bandwidth efficiency: the
effective bandwidth is efficiency x the nominal rate, the fp16 reduction cost; all linear in the
model, fitted non-negative) from the measured communicate times of all methods. The report
lists every measured exchange next to its prediction (CPU + network).

``python -m dgc.costmodel results/bench/cluster_n2.json results/bench/cluster_n4.json ...``
writes ``results/bench/costmodel.json`` and ``costmodel.png`` (speed-up against the number of
workers at 1 and 10 Gbps). Speed-up: ``N * T_compute / (T_compute + T_exchange(N))`` (no
overlap of computation and communication), for a given per-worker compute time per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgc import atomic

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bytes(rate: str) -> float:
    """A tc rate (``1gbit``, ``100mbit``) in bytes per second."""
    text = rate.lower()
    for unit in sorted(RATE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * RATE_UNITS[unit] / 8
    raise ValueError(f"unknown rate {rate!r}: use a number followed by bit, kbit, mbit, gbit or tbit")


@dataclass
class Network:
    bandwidth: float  # bytes/s per direction
    alpha: float = 2e-4  # s per message
    reduce_fp16_s_per_byte: float = 0.0  # gloo's software fp16 sum

    def allreduce(self, nbytes: float, n: int, fp16: bool = False) -> float:
        if n <= 1:
            return 0.0
        t = 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes / self.bandwidth
        return t + (self.reduce_fp16_s_per_byte * nbytes if fp16 else 0.0)

    def allgather(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return (n - 1) * (self.alpha + nbytes / self.bandwidth)

    def hierarchical_sparse(self, dense_bytes: float, sparse_bytes: float, n: int, g: int, local: float) -> float:
        """Dense reduce inside each machine of g workers, sparse allgather between machines, broadcast inside."""
        machines = max(1, math.ceil(n / g))
        inside = 2 * (g - 1) / g * dense_bytes / local + dense_bytes / local if g > 1 else 0.0
        return inside + self.allgather(sparse_bytes, machines)


@dataclass
class Workload:
    """One model's exchange: values, bytes each method puts on the wire, dense leftovers."""

    numel: int
    sparse_bytes: float  # DGC message per worker and step
    dense_rest_bytes: float = 0.0  # tensors DGC sends dense (an allreduce; an allgather when 1-bit)
    dense_rest_gather: bool = False  # the dense rest goes by allgather (policy dense_values=1bit)


@dataclass
class CostModel:
    network: Network
    cpu_s_per_value: dict[str, float] = field(default_factory=dict)
    #: decoding and scatter-adding the N received messages (sparse methods)
    cpu_s_per_message_byte: dict[str, float] = field(default_factory=dict)
    cores: int = 2
    threads: int = 1

    def contention(self, n: int) -> float:
        return max(1.0, n * self.threads / self.cores)

    def exchange(self, method: str, w: Workload, n: int, contention: float | None = None) -> dict[str, float]:
        """Predicted seconds of one exchange, split into cpu and network."""
        c = self.contention(n) if contention is None else contention
        cpu = self.cpu_s_per_value.get(method, 0.0) * w.numel * c
        cpu += self.cpu_s_per_message_byte.get(method, 0.0) * n * w.sparse_bytes * c
        net = self.network
        if method == "none":
            comm = net.allreduce(4 * w.numel, n)
        elif method == "fp16":
            comm = net.allreduce(2 * w.numel, n, fp16=True)
        elif method.startswith("dgc") or method == "topk":
            comm = net.allgather(8, n) + net.allgather(w.sparse_bytes, n)
            if w.dense_rest_bytes and w.dense_rest_gather:
                comm += net.allgather(w.dense_rest_bytes, n)
            elif w.dense_rest_bytes:
                comm += net.allreduce(w.dense_rest_bytes, n)
        else:
            raise ValueError(f"no cost model for method {method!r}")
        return {"cpu_s": cpu, "communicate_s": comm, "exchange_s": cpu + comm}


# -- calibration -------------------------------------------------------------------------
MODELLED = ("none", "fp16", "dgc", "dgc_compact", "topk")


def _observations(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    obs = []
    for r in results:
        if r.get("mode") != "exchange":
            continue
        for name, row in r["methods"].items():
            if name not in MODELLED:
                continue
            dense_rest = message = 0.0
            gather = False
            if name.startswith("dgc") or name == "topk":
                if "dense_sent_bytes" in row:  # what the uncompressed tensors took, as measured
                    dense_rest = float(row["dense_sent_bytes"])
                    gather = (row.get("policy") or {}).get("dense_values") == "1bit"
                else:  # older runs: the fp32 allreduce of the values the compressor did not handle
                    dense_rest = float(row["dense_bytes"] - 4 * row.get("compressed_numel", r["numel"]))
                # the longest sparse message (gloo pads every message to it)
                message = float(row.get("sent_bytes_max_rank", row["sent_bytes"])) - dense_rest - 8
            obs.append(
                {
                    "method": name,
                    "nodes": r["nodes"],
                    "rate": r["rate"],
                    "threads": r.get("threads_per_rank", 1),
                    "cores": r.get("cores", os.cpu_count() or 1),
                    "numel": r["numel"],
                    "message_bytes": message,
                    "dense_rest_bytes": dense_rest,
                    "dense_rest_gather": gather,
                    "measured": row["exchange_s"],
                    "cpu_measured": row["compress_s"] + row["decompress_s"],
                    "communicate_measured": row["communicate_s"],
                }
            )
    return obs


def _contention(o: dict[str, Any]) -> float:
    return max(1.0, o["nodes"] * o["threads"] / o["cores"])


def o_sparse(method: str) -> bool:
    return method.startswith("dgc") or method == "topk"


def _cpu_features(o: dict[str, Any]) -> list[float]:
    """CPU time: per value of the gradient, and (sparse methods) per byte of the N messages decoded."""
    c = _contention(o)
    decoded = o["nodes"] * o["message_bytes"] if o_sparse(o["method"]) else 0.0
    return [o["numel"] * c, decoded * c]


def _net_features(o: dict[str, Any]) -> list[float]:
    """Network time is linear in (alpha, 1/efficiency, fp16 reduce cost): its coefficients."""
    n, numel, m = o["nodes"], o["numel"], o["method"]
    bw = rate_bytes(o["rate"])
    alpha = beta = reduce16 = 0.0
    if n > 1:
        if m in ("none", "fp16"):
            size = (4 if m == "none" else 2) * numel
            alpha, beta = 2 * (n - 1), 2 * (n - 1) / n * size / bw
            reduce16 = size if m == "fp16" else 0.0
        else:
            alpha, beta = 2 * (n - 1), (n - 1) * (8 + o["message_bytes"]) / bw
            if o["dense_rest_bytes"] and o.get("dense_rest_gather"):
                alpha += n - 1
                beta += (n - 1) * o["dense_rest_bytes"] / bw
            elif o["dense_rest_bytes"]:
                alpha += 2 * (n - 1)
                beta += 2 * (n - 1) / n * o["dense_rest_bytes"] / bw
    return [alpha, beta, reduce16]


def _nonnegative_lstsq(a, b):  # noqa: ANN001, ANN202 - numpy arrays
    """Least squares with x >= 0 (scipy's exact active-set NNLS)."""
    from scipy.optimize import nnls

    return nnls(a, b)[0]


def calibrate(results: list[dict[str, Any]]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Fit the parameters to measured exchanges; least squares on relative errors, in two parts.

    * CPU: per method, ``compress_s + decompress_s = cpu_s_per_value * numel * contention(N)``;
    * network: ``communicate_s`` against the collectives' alpha-beta terms (alpha, 1/efficiency,
      the fp16 reduction cost; non-negative).

    Returns ``(params, observations)``; each observation carries the predicted exchange (CPU +
    network) and its relative error against the measured ``exchange_s``.
    """
    import numpy as np

    obs = _observations(results)
    if not obs:
        raise ValueError("no exchange-mode cluster results to calibrate on")
    methods = sorted({o["method"] for o in obs})
    params: dict[str, float] = {}
    for m in methods:
        mine = [o for o in obs if o["method"] == m]
        x = np.array([_cpu_features(o) for o in mine])
        y = np.array([max(o["cpu_measured"], 1e-6) for o in mine])
        per_value, per_message_byte = _nonnegative_lstsq(x / y[:, None], np.ones_like(y))
        params[f"cpu_{m}"] = float(per_value)
        if o_sparse(m):
            params[f"cpu_msg_{m}"] = float(per_message_byte)
    net = [o for o in obs if o["nodes"] > 1]
    a = np.array([_net_features(o) for o in net])
    y = np.array([max(o["communicate_measured"], 1e-6) for o in net])
    alpha, beta, reduce16 = (float(v) for v in _nonnegative_lstsq(a / y[:, None], np.ones_like(y)))
    params = {"alpha": alpha, "efficiency": 1 / beta if beta > 0 else 1.0, "reduce_fp16": reduce16, **params}
    for o in obs:
        predict(params, o)
    return params, obs


def predict(params: dict[str, float], o: dict[str, Any]) -> float:
    """Predicted exchange of observation ``o`` (also stored in it, with the relative error)."""
    m = o["method"]
    cpu = float(sum(a * b for a, b in zip(_cpu_features(o), [params[f"cpu_{m}"], params.get(f"cpu_msg_{m}", 0.0)])))
    beta = 1 / params["efficiency"]
    comm = float(sum(a * b for a, b in zip(_net_features(o), [params["alpha"], beta, params["reduce_fp16"]])))
    o["predicted_cpu"], o["predicted_communicate"] = cpu, comm
    o["predicted"] = cpu + comm
    o["error"] = o["predicted"] / o["measured"] - 1
    return o["predicted"]


def leave_one_out(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each node count: calibrate on the runs at the other node counts, predict this one."""
    out = []
    counts = sorted({r["nodes"] for r in results if r.get("mode") == "exchange"})
    for held in counts:
        train = [r for r in results if r["nodes"] != held]
        test = [r for r in results if r["nodes"] == held]
        if len({r["nodes"] for r in train}) < 2:
            continue
        params, _ = calibrate(train)
        for o in _observations(test):
            if f"cpu_{o['method']}" in params:
                predict(params, o)
                out.append(o)
    return out


def model_from(params: dict[str, float], rate: str, cores: int, threads: int = 1) -> CostModel:
    net = Network(rate_bytes(rate) * params["efficiency"], params["alpha"], params["reduce_fp16"])
    cpu = {k.removeprefix("cpu_"): v for k, v in params.items() if k.startswith("cpu_") and "msg_" not in k}
    msg = {k.removeprefix("cpu_msg_"): v for k, v in params.items() if k.startswith("cpu_msg_")}
    return CostModel(net, cpu, msg, cores, threads)


def speedups(
    params: dict[str, float],
    workloads: dict[str, Workload],
    rate: str,
    compute_s: float,
    nodes: Sequence[int],
    gpus_per_machine: int = 4,
    local_bandwidth: float = 10e9,
) -> dict[str, list[float]]:
    """Speed-up over one worker, ``N T_c / (T_c + T_exchange(N))``, per method and worker count.

    One worker per machine and no CPU contention, except ``dgc_hierarchical`` (``gpus_per_machine``
    workers per machine on a ``local_bandwidth`` bus: dense inside the machine, DGC's compact
    sparse allgather between machines, with DGC's CPU cost once per step).
    """
    model = model_from(params, rate, cores=1)
    out: dict[str, list[float]] = {}
    for m, w in workloads.items():
        row = []
        for n in nodes:
            if n == 1:
                t = 0.0
            elif m == "dgc_hierarchical":
                cpu = model.exchange("dgc_compact", w, max(1, n // gpus_per_machine), contention=1.0)["cpu_s"]
                t = cpu + model.network.hierarchical_sparse(
                    4 * w.numel, w.sparse_bytes, n, gpus_per_machine, local_bandwidth
                )
            else:
                t = model.exchange(m, w, n, contention=1.0)["exchange_s"]
            row.append(n * compute_s / (compute_s + t))
        out[m] = row
    return out


# -- command line ------------------------------------------------------------------------
def plot(report: dict[str, Any], path: Path) -> Path:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    nodes = report["projection"]["nodes"]
    for ax, (rate, curves) in zip(axes, report["projection"]["speedup"].items()):
        for method, values in curves.items():
            ax.plot(nodes, values, marker="o", ms=3, label=method)
        ax.plot(nodes, nodes, color="grey", ls=":", lw=1, label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_title(f"{report['projection']['model']} at {rate}, compute {report['projection']['compute_s']} s/step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over one worker")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic.write_bytes(path, buf.getvalue())
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgc.costmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="cluster bench JSON files (exchange mode), e.g. at 2, 4 and 8 nodes")
    p.add_argument("--compute-s", type=float, default=0.2, help="per-worker compute per step for the projection")
    p.add_argument("--out", default="runs/bench/costmodel.json", help="(default: %(default)s; make: results/bench)")
    args = p.parse_args(argv)
    results = []
    for f in args.runs:
        try:
            results.append(json.loads(Path(f).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"{p.prog}: error: cannot read {f}: {e}", file=sys.stderr)
            return 2
    params, obs = calibrate(results)
    loo = leave_one_out(results)
    ref = max(results, key=lambda r: r["nodes"])
    workloads = {}
    for o in obs:  # message sizes of the largest run
        if o["nodes"] == ref["nodes"] and o["method"] in ("none", "fp16", "dgc", "dgc_compact"):
            workloads[o["method"]] = Workload(
                o["numel"], o["message_bytes"], o["dense_rest_bytes"], o.get("dense_rest_gather", False)
            )
    if "dgc_compact" in workloads:
        workloads["dgc_hierarchical"] = workloads["dgc_compact"]
    nodes = [1, 2, 4, 8, 16, 32, 64, 128]
    report = {
        "model_description": "alpha-beta ring collectives + CPU seconds per value x contention; see dgc/costmodel.py",
        "calibrated_on": [str(f) for f in args.runs],
        "params": params,
        "observations": obs,
        "max_abs_error": max(abs(o["error"]) for o in obs),
        "leave_one_out": loo,
        "leave_one_out_max_abs_error": max((abs(o["error"]) for o in loo), default=None),
        "projection": {
            "model": ref["model"],
            "numel": ref["numel"],
            "compute_s": args.compute_s,
            "message_bytes": {m: w.sparse_bytes for m, w in workloads.items()},
            "nodes": nodes,
            "assumptions": "one worker per machine, no CPU contention (CPU costs as calibrated at contention 1); "
            "dgc_hierarchical: 4 workers per machine with a 10 GB/s local bus, dense reduce inside, "
            "compact sparse allgather between machines",
            "speedup": {rate: speedups(params, workloads, rate, args.compute_s, nodes) for rate in ("1gbit", "10gbit")},
        },
    }
    out = Path(args.out)
    atomic.write_bytes(out, (json.dumps(report, indent=2) + "\n").encode())
    plot(report, out.with_suffix(".png"))
    for o in obs:
        print(
            f"{o['method']:12s} N={o['nodes']:<2d} measured {o['measured'] * 1e3:8.1f} ms  "
            f"predicted {o['predicted'] * 1e3:8.1f} ms  ({o['error'] * 100:+.0f}%)",
            file=sys.stderr,
        )
    for o in loo:
        print(
            f"held out: {o['method']:12s} N={o['nodes']:<2d} measured {o['measured'] * 1e3:8.1f} ms  "
            f"predicted {o['predicted'] * 1e3:8.1f} ms  ({o['error'] * 100:+.0f}%)",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "params": params,
                "max_abs_error": report["max_abs_error"],
                "leave_one_out_max_abs_error": report["leave_one_out_max_abs_error"],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["CostModel", "Network", "Workload", "calibrate", "rate_bytes", "speedups"]
