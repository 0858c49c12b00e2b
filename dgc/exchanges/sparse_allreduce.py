"""``sparse_allreduce`` (after Ok-Topk, Li & Hoefler 2022): each worker owns a region of the index space.

The flat index space of the compressed tensors is cut into N regions, one per worker, with boundaries that
follow where the previous step's result fell (so every worker owns about as many entries). Every worker sends
each owner the entries it selected in that owner's region (an all-to-all), each owner sums what it received,
keeps the largest ``density`` of its region and shares them (an allgather), and every worker returns the values
it sent that were not kept to its residual: nothing is lost, only delayed (with momentum correction the
momentum of a returned entry stays masked, as when it was sent). Each worker sends and receives about 2k
entries whatever N. Aggregation differs from ``flat``: the result holds about k entries, the largest of the
*sum* of the selections, where ``flat`` applies the union of all N selections (up to N * k entries). For the
sparse compressors only (dgc, topk): it needs their selection (:meth:`SparseCompressor.pick`), not a message.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dgc import wire
from dgc.collectives import drive
from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item
from dgc.compressors.sparse import SparseCompressor
from dgc.exchanges.base import EXCHANGES, Exchange
from dgc.select import target_count
from dgc.timing import Phases


@EXCHANGES.register
class SparseAllreduce(Exchange):
    """Regions of the index space reduced at their owners, re-sparsified, shared (see the module docstring)."""

    name: ClassVar[str] = "sparse_allreduce"

    def __init__(self, comm: Comm):
        super().__init__(comm)
        self.bounds: torch.Tensor | None = None  # region boundaries in the flat space, N + 1 of them

    def check(self, compressor: Compressor) -> None:
        if not isinstance(compressor, SparseCompressor):
            raise ValueError(
                f"exchange=sparse_allreduce is for the sparse compressors (dgc, topk), not {compressor.name!r}"
            )
        if not compressor.picks_per_tensor:
            raise ValueError(
                "exchange=sparse_allreduce reduces selections tensor by tensor: not with compression.selection=chunk "
                "(use flat or hierarchical)"
            )

    def _regions(self, total: int, n: int, device: torch.device) -> torch.Tensor:
        if self.bounds is None or int(self.bounds[-1]) != total or self.bounds.numel() != n + 1:
            self.bounds = torch.linspace(0, total, n + 1, device=device).round().to(torch.int64)
        return self.bounds

    def _rebalance(self, kept: torch.Tensor, total: int, n: int) -> None:
        """Boundaries at the quantiles of the positions just kept (known to every worker: all agree)."""
        if kept.numel() < 2 * n:
            return
        q = torch.quantile(kept.double(), torch.linspace(0, 1, n + 1, dtype=torch.float64, device=kept.device)[1:-1])
        inner = q.round().to(torch.int64).clamp_(1, total - 1)
        self.bounds = torch.cat([inner.new_zeros(1), inner, inner.new_tensor([total])])

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        assert isinstance(compressor, SparseCompressor)
        comm, n = self.comm, self.comm.world_size
        if not items:
            return
        if not comm.collective:
            drive(compressor.steps(items, phases), comm)
            return
        device = items[0].grad.device
        sizes = torch.tensor([it.grad.numel() for it in items], dtype=torch.int64, device=device)
        offsets = torch.cumsum(sizes, 0) - sizes
        total = int(sizes.sum())
        with phases("compress"):
            positions, values, accumulators = compressor.pick(items, phases)
            # ascending flat positions: the tensors in order, each one's positions ascending
            flat_pos = torch.cat([p + o for p, o in zip(positions, offsets.tolist())])
            flat_val = torch.cat(values).float()
            bounds = self._regions(total, n, device)
            owner = torch.searchsorted(bounds, flat_pos, right=True) - 1
            counts = torch.bincount(owner, minlength=n).tolist()  # ascending positions: already by owner
            records = _pack(flat_pos, flat_val.to(compressor.wire.value_dtype), total)
        got, _ = comm.all_to_all(records.view(-1), [c * records.shape[1] for c in counts])
        with phases("compress"):
            got_pos, got_val = _unpack(got.view(-1, records.shape[1]), compressor.wire.value_dtype)
            lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
            uniq, inverse = torch.unique(got_pos, return_inverse=True)
            summed = torch.zeros(uniq.numel(), dtype=torch.float32, device=device).index_add_(
                0, inverse, got_val.float()
            )
            keep = min(uniq.numel(), target_count(hi - lo, compressor.density()) if hi > lo else 0)
            top = torch.topk(summed.abs(), keep, sorted=False).indices.sort().values if keep < uniq.numel() else None
            kept_pos = uniq if top is None else uniq[top]
            kept_val = (summed if top is None else summed[top]).div_(n)
            # the sums go in fp32: a 16-bit rounding here would have no residual to stay in
            fmt = wire.WireFormat("fp32", compressor.wire.indices)
            message = wire.encode([kept_val], [kept_pos - lo], fmt, [max(hi - lo, 1)])
        rows, lengths = comm.allgather_bytes(message)
        with phases("decompress"):
            parts = [wire.decode(rows[r, : lengths[r]], bounds[r : r + 1], fmt) for r in range(rows.shape[0])]
            all_pos = torch.cat([p for p, _ in parts])  # ascending: the regions in order, each one ascending
            all_val = torch.cat([v for _, v in parts])
            grads = [it.grad.view(-1) for it in items]
            torch._foreach_zero_(grads)
            _scatter_sorted(grads, offsets, all_pos, all_val)
            # what this worker sent that no owner kept goes back to its residual
            at = torch.searchsorted(all_pos, flat_pos).clamp_(max=max(all_pos.numel() - 1, 0))
            lost = all_pos[at] != flat_pos if all_pos.numel() else torch.ones_like(flat_pos, dtype=torch.bool)
            if bool(lost.any()):
                _scatter_sorted(accumulators, offsets, flat_pos[lost], flat_val[lost], add=True)
            phases.counters["values_returned"] += int(lost.sum())
            self._rebalance(all_pos, total, n)


def _pack(pos: torch.Tensor, val: torch.Tensor, total: int) -> torch.Tensor:
    """One record per entry, ``[position (int32, or int64 past 2**31 entries) | value]`` as bytes: ``[n, width]``."""
    index_dtype = torch.int32 if total < 2**31 else torch.int64
    return torch.cat([pos.to(index_dtype).view(torch.uint8).view(pos.numel(), -1),
                      val.contiguous().view(torch.uint8).view(val.numel(), -1)], dim=1)  # fmt: skip


def _unpack(records: torch.Tensor, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (int64) and values of :func:`_pack`'s records."""
    vbytes = value_dtype.itemsize
    index_dtype = torch.int32 if records.shape[1] - vbytes == 4 else torch.int64
    pos = records[:, :-vbytes].contiguous().view(index_dtype).view(-1).to(torch.int64)
    return pos, records[:, -vbytes:].contiguous().view(value_dtype).view(-1)


def _scatter_sorted(
    flats: list[torch.Tensor], offsets: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, add: bool = False
) -> None:
    """Write (or add) ``val`` at the ascending flat positions ``pos`` into the tensors starting at ``offsets``:
    each tensor's entries are one slice of ``pos`` (no pass over all entries per tensor)."""
    ends = torch.searchsorted(pos, torch.cat([offsets[1:], offsets.new_tensor([2**62])])).tolist()
    start = 0
    for t, flat in enumerate(flats):
        end = ends[t]
        if end > start:
            at = pos[start:end] - offsets[t]
            if add:
                flat.index_add_(0, at, val[start:end].to(flat.dtype))
            else:
                flat[at] = val[start:end].to(flat.dtype)
        start = end
