"""The collectives a compressor asks for, and the loop that runs them: a compressor never holds a communicator.

A compressor's :meth:`~dgc.compressors.base.Compressor.steps` is a generator: it encodes its tensors into a
message, *yields* the collective it needs (one of the small classes below) and receives its result at the
``yield``, then decodes (PowerSGD yields twice: its Ps, then its Qs; TernGrad a maximum, then its codes). Whoever
drives the generator owns the collectives and picks the communicator: an :class:`~dgc.exchanges.Exchange` runs
them over every worker (``flat``), over the machines (``hierarchical``: the same compressor, the other
communicator), and later may start them without waiting (overlap with the backward pass). :func:`drive` is the
plain loop: each collective run at once, in order, on one :class:`~dgc.comm.Comm`::

    def steps(self, items, phases):
        message = encode(items)                # "compress"
        rows, lengths = yield AllgatherBytes(message)
        decode(items, rows, lengths)           # "decompress"

Every worker yields the same collectives in the same order (each a function of the tensors' sizes and the
step's agreed state, never of local values), as torch.distributed requires.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from dgc.comm import Comm

#: what a compressor's ``steps`` is: it yields collectives and receives each one's result
Steps = Generator["Collective", Any, None]


class Collective:
    """One collective a compressor needs; :meth:`run` performs it on a communicator and returns its result."""

    def run(self, comm: Comm) -> Any:
        raise NotImplementedError


@dataclass
class AllreduceMean(Collective):
    """Average ``tensor`` (1-D, any float dtype) over the workers, in place; the result is ``tensor``."""

    tensor: torch.Tensor

    def run(self, comm: Comm) -> torch.Tensor:
        return comm.allreduce_mean_(self.tensor)


@dataclass
class AllreduceMax(Collective):
    """Element-wise maximum of ``tensor`` over the workers, in place; the result is ``tensor``."""

    tensor: torch.Tensor

    def run(self, comm: Comm) -> torch.Tensor:
        return comm.allreduce_max_(self.tensor)


@dataclass
class Allgather(Collective):
    """Every worker's ``tensor`` (1-D, the same length everywhere): the result is ``[workers, len]``."""

    tensor: torch.Tensor

    def run(self, comm: Comm) -> torch.Tensor:
        return comm.allgather(self.tensor)


@dataclass
class AllgatherBytes(Collective):
    """Every worker's message (1-D uint8, any length): the result is ``(rows, lengths)``, worker r's message being
    ``rows[r, :lengths[r]]``."""

    message: torch.Tensor

    def run(self, comm: Comm) -> tuple[torch.Tensor, list[int]]:
        return comm.allgather_bytes(self.message)


def drive(steps: Steps, comm: Comm) -> None:
    """Run a compressor's steps to the end, each collective on ``comm`` as soon as it is yielded."""
    try:
        op = next(steps)
        while True:
            op = steps.send(op.run(comm))
    except StopIteration:
        pass


__all__ = ["Allgather", "AllgatherBytes", "AllreduceMax", "AllreduceMean", "Collective", "Steps", "drive"]
