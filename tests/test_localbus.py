"""The local buses of dgc.localbus in one process (their multi-rank behaviour: tests/test_exchange.py)."""

from __future__ import annotations

import pytest
import torch

from dgc.comm import Comm
from dgc.compressors.base import Item
from dgc.localbus import GroupBus, SharedMemoryBus, SharedMemoryError


def items(device: str = "cpu") -> list[Item]:
    a, b = torch.arange(5.0, device=device), torch.zeros(2, 2, device=device)
    return [Item("a", a, a), Item("b", b, b)]


def test_a_group_bus_of_one_rank_is_the_flattened_tensors_and_shares_them_back():
    bus = GroupBus(Comm.local())
    shard = bus.mean_shard("k", items(), torch.float64)
    assert shard.dtype == torch.float64 and shard.tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0]
    shard[6] = 7.0
    assert bus.share("k", shard).tolist() == shard.tolist()
    assert bus.share_sparse("k", shard, "int32").tolist() == shard.tolist()  # only the nonzero entries travel


def test_shared_memory_refuses_tensors_that_are_not_on_the_cpu_before_any_collective():
    with pytest.raises(SharedMemoryError, match="for CPU tensors, not meta"):
        SharedMemoryBus(Comm.local(), 0).mean_shard("k", items("meta"), torch.float32)
