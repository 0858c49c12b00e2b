"""The ``sync`` config: how a :class:`~dgc.sync.GradientSync` treats the gradients around its compressor, and the
checks of its options (the class and the config share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dgc.comm import Comm
from dgc.compressors import Compressor
from dgc.exchanges import EXCHANGES
from dgc.localbus import LOCAL_BUSES
from dgc.policy import Policy

#: ``accumulate``: what the compressed tensors' momentum and residual hold
ACCUMULATE = ("gradients", "updates")


def check_accumulate(accumulate: Any) -> None:
    if accumulate not in ACCUMULATE:
        raise ValueError(f"sync.accumulate must be one of {', '.join(ACCUMULATE)}, got {accumulate!r}")


def check_clip_norm(clip_norm: Any) -> None:
    if clip_norm is None:
        return
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or math.isnan(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}")


#: ``pack``: what else travels in the compressor's own message (:mod:`dgc.packing`)
PACKS = ("none", "dense", "all")


def check_pack(pack: Any, exchange: str, dense_values: str) -> None:
    """ValueError unless ``pack`` is one of :data:`PACKS` that the exchange and the dense values' format allow (the
    overlapped exchange packs every one: each bucket's flags ride in its own message, read at the step's end)."""
    if pack not in PACKS:
        raise ValueError(f"sync.pack must be one of {', '.join(PACKS)}, got {pack!r}")
    if pack != "none" and exchange != "flat":
        raise ValueError(f"sync.pack={pack} needs sync.exchange=flat, got {exchange} (it sends the dense values its "
                         "own way)")  # fmt: skip
    if pack != "none" and dense_values == "1bit":
        raise ValueError(f"sync.pack={pack} sends the dense values as they are: not with "
                         "sync.policy.dense_values=1bit (1-bit keeps residuals of its own); "
                         "use fp32, fp16 or bf16")  # fmt: skip


#: ``clip_scope``: what local clipping bounds (GradientSync's docstring)
CLIP_SCOPES = ("auto", "step", "tensor")


def resolve_clip_scope(clip_scope: Any, overlap: bool, clip_norm: float | None) -> str:
    """``step`` or ``tensor`` from a ``clip_scope`` (:data:`CLIP_SCOPES`); ValueError for a scope the overlap cannot
    clip by."""
    if clip_scope not in CLIP_SCOPES:
        raise ValueError(f"sync.clip_scope must be one of {', '.join(CLIP_SCOPES)}, got {clip_scope!r}")
    if clip_scope == "auto":
        return "tensor" if overlap else "step"
    if clip_scope == "step" and overlap and clip_norm is not None:
        raise ValueError("sync.clip_scope=step clips by the norm of the whole gradient, which the overlapped exchange "
                         "never holds (it sends each bucket as it is ready): use clip_scope=tensor (or auto) with "
                         "sync.overlap=true")  # fmt: skip
    return clip_scope


@dataclass
class SyncConfig:
    """How a :class:`GradientSync` treats the gradients around its compressor (the ``sync`` config); the sync is
    built from it by :meth:`GradientSync.from_config`."""

    #: local gradient clipping: the clip of the averaged gradient; each worker clips at clip_norm * N**0.5; null: off
    clip_norm: float | None = None
    policy: Policy = field(default_factory=Policy)
    #: exchange through DDP's communication hook instead of after backward() (trainer)
    ddp_hook: bool = False
    #: with ddp_hook: compress and exchange each DDP bucket as it is ready, under the rest of the backward pass
    overlap: bool = False
    #: what local clipping bounds: step (the whole gradient; serial only), tensor (each tensor its share of the
    #: bound), auto (tensor with overlap, step otherwise)
    clip_scope: str = "auto"
    #: how the compressed tensors travel: flat | densify | hierarchical | sparse_allreduce (:mod:`dgc.exchanges`), or
    #: auto: the one the calibrated cost model (``costmodel``) predicts fastest for this run at ``bandwidth``
    exchange: str = "flat"
    #: ranks per machine for exchange=hierarchical (null: from the launcher, LOCAL_WORLD_SIZE or Slurm)
    ranks_per_node: int | None = None
    #: exchange=hierarchical, how a machine's ranks share data: auto (shared memory for CPU tensors when it
    #: works, else the process group), shm, group (:mod:`dgc.localbus`)
    local_bus: str = "auto"
    #: what the compressor's momentum and residual accumulate: gradients (the paper's), or updates: gradients
    #: times the learning rate of their step (what waits keeps its rate when the rate drops; needs dgc.SGD)
    accumulate: str = "gradients"
    #: what else travels in the compressor's own message (flat exchange only; dgc.packing): none; dense (the values
    #: left dense: one collective fewer per step, pays where message latency dominates); all (those and the step's
    #: agreement: one more fewer, the step's compression state copied in case a worker's gradient is not finite)
    pack: str = "none"
    #: exchange=auto: the network rate per machine (a tc rate: 1gbit, 10gbit, 25gbit)
    bandwidth: str = "1gbit"
    #: exchange=auto: the report of ``python -m dgc.bench costmodel`` (make bench-cluster writes this one)
    costmodel: str = "results/bench/costmodel.json"

    def __post_init__(self) -> None:
        check_clip_norm(self.clip_norm)
        if self.exchange not in (*EXCHANGES, "auto"):
            raise ValueError(f"sync.exchange must be one of {', '.join(EXCHANGES)}, auto; got {self.exchange!r}")
        from dgc.costmodel import rate_bytes

        rate_bytes(self.bandwidth)  # ValueError naming the valid units
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"sync.ranks_per_node must be >= 1 or null, got {self.ranks_per_node}")
        if self.local_bus not in LOCAL_BUSES:
            raise ValueError(f"sync.local_bus must be one of {', '.join(LOCAL_BUSES)}, got {self.local_bus!r}")
        check_accumulate(self.accumulate)
        resolve_clip_scope(self.clip_scope, self.overlap, self.clip_norm)
        check_pack(self.pack, "flat" if self.exchange == "auto" else self.exchange, self.policy.dense_values)
        if self.exchange == "auto" and self.pack != "none":
            raise ValueError(f"sync.pack={self.pack} needs sync.exchange=flat, and sync.exchange=auto may choose "
                             "another: set sync.exchange=flat, or sync.pack=none")  # fmt: skip
        if self.overlap and not self.ddp_hook:
            raise ValueError("sync.overlap=true needs sync.ddp_hook=true: the overlap runs in DDP's communication "
                             "hook, bucket by bucket")  # fmt: skip

    def choose(self, model: Any, compressor: Compressor, comm: Comm | None) -> tuple[str, str]:
        """exchange=auto: ``(exchange, why)`` from the calibrated cost model (flat for dense compressors)."""
        from dgc.compressors.sparse import SparseCompressor
        from dgc.costmodel import auto_exchange
        from dgc.topology import ranks_per_node_from_env

        if not isinstance(compressor, SparseCompressor):
            return "flat", f"exchange=auto: {compressor.name} is not a sparse compressor: flat"
        world = (comm or Comm()).world_size
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad and self.policy.compresses(p))
        r = self.ranks_per_node or ranks_per_node_from_env()
        best, why = auto_exchange(self.costmodel, numel, world, r, self.bandwidth, compressor.config.density)
        return best, f"exchange=auto chose {best}: {why}"
