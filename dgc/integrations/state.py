"""Every rank's compression state as one object a framework can checkpoint.

Frameworks save one state per object, written by rank 0 (Lightning's callback state, Accelerate's
``register_for_checkpointing``), but a :class:`~dgc.GradientSync`'s residuals and momenta are per rank: rank 0's
alone would hand every other rank rank 0's unsent gradient. :class:`EveryRank` gathers all of them on the first rank
when the state is taken (a collective: every rank takes it, as both frameworks do when they save) and gives each
rank its own back
when it is loaded. Loaded on another number of ranks, the states are remapped by :func:`dgc.elastic.remap`,
which keeps each parameter's mean residual and momentum over ranks (nothing unsent lost or counted twice).
"""

from __future__ import annotations

import ctypes
import io
import logging
from typing import Any

import torch
import torch.distributed as dist

from dgc import elastic
from dgc.sync import GradientSync

log = logging.getLogger(__name__)

#: the format tag of :meth:`EveryRank.state_dict`
FORMAT = "dgc-every-rank/1"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _gather_on_first(obj: Any, comm: Any) -> list[Any] | None:
    """Every rank's ``obj`` on the group's first rank (None on the others), each serialized by ``torch.save`` and sent
    as bytes in tensors on the group's device. Not ``dist.gather_object``: it reads the bytes back through NumPy,
    which the library does not require (a core install of dgc has torch alone)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=comm.device)
    sizes = [torch.zeros_like(size) for _ in range(comm.world_size)]
    dist.all_gather(sizes, size, group=comm.group)
    longest = int(max(int(n) for n in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=comm.device)
    padded[: data.numel()] = data.to(comm.device)
    first = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
    rows = [torch.empty_like(padded) for _ in range(comm.world_size)] if comm.rank == 0 else None
    dist.gather(padded, rows, dst=first, group=comm.group)
    if rows is None:
        return None
    out = []
    for row, n in zip(rows, sizes, strict=True):
        host = row[: int(n)].cpu().contiguous()
        out.append(torch.load(io.BytesIO(ctypes.string_at(host.data_ptr(), host.numel())), weights_only=True))
    return out


class EveryRank:
    """``state_dict()``: every rank's ``sync.state_dict()`` (gathered; call it on every rank);
    ``load_state_dict(state)``: this rank's own, remapped when the number of ranks changed."""

    def __init__(self, sync: GradientSync) -> None:
        self.sync = sync

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state on the group's first rank, the one frameworks write from; the other ranks return
        ``ranks: None`` (gathering all of them on every rank would hold N ranks' residuals in each)."""
        mine = _to_cpu(self.sync.state_dict())
        comm = self.sync.comm
        if not comm.distributed or comm.world_size == 1:
            return {"format": FORMAT, "world_size": 1, "ranks": [mine]}
        return {"format": FORMAT, "world_size": comm.world_size, "ranks": _gather_on_first(mine, comm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(
                f"not a DGC every-rank state (format {FORMAT!r}): save it with dgc.integrations.EveryRank(sync)"
            )
        ranks, world, rank = state["ranks"], self.sync.world_size, self.sync.comm.rank
        if ranks is None:
            raise ValueError("this DGC state was written by a rank that holds only its own: load the copy the "
                             "first rank wrote")  # fmt: skip
        if len(ranks) != world:
            log.warning("DGC state of %d ranks loaded on %d: residuals and momenta remapped, their mean over "
                        "ranks kept (dgc.elastic)", len(ranks), world)  # fmt: skip
            ranks = elastic.remap(ranks, world)
        self.sync.load_state_dict(ranks[rank])
