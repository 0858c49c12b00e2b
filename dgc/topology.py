"""Which ranks share a machine: the process groups a two-level exchange uses.

Ranks are laid out machine by machine (torchrun, and Slurm's default block distribution, give a
machine consecutive ranks): machine ``m`` holds ranks ``m * R ... m * R + R - 1``, ``R`` ranks per
machine. Two kinds of groups:

* ``local``: the ranks of this machine (a fast bus: NVLink, PCIe, shared memory);
* ``cross``: the ranks with this rank's local index on every machine (one per machine, over the network).

``R`` comes from the caller, else from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun),
``SLURM_NTASKS_PER_NODE`` (Slurm; an unhomogeneous ``2(x3),1`` form is refused), else 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


def ranks_per_node_from_env() -> int:
    """R from the launcher's environment (1 when it says nothing)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r}: the machines hold different numbers of ranks")
            return int(value)
    return 1


@dataclass
class Topology:
    """This rank's place: ``world_size = machines * ranks_per_node``; groups are None for a group of one."""

    rank: int
    world_size: int
    ranks_per_node: int
    local: dist.ProcessGroup | None = None
    cross: dist.ProcessGroup | None = None

    @property
    def machines(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def machine(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @classmethod
    def build(cls, ranks_per_node: int | None = None) -> Topology:
        """The groups of the default process group (every rank must call this, in the same order)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        r = ranks_per_node or ranks_per_node_from_env()
        if r < 1 or world % r:
            raise ValueError(f"ranks_per_node must divide the world size {world}, got {r}")
        topo = cls(rank, world, r)
        if world == 1:
            return topo
        # dist.new_group must be called by every rank for every group, in the same order
        for m in range(world // r):
            group = dist.new_group(list(range(m * r, (m + 1) * r))) if r > 1 else None
            if m == topo.machine:
                topo.local = group
        if r == 1:  # one rank per machine: the machines are the world
            topo.cross = dist.group.WORLD
            return topo
        for i in range(r):
            group = dist.new_group(list(range(i, world, r))) if world // r > 1 else None
            if i == topo.local_rank:
                topo.cross = group
        return topo
