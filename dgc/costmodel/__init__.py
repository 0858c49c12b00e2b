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
* ``exchange=hierarchical`` (M machines of R ranks, :mod:`dgc.exchanges`): a dense reduce-scatter inside
  the machine over its bus (``(R-1)/R * S / B_local``, S the dense bytes of the compressed tensors; the
  fitted ``local_s_per_byte`` is the bus of the calibration runs, shared memory for CPU ranks, and the
  projection assumes ``local_bandwidth``), then R sparse allgathers between the M machines in parallel,
  one per shard (each shard's message is about 1/R of a rank's, and the R rings share the machine's
  link: ``(M-1) alpha + R (M-1) m/R / B``), and the result shared inside the machine; the selection runs
  on ``numel / R`` values per rank. The tensors left dense go by machine too (an allreduce among M
  machines, not N ranks);
* ``exchange=sparse_allreduce``: two all-to-alls (counts, entries as position + value records) and two
  allgathers (lengths, kept entries): ``4 (N-1) alpha + V (N-1)/N / B``, where V, the sparse bytes a
  rank receives, does not grow with N (about 2k entries).

Every method's step also starts with the workers' agreement (:mod:`dgc.sync`: a non-finite gradient anywhere, stop
and checkpoint requests), one allreduce of :data:`~dgc.sync.AGREEMENT_BYTES` over all N ranks: ``2 (N-1) alpha``
and a few bytes; ``exchange=hierarchical`` agrees by machine (inside it, then among the M machines: ``2 (M-1)
alpha``). The cluster bench's ``communicate_s`` includes it (it times :meth:`GradientSync.step`; each run records
its exchange's ``agreement``), so the calibration counts it, as each run made it; left out, the fitted alpha would
absorb it. The projection (:func:`project`) prices the dense methods as DDP runs them, without it.

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
* ``dgc_hierarchical``, ``dgc_sparse_allreduce``: DGC through those exchanges (above).

Ranks of one machine share its link to the switch: a flat ring over N = M R ranks crosses each
machine's link once per step, so flat collectives cost what they cost among N one-rank machines.

Calibration (:func:`calibrate`) on measured runs (``python -m dgc.bench cluster`` at several
node counts), by least squares on relative errors: each method's CPU seconds per value from its
measured compress + decompress times, and the network (alpha, the bandwidth efficiency: the
effective bandwidth is efficiency x the nominal rate, the fp16 reduction cost; all linear in the
model, fitted non-negative) from the measured communicate times of all methods. The report
lists every measured exchange next to its prediction (CPU + network).

``python -m dgc.bench costmodel results/bench/cluster_n2.json results/bench/cluster_n4.json ...``
writes ``results/bench/costmodel.json`` and ``costmodel.png`` (speed-up against the number of
machines of 8 GPUs at 1, 10 and 25 Gbps). Speed-up: ``N * T_compute / (T_compute + T_exchange(N))``
(no overlap of computation and communication), for a given per-worker compute time per step.
``python -m dgc.bench costmodel --explain --machines 128 --ranks-per-node 8 --rate 1gbit`` prints the
predicted exchange of every DGC exchange for one setting and the one :func:`choose_exchange` picks
(what ``sync.exchange=auto`` does at start-up: "hierarchical is 8.85x faster than flat" compares exchange
times alone), then the speed-up over one worker of a whole step with ``--compute-s`` of compute, the
projection's quantity (at 128 x 8 and 1 Gbps, hierarchical's is 7.97x flat's: the compute is common to both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgc.sync.agreement import AGREEMENT_BYTES

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
        comm = net.allreduce(AGREEMENT_BYTES, n)  # the agreement every step starts with
        if method == "none":
            comm += net.allreduce(4 * w.numel, n)
        elif method == "fp16":
            comm += net.allreduce(2 * w.numel, n, fp16=True)
        elif method.startswith("dgc") or method == "topk":
            comm += net.allgather(8, n) + net.allgather(w.sparse_bytes, n)
            if w.dense_rest_bytes and w.dense_rest_gather:
                comm += net.allgather(w.dense_rest_bytes, n)
            elif w.dense_rest_bytes:
                comm += net.allreduce(w.dense_rest_bytes, n)
        else:
            raise ValueError(f"no cost model for method {method!r}")
        return {"cpu_s": cpu, "communicate_s": comm, "exchange_s": cpu + comm}


# -- calibration -------------------------------------------------------------------------
MODELLED = ("none", "fp16", "dgc", "dgc_compact", "topk", "dgc_hierarchical", "dgc_sparse_allreduce")
#: the DGC exchanges sync.exchange=auto chooses from, by bench method name
EXCHANGE_METHODS = {"flat": "dgc", "hierarchical": "dgc_hierarchical", "sparse_allreduce": "dgc_sparse_allreduce"}


