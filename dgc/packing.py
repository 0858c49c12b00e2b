"""The values left dense (biases, BatchNorm) sent inside the compressor's own message: one collective fewer a step.

A sparse method exchanges its selection in one allgather, and the tensors its policy leaves dense in an allreduce
of their own (:func:`dgc.compressors.dense.allreduce_dense`). Each collective costs at least one network latency
per hop: a ring allreduce ``2 (N-1)``, an allgather ``N-1``. Between regions (tens of ms a message) that latency,
not the bytes, is the step: the projection of ``results/cpu-frontier-projection.md`` prices DGC's separate
allreduce at about 180 of its 270 ms of exchange on 4 workers at 30 ms.

:func:`carry_dense` rewrites a compressor's :meth:`~dgc.compressors.base.Compressor.steps` so that the dense values
ride in its first collective that can carry them, and every worker averages them from what it receives:

* :class:`~dgc.collectives.AllgatherBytes` (DGC's and top-k's variable-length message): the dense values' bytes
  go first in each worker's message; the compressor gets the rows without them;
* :class:`~dgc.collectives.Allgather` (chunk selection, DeMo, SparseLoCo, QSGD, TernGrad's codes): the same, in
  bytes, whatever the message's dtype; every worker sums the N copies in worker order (float32) and divides by N;
* :class:`~dgc.collectives.AllreduceMean` of the dense values' dtype (PowerSGD's P): appended to the tensor;
* anything else (TernGrad's maximum) is passed through; a compressor that yields no carrier gets the dense values'
  own allreduce after its last collective, as without packing.

The average is the same as the allreduce's up to rounding (a sum in another order), and every worker computes it
from the same rows in the same order, so the workers agree exactly. The bytes a worker sends are the same; what it
receives grows: an allgather brings the other ``N-1`` copies of the dense values (a ring allreduce about 2), so
packing pays where latency dominates (few workers, long links) and not on a fast LAN with many workers
(docs/performance.md). Only the ``flat`` exchange packs (``sync.pack_dense``); every tensor stays on the
gradients' device and no host value is read beyond those the carrier already reads.
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


def carry_dense(steps: Steps, items: list[Item], dtype: torch.dtype, bucket: Bucket, phases: Phases,
                fallback: Callable[[], Collective]) -> Steps:  # fmt: skip
    """``steps`` (a compressor's) with the average of ``items``' gradients (the values left dense, sent in ``dtype``
    and gathered in ``bucket``) carried in their first collective that can carry them (see the module docstring);
    ``fallback()``: the dense values' own collective, yielded after the last one when none could."""
    with phases("compress"):
        dense = bucket.gather(items).to(dtype)
    carried = False
    try:
        op: Collective | None = next(steps)
    except StopIteration:
        op = None
    while op is not None:
        packed = None if carried else carry(op, dense)
        if packed is None:
            result = yield op
        else:
            outer, split = packed
            got = yield outer
            with phases("decompress"):
                result, mean = split(got)
                bucket.scatter(items, mean)
            carried = True
        try:
            op = steps.send(result)
        except StopIteration:
            op = None
    if not carried:
        yield fallback()
