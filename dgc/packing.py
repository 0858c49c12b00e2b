"""What else a step sends, carried inside the compressor's own message: one or two collectives fewer a step.

A sparse method exchanges its selection in one allgather; the tensors its policy leaves dense go in an allreduce of
their own (:func:`dgc.compressors.dense.allreduce_dense`), and before either the workers agree in one more small
allreduce on whether any gradient is not finite and what was requested (:mod:`dgc.sync`). Each collective costs
at least one network latency per hop: a ring allreduce ``2 (N-1)``, an allgather ``N-1``. Between regions (tens of
ms a message) that latency, not the bytes, is the step: ``results/bench/frontier-projection.md`` prices each of the
two allreduces at 180 ms on 4 workers at 30 ms.

``sync.pack`` (:class:`~dgc.sync.GradientSync`'s ``pack``): ``dense`` carries the dense values in the compressor's
collectives, ``all`` the agreement's flags too. :func:`carry_rider` rewrites a compressor's
:meth:`~dgc.compressors.base.Compressor.steps` so that the :class:`Rider` (the dense values, then the flags as
values 0 or 1 of the same dtype) goes in its first collective that can carry it, and every worker averages it from
what it receives:

* :class:`~dgc.collectives.AllgatherBytes` (DGC's and top-k's variable-length message): the rider's bytes go first
  in each worker's message; the compressor gets the rows without them;
* :class:`~dgc.collectives.Allgather` (chunk selection, DeMo, SparseLoCo, QSGD, TernGrad's codes): the same, in
  bytes, whatever the message's dtype; every worker sums the N copies in worker order (float32) and divides by N;
* :class:`~dgc.collectives.AllreduceMean` of the rider's dtype (PowerSGD's P): appended to the tensor;
* anything else (TernGrad's maximum) is passed through; a compressor that yields no carrier gets the rider's own
  allreduce after its last collective.

The average is the same as the allreduce's up to rounding (a sum in another order), and every worker computes it
from the same rows in the same order, so the workers agree exactly; a flag's average is above 0 where any worker
raised it. The bytes a worker sends are the same; what it receives grows: an allgather brings the other ``N-1``
copies of the dense values (a ring allreduce about 2), so packing pays where latency dominates (few workers, long
links) and not on a slow LAN with many workers (docs/performance.md). With the agreement in the message the step
runs before the workers have agreed on it: :class:`~dgc.sync.GradientSync` copies the compression state first and
puts it back on every worker when any gradient was not finite (under the overlapped hook, each bucket's flags
ride in its own message and are read together at the step's end). Only the ``flat`` exchange packs; every tensor stays
on the gradients' device, and the flags are read on the host once, after the exchange, as the agreement's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dgc.bucket import Bucket
from dgc.collectives import Allgather, AllgatherBytes, AllreduceMean, Collective, Steps
from dgc.compressors.base import Item
from dgc.timing import Phases


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _columns(rows: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """A copy of ``rows[:, start:stop]`` with rows of their own length and no offset, whatever the slice (one row: a
    view would keep the old row stride), so that it can be viewed as any dtype."""
    return rows[:, start:stop].clone(memory_format=torch.contiguous_format)


def _mean_of_rows(rows: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Each row's leading bytes read as ``numel`` values of ``dtype``, averaged over the rows in float32."""
    nbytes = numel * dtype.itemsize
    values = _columns(rows, 0, nbytes).view(dtype)
    return values.to(torch.float32).sum(0).div_(rows.shape[0])


def carry(op: Collective, dense: torch.Tensor) -> tuple[Collective, Callable[[Any], tuple[Any, torch.Tensor]]] | None:
    """``op`` with ``dense`` (1-D) inside it, and how to split its result into ``op``'s own result and the average of
    every worker's ``dense``; None when ``op`` cannot carry it."""
    n = dense.numel()
    if isinstance(op, AllgatherBytes):
        packed = AllgatherBytes(torch.cat([_as_bytes(dense), op.message]))
        head = n * dense.element_size()

        def split_bytes(result: tuple[torch.Tensor, list[int]]) -> tuple[Any, torch.Tensor]:
            rows, lengths = result
            return (_columns(rows, head), [length - head for length in lengths]), _mean_of_rows(rows, dense.dtype, n)

        return packed, split_bytes
    if isinstance(op, Allgather):
        message = op.tensor
        head = n * dense.element_size()

        def split_rows(rows: torch.Tensor) -> tuple[Any, torch.Tensor]:
            own = _columns(rows, head).view(message.dtype).view(rows.shape[0], message.numel())
            return own, _mean_of_rows(rows, dense.dtype, n)

        return Allgather(torch.cat([_as_bytes(dense), _as_bytes(message)])), split_rows
    if isinstance(op, AllreduceMean) and op.tensor.dtype == dense.dtype and op.tensor.dim() == 1:
        tensor = op.tensor

        def split_mean(flat: torch.Tensor) -> tuple[Any, torch.Tensor]:
            tensor.copy_(flat[n:])  # the compressor may hold the tensor it yielded: averaged in place, as unpacked
            return tensor, flat[:n]

        return AllreduceMean(torch.cat([dense, tensor])), split_mean
    return None


class Rider:
    """What rides in the step's first collective that can carry it: the values left dense (``items``, sent in
    ``dtype`` through ``bucket``, None when there are none; their average is written into their gradients) and, with
    ``sync.pack=all``, the agreement's flags (:mod:`dgc.sync`: 0 or 1 each; :attr:`agreed` holds their mean over the
    workers, on the device, once they have travelled: above 0 where any worker raised one)."""

    def __init__(self, items: list[Item], dtype: torch.dtype, bucket: Bucket | None, flags: torch.Tensor | None,
                 phases: Phases) -> None:  # fmt: skip
        self.items, self.bucket, self.phases = items, bucket, phases
        with phases("compress"):
            parts = [bucket.gather(items).to(dtype)] if bucket is not None else []
            if flags is not None:
                parts.append(flags.to(dtype))
            self.tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.dense_numel = sum(it.grad.numel() for it in items)
        self.agreed: torch.Tensor | None = None

    def land(self, mean: torch.Tensor) -> None:
        """The average of every worker's rider: the dense values into their gradients, the flags kept."""
        with self.phases("decompress"):
            if self.bucket is not None:
                self.bucket.scatter(self.items, mean[: self.dense_numel])
            if mean.numel() > self.dense_numel:
                self.agreed = mean[self.dense_numel :]


def carry_rider(steps: Steps, rider: Rider) -> Steps:
    """``steps`` (a compressor's) with ``rider`` carried in their first collective that can carry it (see the module
    docstring); an allreduce of its own after their last collective when none could."""
    carried = False
    try:
        op: Collective | None = next(steps)
    except StopIteration:
        op = None
    while op is not None:
        packed = None if carried else carry(op, rider.tensor)
        if packed is None:
            result = yield op
        else:
            outer, split = packed
            got = yield outer
            with rider.phases("decompress"):
                result, mean = split(got)
            rider.land(mean)
            carried = True
        try:
            op = steps.send(result)
        except StopIteration:
            op = None
    if not carried:
        rider.land((yield AllreduceMean(rider.tensor)))
