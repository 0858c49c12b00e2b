"""How a sparse compressor's selection travels between workers: ``flat``, ``hierarchical``, ``sparse_allreduce``.

* ``flat`` (the paper's, the default): every worker allgathers every other worker's message; each
  receives N messages of about k entries, so the traffic per worker grows with N.
* ``hierarchical``: the ranks of a machine first average their gradients densely over the fast local
  bus (a reduce-scatter: local rank i owns the i-th 1/R of the flattened compressed tensors), each
  owner runs the compressor on its shard (momentum and residual live there; the selection cost is split
  R ways) and exchanges it with the owners of the same shard on the other machines (a ``flat``
  exchange among M machines), and the ranks of a machine share the result: a sparse compressor's nonzero
  entries (an allgather of about M * k / R entries per rank, not of the dense shard), any other
  compressor's dense shard (the dense, fp16, TernGrad and QSGD compressors work on any part of a tensor).
  A compressor that needs whole tensors (PowerSGD: ``Compressor.shardable`` is False) gets whole tensors
  instead: each rank of a machine owns some of them (balanced by size), the shards padded to one size. Each machine
  is one DGC worker: the network carries M messages per shard instead of M * R. The tensors left dense
  (biases, BatchNorm) go the same way: reduce-scatter inside, an allreduce of each shard between the
  machines, allgather inside. With one rank per machine it is exactly ``flat``. The local bus
  (``local_bus``): the machine's process group (NCCL on GPUs; gloo sends TCP over loopback), or for CPU
  tensors shared memory (:mod:`dgc.localbus`; ``auto``, the default, picks it when it works), where the
  ranks read each other's shards instead of sending them.
* ``sparse_allreduce`` (after Ok-Topk, Li & Hoefler 2022): the flat index space of the compressed
  tensors is cut into N regions, one per worker, with boundaries that follow where the previous step's
  result fell (so every worker owns about as many entries). Every worker sends each owner the entries
  it selected in that owner's region (an all-to-all), each owner sums what it received, keeps the
  largest ``density`` of its region and shares them (an allgather), and every worker returns the values
  it sent that were not kept to its residual: nothing is lost, only delayed (with momentum correction the
momentum of a returned entry stays masked, as when it was sent). Each worker sends and
  receives about 2k entries whatever N. Aggregation differs from ``flat``: the result holds about k
  entries, the largest of the *sum* of the selections, where ``flat`` applies the union of all N
  selections (up to N * k entries).

Local clipping is per rank in all three (``clip_norm * sqrt(N)``, N the number of ranks): the average of
a machine's R clipped gradients then has about the norm one machine-sized worker clipped at
``clip_norm * sqrt(M)`` would have.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from dgc import wire
from dgc.bucket import Buckets
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, copy_back
from dgc.compressors.dense import allreduce_dense
from dgc.compressors.sparse import SparseCompressor
from dgc.localbus import LOCAL_BUSES, SharedMemoryBus, SharedMemoryError
from dgc.registry import Registry
from dgc.select import target_count
from dgc.timing import Phases
from dgc.topology import Topology

#: the exchanges by name (each class registers itself)
EXCHANGES: Registry[type[Exchange]] = Registry("exchange")


@EXCHANGES.register
class Exchange:
    """Runs a compressor's exchange of the compressed tensors over some communicators (``flat``: the paper's)."""

    name: ClassVar[str] = "flat"

    def __init__(self, comm: Comm):
        self.comm = comm
        self.buckets = Buckets()

    @classmethod
    def build(cls, comm: Comm, ranks_per_node: int | None, local_bus: str) -> Exchange:
        """This exchange over ``comm``'s workers, from the options every exchange is given."""
        return cls(comm)

    def check(self, compressor: Compressor) -> None:
        """Refuse a compressor this exchange cannot carry (ValueError naming what can)."""

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        compressor.exchange(items, self.comm, phases)

    def dense(self, items: list[Item], phases: Phases, dtype: torch.dtype) -> None:
        """Average the tensors the policy leaves dense (biases, BatchNorm): one allreduce in ``dtype``."""
        allreduce_dense(items, self.comm, phases, dtype, self.buckets)


def _flatten(items: list[Item], multiple: int) -> torch.Tensor:
    flat = torch.cat([it.grad.view(-1) for it in items])
    pad = -flat.numel() % multiple
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _pieces(items: list[Item], lo: int, hi: int, shard: torch.Tensor) -> list[Item]:
    """Items for the part of every tensor that falls in ``[lo, hi)`` of the flat space, as views of ``shard``.
    A whole tensor keeps its name (so one rank per machine is exactly ``flat``); a part is ``name@start``."""
    out, start = [], 0
    for it in items:
        n = it.grad.numel()
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            name = it.name if (a, b) == (start, start + n) else f"{it.name}@{a - start}"
            out.append(Item(name, it.param, shard[a - lo : b - lo], it.momentum, it.nesterov))
        start += n
    return out


