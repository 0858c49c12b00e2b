"""``python -m dgc.bench cluster --e2e --ddp``: DGC against DDP as users run it, on the emulated cluster.

Every method is a :class:`~torch.nn.parallel.DistributedDataParallel` training step (forward, backward, optimizer
step) of the same model on the same batches, on the ranks of ``launch/netcluster.py``, methods interleaved step by
step after a barrier:

- ``local``: the compute-only reference: no DDP, each rank steps with its own gradient;
- ``ddp``: DDP's own allreduce in fp32, overlapped with backward bucket by bucket;
- ``ddp_bf16``: DDP with ``default_hooks.bf16_compress_hook``;
- ``ddp_powersgd1``, ``ddp_powersgd4``: DDP with PyTorch's PowerSGD hook at rank 1 and 4 (error feedback, warm
  start, dense for the first ``--warmup`` steps, then compressed), in one DDP bucket: with several, its chained
  collectives mismatched between ranks under gloo (see :class:`Method`);
- ``dgc``: DGC (density 0.001, from the first step) through :func:`dgc.ddp_comm_hook`, serial: every bucket held
  until the last, then one exchange;
- ``dgc_overlap``: the same hook with ``overlap=True``: each bucket exchanged as DDP hands it over.

DDP keeps its default 25 MB buckets. ``step_s`` is the slowest rank's wall time of one step; ``exposed_s`` is a
method's median step minus ``local``'s, the communication the backward pass did not hide (what compression can
save). ``link_bytes`` is what one machine put on its shaped link per step (the veth's counter): every method
counted the same way, PyTorch's hooks included.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from dgc.bench.common import BenchError, log
from dgc.bench.emulated import NodeLink, e2e_config, setup_record, summarize

#: the methods of this harness, in output order
DDP_METHODS = ("local", "ddp", "ddp_bf16", "ddp_powersgd1", "ddp_powersgd4", "dgc", "dgc_overlap")
DEFAULT_DDP_METHODS = ",".join(DDP_METHODS)


class Method:
    """One method's model, DDP wrapper, hook and optimizer."""

    def __init__(self, name: str, model: torch.nn.Module, warmup: int) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        import dgc
        from dgc.bench.common import configuration

        self.name = name
        self.model = copy.deepcopy(model)
        self.sync: dgc.GradientSync | None = None
        self.net: torch.nn.Module = self.model
        if name == "local":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
            return
        # PyTorch's PowerSGD hook issues its second and third collectives from future callbacks; under gloo with
        # several buckets the ranks then issued them in different orders (gloo: "Received data size doesn't match
        # expected size", found running this bench; the hook's tests skip gloo: pytorch/pytorch#58467): it gets one
        # bucket, the whole gradient, and so no overlap
        one_bucket = sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20 + 1
        self.net = DDP(self.model, bucket_cap_mb=one_bucket) if name.startswith("ddp_powersgd") else DDP(self.model)
        if name.startswith("dgc"):
            spec = configuration("dgc")
            self.sync = dgc.GradientSync(self.model, dgc.build_compressor(spec.compression),
                                         overlap=name == "dgc_overlap")  # fmt: skip
            self.net.register_comm_hook(self.sync, dgc.ddp_comm_hook)
            self.optimizer = dgc.SGD(self.model.parameters(), self.sync, lr=0.01, momentum=0.9)
            return
        if name == "ddp_bf16":
            self.net.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name.startswith("ddp_powersgd"):
            rank = int(name.removeprefix("ddp_powersgd"))
            state = psgd.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=rank,
                                       start_powerSGD_iter=max(2, warmup), min_compression_rate=2)  # fmt: skip
            self.net.register_comm_hook(state, psgd.powerSGD_hook)
        elif name != "ddp":
            raise BenchError(f"unknown method {name!r}; valid: {', '.join(DDP_METHODS)}")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, loss_fn: Any, batch: Any) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss_fn(self.net, batch).backward()
        self.optimizer.step()


