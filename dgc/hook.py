"""DDP communication hook running a :class:`~dgc.sync.GradientSync`.

Usage (same shape as PyTorch's PowerSGD hook)::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.001))
    ddp.register_comm_hook(sync, dgc.ddp_comm_hook)      # or dgc.HookState(sync)
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)

DDP calls the hook once per gradient bucket as buckets become ready. With ``GradientSync(overlap=True)``
(``sync.overlap=true``) each bucket is compressed and exchanged at once, in a thread of its own, under the rest
of the backward pass (:mod:`dgc.overlap`; local clipping is then per tensor). Otherwise the hook holds every bucket
until the last one of the step arrives, then runs one :meth:`GradientSync.sync` over all of them
and completes all the futures. Waiting gives up overlapping communication with the rest of the
backward pass, and buys local clipping by the norm of the whole local gradient (so both paths
compute the same numbers), one sparse allgather per step instead of one per bucket, and a
collective order identical on every worker by construction. State is keyed by parameter name,
so DDP's bucket rebuild after the first step changes nothing.

For the dense baselines use DDP's own hooks (its default allreduce, or
``default_hooks.fp16_compress_hook``), which overlap with the backward pass.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dgc.overlap import BucketPipeline, bucket_pairs
from dgc.sync import GradientSync


@dataclass
class HookState:
    """The hook's state: the sync it runs and the buckets of the current step waiting for the last one."""

    sync: GradientSync
    pending: list = field(default_factory=list)
    #: the overlapped exchange's thread (``sync.overlap``), made at the first bucket
    pipeline: BucketPipeline | None = None


#: the state of each GradientSync registered directly as the hook's state
_states: "weakref.WeakKeyDictionary[GradientSync, HookState]" = weakref.WeakKeyDictionary()


def hook_state(state: Any) -> HookState:
    """``state`` itself, or the :class:`HookState` that belongs to a GradientSync."""
    if isinstance(state, HookState):
        return state
    if isinstance(state, GradientSync):
        return _states.setdefault(state, HookState(state))
    raise TypeError(f"the DGC hook's state is a GradientSync or a dgc.HookState, not {type(state).__name__}")


def ddp_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    hs = hook_state(state)
    if hs.sync.overlap:
        if hs.pipeline is None:
            hs.pipeline = BucketPipeline(hs.sync)
        return hs.pipeline.submit(bucket)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    hs.pending.append((bucket.buffer(), bucket.parameters(), bucket.gradients(), future))
    if not bucket.is_last():
        return future
    pending, hs.pending = hs.pending, []
    try:
        pairs = [pg for buffer, params, grads, _ in pending for pg in bucket_pairs(buffer, params, grads)]
        hs.sync.sync(pairs)
    except BaseException as exc:
        for *_, fut in pending:
            fut.set_exception(exc)
        raise
    for buffer, _, _, fut in pending:
        fut.set_result(buffer)
    return future