@EXCHANGES.register
class Hierarchical(Exchange):
    """Dense inside a machine, sparse between machines (see the module docstring)."""

    name: ClassVar[str] = "hierarchical"

    @classmethod
    def build(cls, comm: Comm, ranks_per_node: int | None, local_bus: str) -> Exchange:
        return cls(comm, Topology.build(ranks_per_node), local_bus)  # the topology's groups: every rank calls

    def __init__(self, comm: Comm, topology: Topology, local_bus: str = "auto"):
        super().__init__(comm)
        if local_bus not in LOCAL_BUSES:
            raise ValueError(f"sync.local_bus must be one of {', '.join(LOCAL_BUSES)}, got {local_bus!r}")
        self.topology = topology
        self.local = comm.sub(topology.local, local_bus=True)
        self.cross = comm.sub(topology.cross)
        self.local_bus = local_bus
        #: the machine's shared-memory bus while it is used (None: its process group)
        self.bus: SharedMemoryBus | None = None
        if local_bus != "group" and topology.ranks_per_node > 1:
            self.bus = SharedMemoryBus(self.local, topology.machine * topology.ranks_per_node)

    def _mean_shard(self, key: str, items: list[Item], dtype: torch.dtype, phases: Phases) -> torch.Tensor:
        """This rank's 1/R of the machine's mean of the items' flattened gradients (in ``dtype``): through shared
        memory for CPU tensors unless local_bus=group (auto falls back to the group, on every rank of the machine
        alike, when it fails), where the shard is a view of the shared result (see :mod:`dgc.localbus`)."""
        device = items[0].grad.device
        if self.bus is not None and device.type != "cpu":
            if self.local_bus == "shm":
                raise ValueError(f"sync.local_bus=shm is for CPU tensors, not {device}: use auto or group")
            self.bus = None
        r = self.topology.ranks_per_node
        if self.bus is not None:
            total = sum(it.grad.numel() for it in items)
            try:
                slot = self.bus.slot(key, total + (-total % r), dtype)
            except SharedMemoryError as exc:
                if self.local_bus == "shm":
                    raise
                warnings.warn(f"{exc}; the machine's ranks use their process group instead", stacklevel=3)
                self.bus = None
            else:
                with phases("compress"):  # the flattening copy, straight into shared memory
                    pos = 0
                    for it in items:
                        n = it.grad.numel()
                        slot[pos : pos + n].copy_(it.grad.view(-1))
                        pos += n
                    slot[pos:].zero_()
                return self.bus.reduce_scatter_mean(key)
        with phases("compress"):
            flat = _flatten(items, r).to(dtype)
        return self.local.reduce_scatter_mean(flat)

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        r = self.topology.ranks_per_node
        if not items:
            return
        if r == 1:
            compressor.exchange(items, self.cross, phases)
            return
        if not compressor.shardable:
            self._run_whole(compressor, items, phases)
            return
        shard = self._mean_shard("sparse", items, items[0].grad.dtype, phases)  # this rank's 1/R of the mean
        lo = self.topology.local_rank * shard.numel()
        compressor.exchange(_pieces(items, lo, lo + shard.numel(), shard), self.cross, phases)
        if not isinstance(compressor, SparseCompressor):  # a dense result: the machine's ranks share the shards
            self._share("sparse", shard, items, phases)
            return
        if self.bus is not None:  # the machine's ranks read each other's averaged shards from shared memory
            whole = self.bus.share("sparse")
            with phases("decompress"):
                copy_back(items, whole)
            return
        flat = shard.new_empty(shard.numel() * r)
        # the shard now holds its average over the machines: sparse (the union of M selections), so the
        # ranks of a machine share its nonzero entries (fp32, exact) rather than the dense shard
        with phases("compress"):
            pos = shard.nonzero().view(-1)
            fmt = wire.WireFormat("fp32", compressor.wire.indices)
            message = wire.encode([shard[pos]], [pos], fmt, [shard.numel()])
        rows, lengths = self.local.allgather_bytes(message)
        with phases("decompress"):
            flat.zero_()
            for j in range(rows.shape[0]):
                start = torch.tensor([j * shard.numel()], device=flat.device)
                at, values = wire.decode(rows[j, : lengths[j]], start, fmt)
                flat[at] = values.to(flat.dtype)
            copy_back(items, flat)

    def _run_whole(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        """For a compressor that needs whole tensors (PowerSGD): each rank of a machine owns whole tensors (the
        largest first, each to the rank with the fewest values so far), laid out owner by owner and padded to
        one shard size, so the reduce-scatter hands every rank exactly its tensors' machine mean."""
        r = self.topology.ranks_per_node
        owned: list[list[Item]] = [[] for _ in range(r)]
        load = [0] * r
        for it in sorted(items, key=lambda it: -it.grad.numel()):  # stable: ties keep their order
            j = load.index(min(load))
            owned[j].append(it)
            load[j] += it.grad.numel()
        order = {it.name: i for i, it in enumerate(items)}
        size = max(load)
        laid: list[Item] = []
        pads: list[Item] = []
        for j, mine in enumerate(owned):
            laid += sorted(mine, key=lambda it: order[it.name])
            if load[j] < size:  # zeros up to the shard size: not a tensor of the model, never exchanged
                pad = items[0].grad.new_zeros(size - load[j])
                pads.append(Item(f"@pad{j}", pad, pad))
                laid.append(pads[-1])
        shard = self._mean_shard("whole", laid, items[0].grad.dtype, phases)
        lo = self.topology.local_rank * size
        shapes = {it.name: it.grad.shape for it in items}
        mine = [Item(it.name, it.param, it.grad.view(shapes[it.name]), it.momentum, it.nesterov)  # whole: its shape
                for it in _pieces(laid, lo, lo + size, shard) if it.name in shapes]  # fmt: skip
        compressor.exchange(mine, self.cross, phases)
        self._share("whole", shard, laid, phases)

    def dense(self, items: list[Item], phases: Phases, dtype: torch.dtype) -> None:
        """The dense tensors too go by machine: reduce-scatter inside, allreduce of the shards between machines
        (R small rings sharing each link instead of one ring over all N ranks), allgather inside."""
        r = self.topology.ranks_per_node
        if r == 1 or not items:
            super().dense(items, phases, dtype)
            return
        shard = self._mean_shard("dense", items, dtype, phases)
        self.cross.allreduce_mean_(shard)
        self._share("dense", shard, items, phases)

    def _share(self, key: str, shard: torch.Tensor, items: list[Item], phases: Phases) -> None:
        """Every rank of the machine gets every rank's (dense) shard, written back into the items' gradients."""
        whole = self.bus.share(key) if self.bus is not None else self.local.allgather(shard).view(-1)
        with phases("decompress"):
            copy_back(items, whole.to(items[0].grad.dtype))


@EXCHANGES.register
class SparseAllreduce(Exchange):
    """Regions of the index space reduced at their owners, re-sparsified, shared (see the module docstring)."""

    name: ClassVar[str] = "sparse_allreduce"

    def __init__(self, comm: Comm):
        super().__init__(comm)
        self.bounds: torch.Tensor | None = None  # region boundaries in the flat space, N + 1 of them

    def check(self, compressor: Compressor) -> None:
        if not isinstance(compressor, SparseCompressor):
            raise ValueError(
                f"exchange=sparse_allreduce is for the sparse compressors (dgc, topk), not {compressor.name!r}"
            )

    def _regions(self, total: int, n: int, device: torch.device) -> torch.Tensor:
        if self.bounds is None or int(self.bounds[-1]) != total or self.bounds.numel() != n + 1:
            self.bounds = torch.linspace(0, total, n + 1, device=device).round().to(torch.int64)
        return self.bounds

    def _rebalance(self, kept: torch.Tensor, total: int, n: int) -> None:
        """Boundaries at the quantiles of the positions just kept (known to every worker: all agree)."""
        if kept.numel() < 2 * n:
            return
        q = torch.quantile(kept.double(), torch.linspace(0, 1, n + 1, dtype=torch.float64, device=kept.device)[1:-1])
        inner = q.round().to(torch.int64).clamp_(1, total - 1)
        self.bounds = torch.cat([inner.new_zeros(1), inner, inner.new_tensor([total])])

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        assert isinstance(compressor, SparseCompressor)
        comm, n = self.comm, self.comm.world_size
        if not items:
            return
        if not comm.collective:
            compressor.exchange(items, comm, phases)
            return
        device = items[0].grad.device
        sizes = torch.tensor([it.grad.numel() for it in items], dtype=torch.int64, device=device)
        offsets = torch.cumsum(sizes, 0) - sizes
        total = int(sizes.sum())
        with phases("compress"):
            positions, values, accumulators = compressor.pick(items, phases)
            # ascending flat positions: the tensors in order, each one's positions ascending
            flat_pos = torch.cat([p + o for p, o in zip(positions, offsets.tolist())])
            flat_val = torch.cat(values).float()
            bounds = self._regions(total, n, device)
            owner = torch.searchsorted(bounds, flat_pos, right=True) - 1
            counts = torch.bincount(owner, minlength=n).tolist()  # ascending positions: already by owner
            records = _pack(flat_pos, flat_val.to(compressor.wire.value_dtype), total)
        got, _ = comm.all_to_all(records.view(-1), [c * records.shape[1] for c in counts])
        with phases("compress"):
            got_pos, got_val = _unpack(got.view(-1, records.shape[1]), compressor.wire.value_dtype)
            lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
            uniq, inverse = torch.unique(got_pos, return_inverse=True)
            summed = torch.zeros(uniq.numel(), dtype=torch.float32, device=device).index_add_(
                0, inverse, got_val.float()
            )
            keep = min(uniq.numel(), target_count(hi - lo, compressor.density()) if hi > lo else 0)
            top = torch.topk(summed.abs(), keep, sorted=False).indices.sort().values if keep < uniq.numel() else None
            kept_pos = uniq if top is None else uniq[top]
            kept_val = (summed if top is None else summed[top]).div_(n)
            # the sums go in fp32: a 16-bit rounding here would have no residual to stay in
            fmt = wire.WireFormat("fp32", compressor.wire.indices)
            message = wire.encode([kept_val], [kept_pos - lo], fmt, [max(hi - lo, 1)])
        rows, lengths = comm.allgather_bytes(message)
        with phases("decompress"):
            parts = [wire.decode(rows[r, : lengths[r]], bounds[r : r + 1], fmt) for r in range(rows.shape[0])]
            all_pos = torch.cat([p for p, _ in parts])  # ascending: the regions in order, each one ascending
            all_val = torch.cat([v for _, v in parts])
            grads = [it.grad.view(-1) for it in items]
            torch._foreach_zero_(grads)
            _scatter_sorted(grads, offsets, all_pos, all_val)
            # what this worker sent that no owner kept goes back to its residual
            at = torch.searchsorted(all_pos, flat_pos).clamp_(max=max(all_pos.numel() - 1, 0))
            lost = all_pos[at] != flat_pos if all_pos.numel() else torch.ones_like(flat_pos, dtype=torch.bool)
            if bool(lost.any()):
                _scatter_sorted(accumulators, offsets, flat_pos[lost], flat_val[lost], add=True)
            phases.counters["values_returned"] += int(lost.sum())
            self._rebalance(all_pos, total, n)


def _pack(pos: torch.Tensor, val: torch.Tensor, total: int) -> torch.Tensor:
    """One record per entry, ``[position (int32, or int64 past 2**31 entries) | value]`` as bytes: ``[n, width]``."""
    index_dtype = torch.int32 if total < 2**31 else torch.int64
    return torch.cat([pos.to(index_dtype).view(torch.uint8).view(pos.numel(), -1),
                      val.contiguous().view(torch.uint8).view(val.numel(), -1)], dim=1)  # fmt: skip


def _unpack(records: torch.Tensor, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (int64) and values of :func:`_pack`'s records."""
    vbytes = value_dtype.itemsize
    index_dtype = torch.int32 if records.shape[1] - vbytes == 4 else torch.int64
    pos = records[:, :-vbytes].contiguous().view(index_dtype).view(-1).to(torch.int64)
    return pos, records[:, -vbytes:].contiguous().view(value_dtype).view(-1)


def _scatter_sorted(
    flats: list[torch.Tensor], offsets: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, add: bool = False
) -> None:
    """Write (or add) ``val`` at the ascending flat positions ``pos`` into the tensors starting at ``offsets``:
    each tensor's entries are one slice of ``pos`` (no pass over all entries per tensor)."""
    ends = torch.searchsorted(pos, torch.cat([offsets[1:], offsets.new_tensor([2**62])])).tolist()
    start = 0
    for t, flat in enumerate(flats):
        end = ends[t]
        if end > start:
            at = pos[start:end] - offsets[t]
            if add:
                flat.index_add_(0, at, val[start:end].to(flat.dtype))
            else:
                flat[at] = val[start:end].to(flat.dtype)
        start = end


def build_exchange(name: str, comm: Comm, ranks_per_node: int | None = None, local_bus: str = "auto") -> Exchange:
    """The exchange ``name`` over ``comm``'s workers (the topology's groups are made here: call on every rank);
    ``ranks_per_node`` and ``local_bus`` (:data:`dgc.localbus.LOCAL_BUSES`) are for ``hierarchical``."""
    return EXCHANGES.pick(name).build(comm, ranks_per_node, local_bus)


__all__ = ["EXCHANGES", "Exchange", "Hierarchical", "SparseAllreduce", "build_exchange"]
