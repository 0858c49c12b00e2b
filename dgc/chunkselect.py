"""Chunk-wise fixed-k selection: the k largest ``|v|`` of every chunk of a flat buffer.

DGC's own selection (:mod:`dgc.segselect`) gives every tensor its k from a threshold estimated on a sample: the
number of entries that pass is known only after a comparison, so the message's size is read by the host (host
syncs on a GPU) and every entry's index is coded against its tensor. Chunk selection, as DeMo and SparseLoCo use
it, fixes the payload instead: the flattened tensors (a :class:`~dgc.bucket.Bucket`, padded with zeros to whole
chunks) are cut into chunks of ``chunk`` consecutive values and each chunk sends exactly its ``k`` largest
magnitudes (``k = density * chunk``, at least one). The message is ``k`` values and ``k`` 16-bit positions
within the chunk per chunk, the same size on every worker and every step at one density: one ``topk`` along the
rows of a ``[chunks, chunk]`` view, one fixed-size allgather, no threshold, no host read, no header.

What it gives up: k is spread evenly over the flat space, so a region of large gradients gets no more than any
other, and a chunk may span the end of one tensor and the start of the next (a small tensor shares its chunk's
k with its neighbours); DGC's threshold gives each tensor its own k. ``compression.selection=chunk``
(:class:`~dgc.compressors.dgc.DGC`) compares them on the same runs.
"""

from __future__ import annotations

import torch

#: the largest chunk whose positions fit 16 bits
MAX_CHUNK = 65536


def per_chunk(density: float, chunk: int) -> int:
    """Values each chunk sends at ``density``: ``round(density * chunk)``, at least 1, at most the chunk."""
    return max(1, min(chunk, round(density * chunk)))


def select(v: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``|v|`` of each chunk of ``v`` (1-D, its length a multiple of ``chunk``): ``(local, flat)``,
    ``local`` the positions within their chunks ``[chunks, k]`` (in no particular order), ``flat`` the same as
    positions in ``v`` (``[chunks * k]``, chunk after chunk)."""
    rows = v.view(-1, chunk)
    if k >= chunk:
        local = torch.arange(chunk, device=v.device).expand(rows.shape[0], chunk)
    else:
        local = rows.abs().topk(k, dim=1, sorted=False).indices
    base = torch.arange(0, v.numel(), chunk, device=v.device).view(-1, 1)
    return local, (local + base).view(-1)


def encode(values: torch.Tensor, local: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    """The message: the values in ``value_dtype``, then the positions within their chunks as 16-bit words."""
    vals = values.to(value_dtype).contiguous().view(torch.uint8)
    index = local.reshape(-1).to(torch.int32).to(torch.uint16).view(torch.uint8)
    return torch.cat([vals, index])


def decode_mean_into(out: torch.Tensor, rows: torch.Tensor, chunk: int, k: int, value_dtype: torch.dtype,
                     over: str = "workers") -> None:  # fmt: skip
    """Write into ``out`` (the flat buffer, zeroed here) the mean of every worker's message (``rows[r]``: worker
    r's, all of one size), worker after worker so that entries at one position sum in worker order; ``over``: see
    :func:`add_mean_into`."""
    workers, n = rows.shape[0], out.numel() // chunk * k
    width = value_dtype.itemsize * n
    # flat before the dtype views: one worker's row is a view whose row stride is the message's length, any number
    values = rows[:, :width].contiguous().view(-1).view(value_dtype).view(workers, n).to(out.dtype)
    local = rows[:, width:].contiguous().view(-1).view(torch.uint16).to(torch.int64).view(workers, -1, k)
    add_mean_into(out, values, local, chunk, over)


#: what :func:`add_mean_into` divides a position's sum by: every worker, or the workers that sent that position
MEAN_OVER = ("workers", "senders")


def add_mean_into(out: torch.Tensor, values: torch.Tensor, local: torch.Tensor, chunk: int,
                  over: str = "workers") -> None:  # fmt: skip
    """Write into ``out`` (zeroed here) the mean of every worker's ``values`` ``[workers, n]`` at their positions
    within the chunks ``local`` ``[workers, chunks, k]``, worker after worker (entries at one position sum in worker
    order). ``over="workers"``: each value divided by the number of workers (in place: a worker that did not send a
    position counts as a zero there); ``"senders"``: each position's sum divided by the number of workers that sent
    it (DeMo's code: ``scatter_reduce(..., "mean", include_self=False)``)."""
    workers = values.shape[0]
    positions = (local + torch.arange(0, out.numel(), chunk, device=out.device).view(1, -1, 1)).view(workers, -1)
    if workers > 1 and over == "workers":
        values.div_(workers)
    out.zero_()
    for r in range(workers):
        out.index_add_(0, positions[r], values[r])
    if workers > 1 and over == "senders":
        senders = torch.zeros_like(out)
        ones = torch.ones(positions.shape[1], dtype=out.dtype, device=out.device)
        for r in range(workers):
            senders.index_add_(0, positions[r], ones)
        out.div_(senders.clamp_(min=1))


__all__ = ["MAX_CHUNK", "MEAN_OVER", "add_mean_into", "decode_mean_into", "encode", "per_chunk", "select"]