def _observations(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    obs = []
    for r in results:
        if r.get("mode") != "exchange":
            continue
        per_node = int(r.get("ranks_per_node", 1))
        for name, row in r["methods"].items():
            if name not in MODELLED:
                continue
            dense_rest = message = recv_sparse = 0.0
            gather = False
            if o_sparse(name):
                if "dense_sent_bytes" in row:  # what the uncompressed tensors took, as measured
                    dense_rest = float(row["dense_sent_bytes"])
                    gather = (row.get("policy") or {}).get("dense_values") == "1bit"
                else:  # older runs: the fp32 allreduce of the values the compressor did not handle
                    dense_rest = float(row["dense_bytes"] - 4 * row.get("compressed_numel", r["numel"]))
                # the longest sparse message (gloo pads every message to it); a shard's with hierarchical
                message = float(row.get("sent_bytes_max_rank", row["sent_bytes"])) - dense_rest - 8
                recv = row.get("recv_bytes_max_rank", row.get("recv_bytes"))
                recv_sparse = float(recv) - dense_rest if recv is not None else (r["nodes"] - 1) * (message + 8)
            obs.append(
                {
                    "method": name,
                    "agreement": row.get("agreement", "flat"),  # runs before it was recorded: flat (then every one)
                    "nodes": r["nodes"],
                    "ranks_per_node": per_node,
                    "machines": r["nodes"] // per_node,
                    "rate": r["rate"],
                    "threads": r.get("threads_per_rank", 1),
                    "cores": r.get("cores", os.cpu_count() or 1),
                    "numel": r["numel"],
                    "compressed_numel": row.get("compressed_numel", r["numel"]),
                    "message_bytes": message,
                    "recv_sparse_bytes": recv_sparse,
                    "dense_rest_bytes": dense_rest,
                    "dense_rest_gather": gather,
                    "measured": row["exchange_s"],
                    "cpu_measured": row["compress_s"] + row["decompress_s"],
                    "communicate_measured": row["communicate_s"],
                }
            )
    return obs


def _contention(o: dict[str, Any]) -> float:
    if "contention" in o:
        return float(o["contention"])
    return max(1.0, o["nodes"] * o["threads"] / o["cores"])


def o_sparse(method: str) -> bool:
    return method.startswith("dgc") or method == "topk"


def _cpu_features(o: dict[str, Any]) -> list[float]:
    """CPU time: per value selected from, and (sparse methods) per byte of the messages decoded."""
    c, m = _contention(o), o["method"]
    r = o.get("ranks_per_node", 1)
    if m == "dgc_hierarchical":  # a shard of 1/R per rank; M messages of a shard each
        return [o["numel"] / r * c, o["machines"] * o["message_bytes"] * c]
    if m == "dgc_sparse_allreduce":  # what arrives: the all-to-all's entries and the kept ones
        return [o["numel"] * c, o["recv_sparse_bytes"] * c]
    decoded = o["nodes"] * o["message_bytes"] if o_sparse(m) else 0.0
    return [o["numel"] * c, decoded * c]


def _net_features(o: dict[str, Any]) -> list[float]:
    """Network time is linear in (alpha, 1/efficiency, fp16 reduce cost, local bus s/byte): its coefficients."""
    alpha, beta, reduce16, local = _exchange_features(o)
    n, r = o["nodes"], o.get("ranks_per_node", 1)
    # the agreement, as the run made it (Exchange.agreement): one allreduce of a few bytes over all N ranks, or by
    # machine (inside it, then among the M machines: R rings of M in parallel); "none": DDP as users run it
    agreement = o.get("agreement", "flat")
    if agreement != "none":
        ring = o.get("machines", n) if agreement == "by_machine" and r > 1 else n
        if ring > 1:
            alpha += 2 * (ring - 1)
            beta += 2 * (ring - 1) / ring * AGREEMENT_BYTES / rate_bytes(o["rate"])
        if ring < n:
            local += 2 * (r - 1) / r * AGREEMENT_BYTES
    return [alpha, beta, reduce16, local]


def _exchange_features(o: dict[str, Any]) -> list[float]:
    """The coefficients of the method's own collectives (:func:`_net_features` less the agreement)."""
    n, numel, m = o["nodes"], o["numel"], o["method"]
    bw = rate_bytes(o["rate"])
    alpha = beta = reduce16 = local = 0.0
    if m in ("none", "fp16"):
        if n > 1:
            size = (4 if m == "none" else 2) * numel
            alpha, beta = 2 * (n - 1), 2 * (n - 1) / n * size / bw
            reduce16 = size if m == "fp16" else 0.0
        return [alpha, beta, reduce16, local]
    if m == "dgc_hierarchical":
        r, machines = o["ranks_per_node"], o["machines"]
        local = (r - 1) / r * 4 * o["compressed_numel"] if r > 1 else 0.0
        if machines > 1:  # R rings of the shards' messages share each machine's link
            alpha, beta = 2 * (machines - 1), r * (machines - 1) * (8 + o["message_bytes"]) / bw
    elif m == "dgc_sparse_allreduce":
        if n > 1:
            alpha, beta = 4 * (n - 1), o["recv_sparse_bytes"] / bw
    elif n > 1:
        alpha, beta = 2 * (n - 1), (n - 1) * (8 + o["message_bytes"]) / bw
    rest = o["dense_rest_bytes"]
    if m == "dgc_hierarchical" and o["ranks_per_node"] > 1 and rest and not o.get("dense_rest_gather"):
        # by machine too: reduce-scatter inside, R rings of rest/R between the M machines share each link
        machines = o["machines"]
        local += (o["ranks_per_node"] - 1) / o["ranks_per_node"] * rest
        if machines > 1:
            alpha += 2 * (machines - 1)
            beta += 2 * (machines - 1) / machines * rest / bw
    elif n > 1 and rest and o.get("dense_rest_gather"):
        alpha += n - 1
        beta += (n - 1) * rest / bw
    elif n > 1 and rest:
        alpha += 2 * (n - 1)
        beta += 2 * (n - 1) / n * rest / bw
    return [alpha, beta, reduce16, local]


def _nonnegative_lstsq(a, b):  # noqa: ANN001, ANN202 - numpy arrays
    """Least squares with x >= 0 (scipy's exact active-set NNLS)."""
    from scipy.optimize import nnls

    return nnls(a, b)[0]


def calibrate(results: list[dict[str, Any]]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Fit the parameters to measured exchanges; least squares on relative errors, in two parts.

    * CPU: per method, ``compress_s + decompress_s`` against its per-value and per-decoded-byte terms
      (:func:`_cpu_features`), times ``contention(N)``;
    * network: ``communicate_s`` against the collectives' alpha-beta terms (alpha, 1/efficiency,
      the fp16 reduction cost, the seconds per byte of a machine's local bus; non-negative).

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
    alpha, beta, reduce16, local = (float(v) for v in _nonnegative_lstsq(a / y[:, None], np.ones_like(y)))
    params = {"alpha": alpha, "efficiency": 1 / beta if beta > 0 else 1.0, "reduce_fp16": reduce16,
              "local_s_per_byte": local, **params}  # fmt: skip
    for o in obs:
        predict(params, o)
    return params, obs


def predict(params: dict[str, float], o: dict[str, Any]) -> float:
    """Predicted exchange of observation ``o`` (also stored in it, with the relative error when measured)."""
    m = o["method"]
    cpu = float(sum(a * b for a, b in zip(_cpu_features(o), [params[f"cpu_{m}"], params.get(f"cpu_msg_{m}", 0.0)])))
    coef = [params["alpha"], 1 / params["efficiency"], params["reduce_fp16"], o.get("local_s_per_byte",
            params.get("local_s_per_byte", 0.0))]  # fmt: skip
    comm = float(sum(a * b for a, b in zip(_net_features(o), coef)))
    o["predicted_cpu"], o["predicted_communicate"] = cpu, comm
    o["predicted"] = cpu + comm
    if "measured" in o:
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


# -- projection and choice ---------------------------------------------------------------
@dataclass
class StepBytes:
    """Bytes of a step per method, scaled from the reference runs (see :func:`workloads_from`)."""

    numel: int
    #: DGC's flat message per rank (bytes) and the dense rest (BatchNorm, biases)
    message_bytes: float
    dense_rest_bytes: float = 0.0
    #: sparse_allreduce: sparse bytes a rank receives, N large (about 2k entries)
    sar_volume: float = 0.0
    #: the density the bytes were measured at (the cluster bench's: DGC's final density)
    density: float = 0.001


def workloads_from(obs: list[dict[str, Any]]) -> StepBytes:
    """The flat message and the sparse-allreduce volume of the largest measured runs."""
    flat = [o for o in obs if o["method"] == "dgc"]
    if not flat:
        raise ValueError("the runs have no flat dgc measurement to scale the workload from")
    ref = max(flat, key=lambda o: o["nodes"])
    sar = [o for o in obs if o["method"] == "dgc_sparse_allreduce" and o["nodes"] > 1]
    vol = 0.0
    if sar:
        big = max(sar, key=lambda o: o["nodes"])
        vol = big["recv_sparse_bytes"] * big["nodes"] / (big["nodes"] - 1)
    return StepBytes(ref["compressed_numel"], ref["message_bytes"], ref["dense_rest_bytes"], vol)


def scaled(w: StepBytes, numel: int, density: float | None = None) -> StepBytes:
    """The same compressor on a gradient of ``numel`` values at ``density`` (sparse bytes scale with k)."""
    d = w.density if density is None else density
    f, k = numel / w.numel, numel * d / (w.numel * w.density)
    return StepBytes(numel, w.message_bytes * k, w.dense_rest_bytes * f, w.sar_volume * k, d)


def auto_exchange(report: str, numel: int, world_size: int, ranks_per_node: int, rate: str,
                  density: float) -> tuple[str, str]:  # fmt: skip
    """``sync.exchange=auto``: the exchange the calibrated model (the report ``python -m dgc.bench costmodel`` wrote)
    predicts fastest for this run, and why. ValueError when the report cannot be read."""
    if world_size == 1:
        return "flat", "one rank: nothing to exchange"
    try:
        data = json.loads(Path(report).read_text())
        params, w = data["params"], StepBytes(**data["projection"]["workload"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"sync.exchange=auto needs a calibrated cost model; cannot read sync.costmodel={report!r} "
            f"({type(e).__name__}); make bench-cluster writes results/bench/costmodel.json"
        ) from None
    r = ranks_per_node if world_size % ranks_per_node == 0 else 1
    best, _, reason = choose_exchange(params, scaled(w, numel, density), world_size // r, r, rate)
    return best, reason


def _agreement(method: str) -> str:
    """How a projected method's step agrees: as its exchange does now (:attr:`dgc.exchanges.Exchange.agreement`);
    the dense methods as DDP runs them, without one."""
    from dgc.exchanges import EXCHANGES

    by_method = {m: EXCHANGES.get(name).agreement for name, m in EXCHANGE_METHODS.items()}
    return by_method.get(method, "flat") if o_sparse(method) else "none"


def project(params: dict[str, float], w: StepBytes, method: str, machines: int, r: int, rate: str,
            local_bandwidth: float) -> float:  # fmt: skip
    """Predicted exchange seconds of ``method`` on ``machines`` x ``r`` ranks, no CPU contention; the dense methods
    (``none``, ``fp16``) as DDP runs them, without the agreement DGC's step starts with."""
    n = machines * r
    if n == 1:
        return 0.0
    o: dict[str, Any] = {"method": method, "nodes": n, "ranks_per_node": r, "machines": machines, "rate": rate,
                         "numel": w.numel, "compressed_numel": w.numel, "message_bytes": w.message_bytes,
                         "dense_rest_bytes": w.dense_rest_bytes if o_sparse(method) else 0.0,
                         "recv_sparse_bytes": w.sar_volume * (n - 1) / n, "contention": 1.0,
                         "local_s_per_byte": 1 / local_bandwidth, "agreement": _agreement(method)}  # fmt: skip
    if method == "dgc_hierarchical":
        o["message_bytes"] = w.message_bytes / r  # each shard owner selects from 1/R of the values
    return predict(params, o)


def choose_exchange(params: dict[str, float], w: StepBytes, machines: int, r: int, rate: str,
                    local_bandwidth: float = 50e9) -> tuple[str, dict[str, float], str]:  # fmt: skip
    """The DGC exchange the model predicts fastest: ``(name, {name: seconds}, reason)``."""
    times = {}
    for name, method in EXCHANGE_METHODS.items():
        if name == "hierarchical" and r == 1:
            continue  # exactly flat
        if name == "sparse_allreduce" and not w.sar_volume:
            continue  # not calibrated
        if f"cpu_{method}" in params:
            times[name] = project(params, w, method, machines, r, rate, local_bandwidth)
    best = min(times, key=times.__getitem__)
    flat = times["flat"]
    verdict = f"{best} is {flat / times[best]:.2f}x faster than flat" if best != "flat" else "flat is fastest"
    predicted = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
    reason = f"{machines} machine(s) x {r} rank(s), {w.numel:,} values, {rate}: predicted {predicted}; {verdict}"
    return best, times, reason


def speedups(params: dict[str, float], w: StepBytes, rate: str, compute_s: float, machines: Sequence[int],
             r: int = 8, local_bandwidth: float = 50e9) -> dict[str, list[float]]:  # fmt: skip
    """Speed-up over one worker, ``N T_c / (T_c + T_exchange(N))``, per method and machine count (R ranks each)."""
    out: dict[str, list[float]] = {}
    for m in ("none", "fp16", "dgc", "dgc_hierarchical", "dgc_sparse_allreduce"):
        if f"cpu_{m}" not in params or (m == "dgc_sparse_allreduce" and not w.sar_volume):
            continue
        out[m] = [
            M * r * compute_s / (compute_s + project(params, w, m, M, r, rate, local_bandwidth)) for M in machines
        ]
    return out


__all__ = ["CostModel", "Network", "StepBytes", "Workload", "auto_exchange", "calibrate", "choose_exchange",
           "rate_bytes", "speedups"]  # fmt: skip
