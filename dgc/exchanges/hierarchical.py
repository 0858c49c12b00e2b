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

from dgc.collectives import drive
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, copy_back
from dgc.compressors.sparse import SparseCompressor
from dgc.exchanges.base import EXCHANGES, Exchange
from dgc.localbus import LOCAL_BUSES, GroupBus, LocalBus, SharedMemoryBus, SharedMemoryError
from dgc.timing import Phases
from dgc.topology import Topology


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
    agreement: ClassVar[str] = "by_machine"

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
        #: the machine's bus (:mod:`dgc.localbus`): shared memory unless local_bus=group (auto falls back to the
        #: process group, on every rank of the machine alike, when shared memory fails or the tensors are not CPU's)
        self.bus: LocalBus = GroupBus(self.local)
        if local_bus != "group" and topology.ranks_per_node > 1:
            self.bus = SharedMemoryBus(self.local, topology.machine * topology.ranks_per_node)
        #: for the last list of whole tensors: (each rank's tensors, as indices; its padding; the shard size)
        self._whole: dict[tuple, tuple[list[list[int]], list[torch.Tensor | None], int]] = {}

    def agree_max_(self, flags: torch.Tensor) -> torch.Tensor:
        """The agreement by machine: the maximum inside the machine, then between the machines (each local rank's
        ring of M computes the same result): ``2 (M-1)`` network latencies, not the ``2 (N-1)`` of one allreduce
        over all N ranks, which a flat ring (gloo) pays at every step."""
        return self.cross.allreduce_max_(self.local.allreduce_max_(flags))

    def _mean_shard(self, key: str, items: list[Item], dtype: torch.dtype) -> torch.Tensor:
        """This rank's 1/R of the machine's mean of the items' flattened gradients (in ``dtype``), on the bus."""
        try:
            return self.bus.mean_shard(key, items, dtype)
        except SharedMemoryError as exc:
            if self.local_bus == "shm":
                if items[0].grad.device.type != "cpu":
                    raise ValueError(
                        f"sync.local_bus=shm is for CPU tensors, not {items[0].grad.device}: use auto or group"
                    ) from None
                raise
            if items[0].grad.device.type == "cpu":
                warnings.warn(f"{exc}; the machine's ranks use their process group instead", stacklevel=3)
            self.bus = GroupBus(self.local)
            return self.bus.mean_shard(key, items, dtype)

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        if not items:
            return
        if self.topology.ranks_per_node == 1:
            drive(compressor.steps(items, phases), self.cross)
            return
        if not compressor.shardable:
            self._run_whole(compressor, items, phases)
            return
        self._run_shards(compressor, items, phases, "sparse")

    def _run_shards(self, compressor: Compressor, items: list[Item], phases: Phases, key: str) -> None:
        """Each rank compresses its 1/R of the machine's mean between the machines; the machine's ranks then share
        the shards (``key`` names the bus's buffers)."""
        shard = self._mean_shard(key, items, items[0].grad.dtype)  # this rank's 1/R of the mean
        lo = self.topology.local_rank * shard.numel()
        drive(compressor.steps(_pieces(items, lo, lo + shard.numel(), shard), phases), self.cross)
        if isinstance(compressor, SparseCompressor):
            # the shard now holds its average over the machines: sparse (the union of M selections), so only its
            # nonzero entries need to reach the machine's other ranks
            whole = self.bus.share_sparse(key, shard, compressor.wire.indices)
        else:  # a dense result: the machine's ranks share the shards
            whole = self.bus.share(key, shard)
        with phases("decompress"):
            copy_back(items, whole.to(items[0].grad.dtype))

    def _run_whole(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        """For a compressor that needs whole tensors (PowerSGD): each rank of a machine owns whole tensors (the
        largest first, each to the rank with the fewest values so far), laid out owner by owner and padded to
        one shard size, so the reduce-scatter hands every rank exactly its tensors' machine mean."""
        laid, size = self._lay_out(items)
        shard = self._mean_shard("whole", laid, items[0].grad.dtype)
        lo = self.topology.local_rank * size
        shapes = {it.name: it.grad.shape for it in items}
        mine = [Item(it.name, it.param, it.grad.view(shapes[it.name]), it.momentum, it.nesterov)  # whole: its shape
                for it in _pieces(laid, lo, lo + size, shard) if it.name in shapes]  # fmt: skip
        drive(compressor.steps(mine, phases), self.cross)
        self._share("whole", shard, laid, phases)

    def _lay_out(self, items: list[Item]) -> tuple[list[Item], int]:
        """The items owner by owner (each owner's in their order), each owner's padded to the largest one's size.
        The owners are chosen once per list of tensors; the padding is zeros, never a tensor of the model."""
        key = tuple((it.name, it.grad.numel(), it.grad.dtype, it.grad.device) for it in items)
        plan = self._whole.get(key)
        if plan is None:
            r = self.topology.ranks_per_node
            owned: list[list[int]] = [[] for _ in range(r)]
            load = [0] * r
            for i in sorted(range(len(items)), key=lambda i: -items[i].grad.numel()):  # stable: ties keep order
                j = load.index(min(load))
                owned[j].append(i)
                load[j] += items[i].grad.numel()
            size = max(load)
            pads = [items[0].grad.new_zeros(size - load[j]) if load[j] < size else None for j in range(r)]
            plan = ([sorted(mine) for mine in owned], pads, size)
            self._whole = {key: plan}  # the last layout only
        owned, pads, size = plan
        laid: list[Item] = []
        for j, mine in enumerate(owned):
            laid += [items[i] for i in mine]
            if pads[j] is not None:
                laid.append(Item(f"@pad{j}", pads[j], pads[j]))
        return laid, size

    def dense(self, items: list[Item], phases: Phases, values: torch.dtype | Compressor) -> None:
        """The dense tensors too go by machine: reduce-scatter inside, then between machines an allreduce of the
        shards (R small rings sharing each link instead of one ring over all N ranks), or with a compressor of
        their own (1-bit) each shard compressed between the machines; allgather inside."""
        r = self.topology.ranks_per_node
        if r == 1 or not items:
            super().dense(items, phases, values)
            return
        if isinstance(values, Compressor):
            self._run_shards(values, items, phases, "dense")
            return
        shard = self._mean_shard("dense", items, values)
        self.cross.allreduce_mean_(shard)
        self._share("dense", shard, items, phases)

    def _share(self, key: str, shard: torch.Tensor, items: list[Item], phases: Phases) -> None:
        """Every rank of the machine gets every rank's (dense) shard, written back into the items' gradients."""
        whole = self.bus.share(key, shard)
        with phases("decompress"):
            copy_back(items, whole.to(items[0].grad.dtype))
