"""The exchange every other one builds on, and the paper's: ``flat``.

An exchange decides how the compressed tensors travel between workers: it drives a compressor's
:meth:`~dgc.compressors.base.Compressor.steps` and runs every collective they yield on the communicator it
chooses (:mod:`dgc.collectives`), and averages the tensors the policy leaves dense. ``flat``: every worker
allgathers every other worker's message; each receives N messages of about k entries, so the traffic per worker
grows with N.

Local clipping is per rank in every exchange (``clip_norm * sqrt(N)``, N the number of ranks): the average of
a machine's R clipped gradients then has about the norm one machine-sized worker clipped at
``clip_norm * sqrt(M)`` would have.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dgc.bucket import Buckets
from dgc.collectives import drive
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item
from dgc.compressors.dense import allreduce_dense
from dgc.packing import Rider, carry_rider
from dgc.registry import Registry
from dgc.timing import Phases

#: the exchanges by name (each class registers itself)
EXCHANGES: Registry[type[Exchange]] = Registry("exchange")


@EXCHANGES.register
class Exchange:
    """Runs a compressor's exchange of the compressed tensors over some communicators (``flat``: the paper's)."""

    name: ClassVar[str] = "flat"
    #: how :meth:`agree_max_` reaches every worker: ``"flat"``, one allreduce over all of them; ``"by_machine"``
    #: (the cost models price the two apart; the cluster bench records it with each measurement)
    agreement: ClassVar[str] = "flat"

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
        """Exchange the compressed tensors: the compressor's steps, every collective on all the workers."""
        drive(compressor.steps(items, phases), self.comm)

    def dense(self, items: list[Item], phases: Phases, values: torch.dtype | Compressor) -> None:
        """Average the tensors the policy leaves dense (biases, BatchNorm) in their format: one allreduce in a dtype,
        or through a compressor of their own (1-bit with error feedback: its collectives on all the workers)."""
        if isinstance(values, Compressor):
            values.exchange(items, self.comm, phases)
        else:
            allreduce_dense(items, self.comm, phases, values, self.buckets)

    def agree_max_(self, flags: torch.Tensor) -> torch.Tensor:
        """The step's agreement (:mod:`dgc.sync.agreement`): ``flags``, in place, the element-wise maximum over every
        worker; one small allreduce over all of them."""
        return self.comm.allreduce_max_(flags)

    def run_packed(self, compressor: Compressor, items: list[Item], rider: Rider) -> torch.Tensor | None:
        """:meth:`run` with ``rider`` (the values left dense, the agreement's flags) in the compressor's first
        collective that can carry it (:mod:`dgc.packing`); ``flat`` only (``sync.pack``). Returns the mean of the
        flags the rider carried over the workers (None: it carried none)."""
        drive(carry_rider(compressor.steps(items, rider.phases), rider), self.comm)
        return rider.agreed
