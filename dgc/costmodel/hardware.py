"""A step-time model of real hardware: GPUs in machines, a fast link inside a machine, a network between them.

The calibrated model (:mod:`dgc.costmodel`) fits its constants on the emulated cluster of this machine. This one
takes every constant from a published figure (cited in :data:`PROFILES` and :data:`RESNET50`) or marks it assumed,
and models a whole training step, not only the exchange, so that DDP's overlap of the allreduce with the backward
pass is counted for the dense baseline as users run it.

A machine holds R GPUs on an intra-machine link of ``intra.gbps`` per GPU and direction (NVLink); M machines
share a network of ``inter.gbps`` per machine and direction (all its NICs together). N = M R GPUs. Latencies
follow NCCL's own tuning model (``src/graph/tuning.cc``, ring algorithm, Simple protocol): a base latency per
collective plus one hop latency per ring step, ``intra.latency_us`` for NVLink hops and ``inter.latency_us`` for
network hops.

Collectives (S: the bytes each GPU contributes):

* allreduce, as NCCL runs it between machines (a ring of rings, or the two-level form: reduce-scatter inside the
  machine, R parallel allreduces of S/R between the M machines, one per GPU's share of the network, allgather
  inside; both put ``2 (M-1)/M S`` on each machine's network per direction):
  ``base + 2 (R-1) l_intra + 2 (M-1) l_inter + 2 (R-1)/R S / B_intra + 2 (M-1)/M S / B_inter``;
* allgather of S bytes per GPU (DGC's flat exchange): each machine takes in the (N - R) messages of the other
  machines over its network, and each GPU receives N - 1 messages over its intra link:
  ``base + (R-1) l_intra + (M-1) l_inter + (N-1) S / B_intra + (N-R) S / B_inter``;
* DGC hierarchical (:mod:`dgc.exchanges`): a dense reduce-scatter inside the machine, selection on 1/R of the
  values, an allgather of the shards' messages between machines (R rails in parallel), the dense result shared
  inside; sparse allreduce: two all-to-alls and two allgathers whose received volume V does not grow with N.

GPU work (the compressor's): ``kernels x launch_us + host_syncs x sync_us + passes x bytes / HBM bandwidth``;
kernels and host syncs per step are this repository's counts (``python -m dgc.bench ops``, ResNet-50, world 1:
:data:`RESNET50`). A dense allreduce's reduction runs inside NCCL's kernels and costs nothing extra here.

Steps (T = the compute of one step on one GPU, a fraction ``backward`` of it the backward pass):

* ``ddp_fp32`` / ``ddp_bf16``: DDP's buckets (the first 1 MiB, then 25 MiB, in reverse order of the parameters)
  become ready as the backward pass produces them (assumed: uniformly in bytes over the backward pass); one
  communication stream runs them in order; the step ends when the compute and the last bucket are done. bf16 adds
  a cast pass each way.
* ``dgc``: the serial hook: after the backward pass, the workers' agreement (:data:`dgc.sync.AGREEMENT_BYTES`: a
  non-finite gradient anywhere, stop and checkpoint requests; one small allreduce), compress, exchange, decode:
  nothing is hidden. Every DGC method pays the agreement before each exchange (the overlapped one before each
  bucket; the hierarchical one inside the machine, then between machines); DDP has none.
* ``dgc_overlap``: each bucket compressed and exchanged when ready, on a stream of its own; the compressor's memory
  passes share the GPU with the backward pass (added to the compute), its launches and host syncs and the
  exchange are on the bucket pipeline. Kernels and syncs: the ops bench's count of the step in DDP's buckets
  (``python -m dgc.bench ops --bucket-mb 25``: ResNet-50's 5 buckets, each the whole step's code, with one host
  read for every bucket's agreement, after the last).
* ``dgc_hierarchical``, ``dgc_sparse_allreduce``: serial, through those exchanges.

Speed-up over one GPU: ``N T / step(N)``. ``python -m dgc.costmodel --explain --profile h100-ib400 --machines 16``
prints every method's step and speed-up and says whether DGC pays; ``python -m dgc.costmodel --table`` the
projection over 1 to 128 machines of every profile; ``python -m dgc.costmodel --check`` the model's form against
this machine's measured e2e runs (:mod:`dgc.costmodel.e2e`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dgc.sync.agreement import AGREEMENT_BYTES

MiB = 2**20


@dataclass(frozen=True)
class Link:
    gbps: float  #: Gbit/s per direction (intra: per GPU; inter: per machine, all its NICs)
    latency_us: float  #: per ring hop
    source: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    gpus_per_machine: int
    intra: Link
    inter: Link
    #: NCCL's base latency of one collective (ring, Simple protocol), microseconds
    base_latency_us: float = 8.4
    #: the GPU's memory bandwidth, GB/s, and the costs of a kernel launch and of a host synchronization
    hbm_gbs: float = 3350.0
    launch_us: float = 5.0
    sync_us: float = 20.0
    notes: tuple[str, ...] = ()
    #: a profile of CPU ranks (:mod:`dgc.costmodel.e2e`): the compressor's seconds per value per kind and per byte
    #: decoded, in place of the GPU's kernels, syncs and memory passes
    cpu_s_per_value: dict[str, float] | None = None
    cpu_s_per_decoded_byte: float = 0.0
    #: CPU ranks: a collective's per-message cost (gloo's copies and system calls) is spent on the cores the
    #: backward pass runs on, so an overlapped bucket's latency delays the compute as well
    latency_on_device: bool = False

    def work_s(self, w: Workload, kind: str, values: float, buckets: int = 1) -> tuple[float, float]:
        """The compressor's time on ``values`` gradient values in ``buckets`` calls: ``(device, host)``, the part
        that occupies the device the backward pass runs on (memory passes; all of it for CPU ranks) and the part
        spent launching and synchronizing (on the pipeline, not on the device)."""
        if self.cpu_s_per_value is not None:
            return self.cpu_s_per_value.get(kind, 0.0) * values, 0.0
        return w.passes.get(kind, 0.0) * 4 * values / (self.hbm_gbs * 1e9), buckets * self.host_s(w, kind)

    def host_s(self, w: Workload, kind: str) -> float:
        """What ``kind``'s counts (:attr:`Workload.kernels`, :attr:`Workload.host_syncs`) cost the host: launching and
        synchronizing (none for CPU ranks, whose work is all in :meth:`work_s`'s device part)."""
        if self.cpu_s_per_value is not None:
            return 0.0
        return (w.kernels.get(kind, 0) * self.launch_us + w.host_syncs.get(kind, 0) * self.sync_us) * 1e-6

    def decode_s(self, received: float, dense: float) -> float:
        """Decoding ``received`` message bytes into a dense gradient of ``dense`` bytes."""
        if self.cpu_s_per_value is not None:
            return self.cpu_s_per_decoded_byte * received
        return (received + dense) / (self.hbm_gbs * 1e9)


_NCCL = "NCCL src/graph/tuning.cc: ring/Simple base latency 8.4 us, NVLink hop 3.4 us, network hop 14 us"
_H100 = "H100 SXM datasheet: NVLink 4 900 GB/s per GPU (450 GB/s per direction), HBM3 3.35 TB/s"
_GPU = ("kernel launch 5 us and host sync 20 us per call: assumed (a few microseconds per launch is the usual "
        "CUDA figure; a sync also drains the queue)")  # fmt: skip
_NVLINK = Link(450 * 8, 3.4, _H100)


def _machine(name: str, description: str, inter: Link, *notes: str) -> Profile:
    return Profile(name, description, 8, _NVLINK, inter, notes=(_H100, _NCCL, _GPU, *notes))


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _machine("h100-ib400", "8 x H100 SXM per machine (NVLink 4), 8 x 400 Gb/s InfiniBand NDR per machine",
                 Link(8 * 400, 14.0, "DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s InfiniBand, one per GPU")),
        _machine("h100-eth100", "8 x H100 SXM per machine (NVLink 4), one 100 Gb/s Ethernet (RoCE) NIC per machine",
                 Link(100, 14.0, "one 100 GbE NIC per machine; NCCL's network hop latency"),
                 "a cloud machine with one NIC: all 8 GPUs share it"),
        _machine("h100-eth25", "8 x H100 SXM per machine (NVLink 4), one 25 Gb/s Ethernet NIC per machine",
                 Link(25, 14.0, "one 25 GbE NIC per machine; NCCL's network hop latency")),
        _machine("h100-eth1", "8 x H100 SXM per machine (NVLink 4), 1 Gb/s Ethernet (TCP) between machines",
                 Link(1, 100.0, "1 GbE over TCP sockets; 100 us per message: assumed (a LAN round trip)")),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    name: str
    numel: int
    #: values DGC sends dense (BatchNorm, biases: too small to compress), fp32 allreduce
    dense_rest: int
    #: one step on one GPU (forward + backward), seconds, and where the figure comes from
    compute_s: float
    compute_source: str
    backward: float = 2 / 3
    density: float = 0.001
    #: DGC's wire bytes per kept value (int32 index + fp16 value)
    bytes_per_kept: float = 6.0
    #: the compressor's GPU work per step (python -m dgc.bench ops, results/bench/ops.json): kernels (ops that are
    #: not views), host syncs; memory passes over the fp32 gradient (assumed: peers.md's estimate of a DGC step)
    kernels: dict[str, int] = field(default_factory=dict)
    host_syncs: dict[str, int] = field(default_factory=dict)
    passes: dict[str, float] = field(default_factory=dict)


RESNET50 = Workload(
    "resnet50", 25_557_032, 54_120, 256 / 4940,
    "ResNet-50, 256 images per GPU per step, mixed precision: A100 80GB 2,470 images/s (NVIDIA "
    "DeepLearningExamples, PyTorch RN50 v1.5, DGX A100 table); H100 assumed 2x A100 (Lambda's H100 analysis: "
    "~2x for vision models): 4,940 images/s, 51.8 ms per step. Assumed, not measured here",
    # dgc_overlap: the whole step in DDP's 5 buckets (``--bucket-mb 25``), each bucket the whole step's code; its
    # agreement read once, after the last bucket
    kernels={"dgc": 146 - 37, "dgc_overlap": 745 - 191, "bf16": 13 - 2},
    host_syncs={"dgc": 4, "dgc_overlap": 16, "bf16": 1},
    passes={"dgc": 7.0, "bf16": 2.0},
)  # fmt: skip

GPT2_124M = Workload(
    "gpt2_124m", 124_439_808, 0, 61_440 / 462_000,
    "GPT-2 124M, nanoGPT's step of 5 x 12 sequences of 1,024 tokens per GPU, bf16: 8 A100 80GB train it at about "
    "1.85M tokens/s (llm.c's reproduction: 10B tokens in about 90 minutes), 231k per GPU; H100 assumed 2x A100: 462k "
    "tokens/s per GPU, 133 ms per step. Assumed, not measured here. Every tensor compressed (sync.policy.min_ndim=1): "
    "nothing dense besides",
)  # fmt: skip

WORKLOADS = {w.name: w for w in (RESNET50, GPT2_124M)}

METHODS = ("ddp_fp32", "ddp_bf16", "dgc", "dgc_overlap", "dgc_hierarchical", "dgc_sparse_allreduce")
DGC_METHODS = tuple(m for m in METHODS if m.startswith("dgc"))


# -- collectives ----------------------------------------------------------------------------------------------------
def allreduce_s(p: Profile, nbytes: float, machines: int) -> float:
    r, m = p.gpus_per_machine, machines
    if r * m <= 1:
        return 0.0
    lat = p.base_latency_us + 2 * (r - 1) * p.intra.latency_us + 2 * (m - 1) * p.inter.latency_us
    bw = 2 * (r - 1) / r * nbytes / p.intra.bytes_per_s + 2 * (m - 1) / m * nbytes / p.inter.bytes_per_s
    return lat * 1e-6 + bw


def allgather_s(p: Profile, nbytes: float, machines: int) -> float:
    r, m = p.gpus_per_machine, machines
    n = r * m
    if n <= 1:
        return 0.0
    lat = p.base_latency_us + (r - 1) * p.intra.latency_us + (m - 1) * p.inter.latency_us
    intra = (n - 1) * nbytes / p.intra.bytes_per_s if r > 1 else 0.0
    return lat * 1e-6 + intra + (n - r) * nbytes / p.inter.bytes_per_s


def _intra_s(p: Profile, nbytes: float) -> float:
    """A reduce-scatter (or allgather) of ``nbytes`` inside one machine."""
    r = p.gpus_per_machine
    return 0.0 if r == 1 else ((r - 1) * p.intra.latency_us + p.base_latency_us) * 1e-6 + (r - 1) / r * nbytes / (
        p.intra.bytes_per_s)  # fmt: skip


def agreement_s(p: Profile, machines: int, by_machine: bool = False) -> float:
    """The workers' agreement before a DGC exchange (:data:`dgc.sync.AGREEMENT_BYTES`): one allreduce over every GPU,
    or by machine (inside it, then R rings of the M machines in parallel: ``exchange=hierarchical``)."""
    if not by_machine:
        return allreduce_s(p, AGREEMENT_BYTES, machines)
    return allreduce_s(p, AGREEMENT_BYTES, 1) + allreduce_s(replace(p, gpus_per_machine=1), AGREEMENT_BYTES, machines)


def work_s(p: Profile, w: Workload, kind: str, values: float, buckets: int = 1) -> float:
    return sum(p.work_s(w, kind, values, buckets))


# -- DDP's buckets and the timeline ---------------------------------------------------------------------------------
def ddp_buckets(nbytes: float, first: float = 1 * MiB, cap: float = 25 * MiB) -> list[float]:
    """DDP's bucket sizes in the order they are reduced (the first small one, then ``cap`` each)."""
    out, left = [], nbytes
    size = first
    while left > 0:
        out.append(min(size, left))
        left -= out[-1]
        size = cap
    return out


def timeline(compute_s: float, backward: float, buckets: list[float], cost) -> tuple[float, list[tuple]]:  # noqa: ANN001
    """Run ``buckets`` (bytes, in reduction order) on one stream as the backward pass makes them ready (uniformly in
    bytes): ``cost(bytes)`` is a bucket's time on the stream. Returns the step (compute and stream both done) and
    each bucket's (ready, start, end)."""
    total = sum(buckets) or 1.0
    forward = compute_s * (1 - backward)
    done, end, spans = 0.0, 0.0, []
    for size in buckets:
        done += size
        ready = forward + compute_s * backward * done / total
        start = max(ready, end)
        end = start + cost(size)
        spans.append((ready, start, end))
    return max(compute_s, end), spans


# -- one step -------------------------------------------------------------------------------------------------------
def step_s(p: Profile, w: Workload, method: str, machines: int) -> dict[str, float]:
    """One training step of ``method`` on ``machines`` machines of ``p``: ``{"step_s", "exposed_s", "compress_s",
    "network_s"}`` (exposed: the step minus the compute alone)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    r = p.gpus_per_machine
    n, t = machines * r, w.compute_s
    if n == 1:
        return {"step_s": t, "exposed_s": 0.0, "compress_s": 0.0, "network_s": 0.0}
    dense = 4 * w.numel
    kept = (w.numel - w.dense_rest) * w.density
    message = kept * w.bytes_per_kept
    rest = 4 * w.dense_rest
    compress = network = 0.0
    agree = agreement_s(p, machines, by_machine=method == "dgc_hierarchical")  # DGC's, before each exchange/bucket
    if method in ("ddp_fp32", "ddp_bf16"):
        half = method == "ddp_bf16"
        buckets = ddp_buckets(dense)
        busy = len(buckets) * allreduce_s(p, 0, machines) if p.latency_on_device else 0.0
        step, spans = timeline(t + busy, w.backward, buckets, lambda b: allreduce_s(p, b / 2 if half else b, machines))
        network = sum(s[2] - s[1] for s in spans)
        if half:  # the casts: bf16 before the allreduce, fp32 after
            compress = work_s(p, w, "bf16", w.numel, len(buckets))
            step += compress
    elif method == "dgc":
        compress = work_s(p, w, "dgc", w.numel) + p.decode_s(n * message, dense)
        network = agree + allgather_s(p, 8, machines) + allgather_s(p, message, machines)
        network += allreduce_s(p, rest, machines)
        step = t + compress + network
    elif method == "dgc_overlap":
        buckets = ddp_buckets(dense)
        k = len(buckets)
        device, _ = p.work_s(w, "dgc", w.numel, k)
        host = p.host_s(w, "dgc_overlap")  # the launches and syncs of all k buckets, on the bucket pipeline
        memory = device + p.decode_s(n * message, dense)
        if p.latency_on_device:  # each bucket's four collectives (below), their per-message cost
            memory += k * (2 * allreduce_s(p, 0, machines) + 2 * allgather_s(p, 0, machines))

        def bucket(b: float) -> float:
            share = b / dense
            return (host / k + agree + allgather_s(p, 8, machines)
                    + allgather_s(p, message * share, machines) + allreduce_s(p, rest * share, machines))  # fmt: skip

        step, spans = timeline(t + memory, w.backward, buckets, bucket)
        compress, network = memory + host, sum(s[2] - s[1] for s in spans) - host
    elif method == "dgc_hierarchical":
        shard = w.numel / r
        compress = work_s(p, w, "dgc", shard) + p.decode_s(machines * message / r, dense)
        between = replace(p, gpus_per_machine=1)  # R rings of the M machines in parallel, one per GPU of a machine
        network = agree + 2 * _intra_s(p, dense) + allreduce_s(between, rest, machines)
        if machines > 1:
            network += (p.base_latency_us + (machines - 1) * p.inter.latency_us) * 1e-6 + (
                machines - 1) * message / p.inter.bytes_per_s  # fmt: skip
        step = t + compress + network
    else:  # dgc_sparse_allreduce: received volume ~2k entries of 8 bytes, whatever N
        volume = 2 * kept * 8
        compress = work_s(p, w, "dgc", w.numel) + p.decode_s(volume, dense)
        lat = 4 * (p.base_latency_us + (r - 1) * p.intra.latency_us + (machines - 1) * p.inter.latency_us) * 1e-6
        network = lat + volume * (n - 1) / n * (r / p.inter.bytes_per_s if machines > 1 else 1 / p.intra.bytes_per_s)
        network += agree + allreduce_s(p, rest, machines)
        step = t + compress + network
    return {"step_s": step, "exposed_s": step - t, "compress_s": compress, "network_s": network}


def speedup(p: Profile, w: Workload, method: str, machines: int) -> float:
    """Speed-up over one GPU: ``N T / step(N)``."""
    return machines * p.gpus_per_machine * w.compute_s / step_s(p, w, method, machines)["step_s"]


MACHINES = (1, 2, 4, 8, 16, 32, 64, 128)
#: a difference of steps smaller than this is called a wash: the model's constants are not that precise
WASH = 0.05


def projection(w: Workload = RESNET50, machines: tuple[int, ...] = MACHINES) -> dict:
    """Every profile's speed-up and step per method over ``machines`` (8 to 1,024 GPUs)."""
    out = {}
    for name, p in PROFILES.items():
        rows = {}
        for method in METHODS:
            rows[method] = [dict(step_s(p, w, method, m), speedup=speedup(p, w, method, m)) for m in machines]
        out[name] = {"description": p.description, "gpus_per_machine": p.gpus_per_machine, "methods": rows}
    return {"workload": w.name, "compute_s": w.compute_s, "compute_source": w.compute_source,
            "machines": list(machines), "profiles": out}  # fmt: skip


def verdict(p: Profile, w: Workload, machines: int) -> tuple[str, dict[str, dict[str, float]]]:
    """Every method's step at ``machines`` and one line on whether DGC pays against DDP fp32 and bf16."""
    rows = {m: dict(step_s(p, w, m, machines), speedup=speedup(p, w, m, machines)) for m in METHODS}
    dense = min(("ddp_fp32", "ddp_bf16"), key=lambda m: rows[m]["step_s"])
    best = min(DGC_METHODS, key=lambda m: rows[m]["step_s"])
    ratio = rows[dense]["step_s"] / rows[best]["step_s"]
    d, b = rows[dense], rows[best]
    if machines * p.gpus_per_machine == 1:
        line = "one GPU: nothing to exchange, nothing for DGC to save"
    elif ratio > 1 + WASH:
        line = (f"DGC pays: {best} {b['step_s'] * 1e3:.1f} ms per step against {dense}'s {d['step_s'] * 1e3:.1f} ms "
                f"({ratio:.2f}x faster)")  # fmt: skip
    elif ratio >= 1 - WASH:
        line = (f"DGC does not pay: {best} {b['step_s'] * 1e3:.1f} ms per step against {dense}'s "
                f"{d['step_s'] * 1e3:.1f} ms, within {WASH:.0%} either way (closer than this model tells apart): "
                f"nothing to gain for DGC's tuning and accuracy risk")  # fmt: skip
    else:
        line = (f"DGC does not pay: {dense} {d['step_s'] * 1e3:.1f} ms per step is faster than the best DGC ({best}, "
                f"{b['step_s'] * 1e3:.1f} ms): DDP leaves {d['exposed_s'] * 1e3:.2f} ms of communication exposed, "
                f"DGC's compress and exchange leave {b['exposed_s'] * 1e3:.2f} ms")  # fmt: skip
    return line, rows


__all__ = ["METHODS", "PROFILES", "RESNET50", "Link", "Profile", "Workload", "allgather_s", "allreduce_s",
           "ddp_buckets", "projection", "speedup", "step_s", "timeline", "verdict"]  # fmt: skip
