"""``densify``: ``flat`` while the selections are sparse enough, one dense allreduce of them when that sends less.

``flat`` allgathers every worker's selection: each worker receives N - 1 messages of about ``density * n``
entries, ``(N - 1) * density * n * b`` bytes (``b``: the bytes of an entry, its value and its index), however
dense their union is. A ring allreduce of the whole gradient moves ``2 (N - 1) / N * 4 n`` bytes in and out of
each worker whatever the density. During DGC's warm-up (densities of 25% and 6.25%) and on many workers the
allreduce is the cheaper one: at 8 workers above a density of ~19% (b = 6: fp32 values, 16-bit index gaps), at
64 workers above ~2.1%. This exchange picks per step the one that moves fewer bytes (SparCML, Renggli et al.
2019, switches the same way): the sparse compressor's selection is scattered into a zeroed dense buffer and
averaged with one allreduce. The choice depends on the density, the number of values and the number of workers
only, so every worker makes the same one. The result is ``flat``'s average (the allreduce sums in another order:
equal to rounding); the residuals keep what was not selected, as in ``flat``. For the sparse compressors only.
"""

from __future__ import annotations

from typing import ClassVar

from dgc.collectives import drive
from dgc.compressors.base import Compressor, Item
from dgc.compressors.sparse import SparseCompressor
from dgc.exchanges.base import EXCHANGES, Exchange
from dgc.timing import Phases


def entry_bytes(compressor: SparseCompressor) -> int:
    """About the bytes one selected entry takes in a message: its value and its index (``int32``: 4; the gap and
    bitmap codings: 2 or less, counted as 2)."""
    return compressor.wire.value_dtype.itemsize + (4 if compressor.wire.indices == "int32" else 2)


def dense_is_cheaper(workers: int, density: float, entry: int, value: int = 4) -> bool:
    """Whether a ring allreduce of ``value``-byte values moves fewer bytes per worker than the allgather of the
    selections at ``density`` (``entry`` bytes per selected value)."""
    return workers > 1 and 2 * value / workers < density * entry


@EXCHANGES.register
class Densify(Exchange):
    """``flat`` or a dense allreduce of the selections, whichever moves fewer bytes (see the module docstring)."""

    name: ClassVar[str] = "densify"

    def check(self, compressor: Compressor) -> None:
        if not isinstance(compressor, SparseCompressor):
            raise ValueError(f"exchange=densify is for the sparse compressors (dgc, topk), not {compressor.name!r}")
        if not compressor.picks_per_tensor:
            raise ValueError(
                "exchange=densify reduces selections tensor by tensor: not with compression.selection=chunk "
                "(use flat or hierarchical)"
            )

    def run(self, compressor: Compressor, items: list[Item], phases: Phases) -> None:
        assert isinstance(compressor, SparseCompressor)
        if not items:
            return
        if not dense_is_cheaper(self.comm.world_size, compressor.density(), entry_bytes(compressor)):
            drive(compressor.steps(items, phases), self.comm)
            return
        phases.counters["densified"] += 1
        with phases("compress"):
            positions, values, _ = compressor.pick(items, phases)
            bucket = self.buckets.of("densify", items)
            flat = bucket.grad.zero_()
            for view, at, val in zip(bucket.flat_views(flat), positions, values):
                view[at] = val.to(flat.dtype)
        self.comm.allreduce_mean_(flat)
        with phases("decompress"):
            bucket.scatter(items)
