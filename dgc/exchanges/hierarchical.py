"""``hierarchical``: dense inside a machine, compressed between machines.

The ranks of a machine first average their gradients densely over the fast local bus (a reduce-scatter: local
rank i owns the i-th 1/R of the flattened compressed tensors), each owner runs the compressor on its shard
(momentum and residual live there; the selection cost is split R ways) and exchanges it with the owners of the
same shard on the other machines (the compressor's collectives run among the M machines), and the ranks of a
machine share the result: a sparse compressor's nonzero entries (an allgather of about M * k / R entries per
rank, not of the dense shard), any other compressor's dense shard (the dense, fp16, TernGrad and QSGD
compressors work on any part of a tensor). A compressor that needs whole tensors (PowerSGD:
``Compressor.shardable`` is False) gets whole tensors instead: each rank of a machine owns some of them
(balanced by size), the shards padded to one size. Each machine is one DGC worker: the network carries M
messages per shard instead of M * R. The tensors left dense (biases, BatchNorm) go the same way: reduce-scatter
inside, an allreduce of each shard between the machines, allgather inside. With one rank per machine it is
exactly ``flat``. The local bus (``local_bus``): the machine's process group (NCCL on GPUs; gloo sends TCP over
loopback), or for CPU tensors shared memory (:mod:`dgc.localbus`; ``auto``, the default, picks it when it
works), where the ranks read each other's shards instead of sending them.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from dgc import wire
from dgc.collectives import drive
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, copy_back
from dgc.compressors.sparse import SparseCompressor
from dgc.exchanges.base import EXCHANGES, Exchange
from dgc.localbus import LOCAL_BUSES, SharedMemoryBus, SharedMemoryError
from dgc.timing import Phases
from dgc.topology import Topology


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
            drive(compressor.steps(items, phases), self.cross)
            return
        if not compressor.shardable:
            self._run_whole(compressor, items, phases)
            return
        shard = self._mean_shard("sparse", items, items[0].grad.dtype, phases)  # this rank's 1/R of the mean
        lo = self.topology.local_rank * shard.numel()
        drive(compressor.steps(_pieces(items, lo, lo + shard.numel(), shard), phases), self.cross)
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
        drive(compressor.steps(mine, phases), self.cross)
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