def run_ddp_e2e(args: Any, methods: list[str], info: Any) -> dict[str, Any]:
    """The rank side: every method's steps, interleaved; rank 0 gets the summary."""
    import torch.distributed as dist

    from dgc.comm import Comm
    from dgc.repro.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="dgc-e2e-") as tmp:  # never written: the run is not opened
        trainer = Trainer(e2e_config("local", args.batch_size, args.seed, os.path.join(tmp, "r")), info,
                          comm=Comm.local())  # fmt: skip
    batches = trainer.task.train_batches(0)
    numel = sum(p.numel() for p in trainer.model.parameters())
    built: dict[str, Method] = {}
    errors: dict[str, str] = {}
    for name in methods:
        try:
            built[name] = Method(name, trainer.model, args.warmup)
        except Exception as exc:  # noqa: BLE001 - a method PyTorch refuses here is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if info.is_main:
        log(f"cluster e2e (DDP): fmnist_wide {numel} parameters, batch {args.batch_size} per rank, at {args.rate}, "
            f"methods {list(built)}" + (f"; failed to build: {errors}" if errors else ""))  # fmt: skip
    link = NodeLink()
    records: dict[str, list[dict[str, float]]] = {m: [] for m in built}
    sent: dict[str, int] = {}
    live = list(built)
    for step in range(args.warmup + args.steps):
        batch = next(batches)
        order = live[step % len(live) :] + live[: step % len(live)]
        for name in order:
            dist.barrier()
            before = link.sent()
            t0 = time.perf_counter()
            built[name].step(trainer.task.loss, batch)
            wall = time.perf_counter() - t0
            dist.barrier()  # every rank has sent what it sends
            if built[name].sync is not None:
                sent[name] = built[name].sync.last.sent_bytes
            if step >= args.warmup:
                records[name].append({"step_s": wall, "link_bytes": float(link.sent() - before)})
        if info.is_main:
            log(f"  step {step + 1}/{args.warmup + args.steps}" + (" (warm-up)" if step < args.warmup else ""))
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, {"records": records, "measures": link.measures})
    summary = summarize([g["records"] for g in gathered], live, ["step_s"])
    local = summary.get("local", {}).get("step_s")
    nodes = [g for g in gathered if g["measures"]]
    for name in live:
        row = summary[name]
        per_node = [statistics.median(r["link_bytes"] for r in g["records"][name]) for g in nodes]
        row["link_bytes"] = statistics.mean(per_node) if per_node else None
        row["dense_bytes"] = numel * 4
        row["sent_bytes"] = sent.get(name)
        row["exposed_s"] = row["step_s"] - local if local is not None else None
        row["step_over_local"] = row["step_s"] / local if local else None
    for name, error in errors.items():
        summary[name] = {"error": error}
    ddp = summary.get("ddp", {}).get("exposed_s")
    for name in live:
        exposed = summary[name]["exposed_s"]
        summary[name]["exposed_vs_ddp"] = exposed / ddp if ddp and exposed is not None else None
    return {
        "mode": "e2e-ddp",
        "task": "fmnist_wide",
        "model": "fmnist_wide (conv 1-64-128, fc 6272-2048-2048-10)",
        "numel": numel,
        "batch_size_per_rank": args.batch_size,
        "ddp_bucket_cap_mb": 25,
        **setup_record(args, info),
        "methods": summary,
    }


def comm_ratio(result: dict[str, Any]) -> float:
    """DDP fp32's exposed communication over the compute-only step, in a result of :func:`run_ddp_e2e`."""
    rows = result["methods"]
    if "exposed_s" not in rows.get("ddp", {}) or "step_s" not in rows.get("local", {}):
        raise BenchError("the calibration needs the methods local and ddp")
    return max(rows["ddp"]["exposed_s"], 1e-6) / rows["local"]["step_s"]


def plot_exposed(result: dict[str, Any], path: Any) -> Any:
    """Exposed communication per method (bars), one panel per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dgc import atomic

    runs = result["runs"] if result["mode"] == "e2e-ddp-ratios" else [result]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        rows = {m: r for m, r in run["methods"].items() if "exposed_s" in r and m != "local"}
        names = list(rows)
        values = [max(rows[m]["exposed_s"], 0.0) for m in names]
        ax.barh(range(len(names)), values, color=["tab:gray" if m.startswith("ddp") else "tab:blue" for m in names])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f} s", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values + [1e-3]) * 1.3)
        local = run["methods"]["local"]["step_s"]
        ratio = run.get("comm_ratio_target")
        title = f"{run['rate']}" + (f": DDP traffic ~{ratio:g}x compute" if ratio else "")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"exposed communication per step (s); compute-only step {local:.2f} s", fontsize=8)
    fig.suptitle(f"fmnist_wide, {runs[0]['nodes']} nodes, batch {runs[0]['batch_size_per_rank']}/rank", fontsize=10)
    fig.tight_layout()
    atomic.save_figure(path, fig, dpi=110)
    return path
