"""DDP communication hook running a :class:`~dgc.sync.GradientSync`.

Usage (same shape as PyTorch's PowerSGD hook)::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.001))
    ddp.register_comm_hook(sync, dgc.ddp_comm_hook)
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)

How it works: DDP calls the hook once per gradient bucket as buckets become
ready. The hook holds every bucket until the last one of the step arrives, then
runs one :meth:`GradientSync.sync` over all of them and completes all the
futures. Waiting costs the overlap of communication with the rest of the
backward pass, and buys three things: local clipping by the norm of the whole
local gradient (as in the library path, so both paths compute the same
numbers), one sparse allgather per step instead of one per bucket (at density
0.001 the messages are small and latency dominates), and a collective order
that is identical on every worker by construction. State is keyed by parameter
name, so DDP's bucket rebuild after the first step changes nothing.

For the dense baselines use DDP's own hooks (its default allreduce, or
``default_hooks.fp16_compress_hook``), which overlap with the backward pass.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import torch
import torch.distributed as dist

from dgc.sync import GradientSync


def ddp_comm_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state._pending.append((bucket.buffer(), bucket.parameters(), bucket.gradients(), future))
    if not bucket.is_last():
        return future
    pending, state._pending = state._pending, []
    try:
        pairs = []
        for buffer, params, grads, _ in pending:
            for p, g in zip(params, grads):
                if g.data_ptr() < buffer.data_ptr() or g.data_ptr() >= buffer.data_ptr() + buffer.nbytes:
                    raise RuntimeError("DDP bucket gradients are not views of the bucket buffer")
                pairs.append((p, g))
        state.sync(pairs)
    except BaseException as exc:
        for *_, fut in pending:
            fut.set_exception(exc)
        raise
    for buffer, _, _, fut in pending:
        fut.set_result(buffer)
    return future
