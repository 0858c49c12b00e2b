"""What the shared trainer needs from a task, and a deterministic sharded sampler.

A task builds its model and data, turns a batch into a loss and evaluates. The
trainer owns everything else (distribution, compression, schedules, logging,
checkpoints), so the same loop runs every experiment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dgc import seeding
from dgc.distributed import DistInfo

if TYPE_CHECKING:
    from dgc.repro.config import Config  # a type only: dgc.repro imports the tasks, not the other way round


class DataError(ValueError):
    """Missing or malformed data (the message says where data is expected and how to get it)."""


class Task:
    """Base class. ``metric`` names the headline evaluation metric; ``higher_is_better`` orders it."""

    metric: str = "loss"
    higher_is_better: bool = False

    def __init__(self, cfg: Config, info: DistInfo):
        self.cfg, self.info = cfg, info
        cfg.data.root = os.path.expanduser(cfg.data.root)  # a root from a YAML file may start with ~

    def check(self) -> None:
        """Raise a ValueError with one line when the task cannot run (e.g. data missing)."""

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def batches_per_epoch(self) -> int:
        """Micro-batches each worker sees per epoch."""
        raise NotImplementedError

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The worker's micro-batches of ``epoch`` from number ``start`` on (deterministic per epoch)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def start_epoch(self, model: nn.Module, epoch: int) -> None:
        """Hook for per-epoch state (e.g. recurrent hidden state)."""

    #: the task has a validation split apart from the test split (what ``evaluate(test=False)`` reads)
    has_validation: bool = False

    def evaluate(self, model: nn.Module, test: bool = True) -> dict[str, float]:
        """Metrics on the evaluation sets, averaged over all workers' shards; ``test=False``: the validation
        split's only (for tasks with :attr:`has_validation`)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This worker's task state carried across batches (e.g. recurrent hidden state), checkpointed per rank."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` when a run resumes."""


def shard_indices(num_items: int, info: DistInfo, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """This worker's example indices for ``epoch``: one permutation shared by all workers, split by rank.

    Every worker gets the same count (the tail that does not divide evenly is dropped).
    """
    if shuffle:
        gen = torch.Generator().manual_seed(seeding.mix(seed, epoch, multiplier=100_003))
        order = torch.randperm(num_items, generator=gen)
    else:
        order = torch.arange(num_items)
    per_worker = num_items // info.world_size
    return order[info.rank * per_worker : (info.rank + 1) * per_worker]
