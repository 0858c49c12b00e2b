"""The overlapped DDP hook: each bucket compressed and exchanged while the backward pass goes on.

With ``GradientSync(..., overlap=True)``, :func:`dgc.ddp_comm_hook` hands every bucket DDP gives it to a
:class:`BucketPipeline` and returns at once. The pipeline's thread takes the buckets in the order DDP hands them
over (the same on every worker: DDP rebuilds its buckets once, after the first step, from rank 0's order) and runs
:meth:`GradientSync.sync_part` on each: its agreement (a non-finite gradient on any worker, requests), clipping of
each tensor to its share of the bound, compression and exchange. The collectives of one worker are issued by that
one thread, bucket after bucket, so every worker issues the same collectives in the same order. While it works the
autograd thread computes the next buckets' gradients: the exchange runs under the backward pass, as DDP's own
allreduce and PyTorch's PowerSGD hook do.

The futures of a step's buckets complete together, after its last bucket: only then is it known whether any
worker's gradient was not finite anywhere in the step. DDP waits for them only at the end of the backward pass,
so holding them back costs no overlap. A skipped step (:meth:`GradientSync.end`) zeroes every bucket and puts back
the compression state the earlier buckets changed, from copies taken before each bucket (memory: one copy of the
compressor's state, held during the step; ``check_finite=False`` takes none).

On CUDA the thread waits for an event recorded on the hook's stream before it reads a bucket, and the futures carry
the device, so DDP's stream waits for the thread's work. A failure in the thread fails the step's futures (DDP raises
it at the end of the backward pass) and every later bucket's: after a failed collective the workers' collective
sequences no longer match.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dgc.sync import GradientSync
from dgc.sync.step import OpenStep


def bucket_pairs(buffer: torch.Tensor, params: list[torch.Tensor], grads: list[torch.Tensor]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """A DDP bucket's ``(param, grad)`` pairs, the grads checked to be views of the bucket's buffer (written in place,
    the buffer is the bucket's result)."""
    for g in grads:
        if g.data_ptr() < buffer.data_ptr() or g.data_ptr() >= buffer.data_ptr() + buffer.nbytes:
            raise RuntimeError("DDP bucket gradients are not views of the bucket buffer")
    return list(zip(params, grads))


@dataclass
class _Job:
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    buffer: torch.Tensor
    future: torch.futures.Future
    last: bool
    ready: Any  # a CUDA event, or None


class BucketPipeline:
    """A thread that runs :meth:`GradientSync.sync_part` on each DDP bucket as it comes (see the module docstring)."""

    def __init__(self, sync: GradientSync) -> None:
        self.sync = sync
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._step: OpenStep | None = None
        self._futures: list[tuple[torch.futures.Future, torch.Tensor]] = []
        self._error: BaseException | None = None

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue one bucket; its future completes with the averaged bucket after the step's last bucket."""
        buffer = bucket.buffer()
        pairs = bucket_pairs(buffer, bucket.parameters(), bucket.gradients())
        cuda = buffer.is_cuda
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buffer.device] if cuda else None)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(weakref.ref(self), self._jobs, buffer.device),
                                            name="dgc-overlap", daemon=True)  # fmt: skip
            self._thread.start()
        self._jobs.put(_Job(pairs, buffer, future, bucket.is_last(), ready))
        return future

    def close(self) -> None:
        """Stop the thread (after the buckets queued so far)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self, job: _Job) -> None:
        if self._error is not None:
            job.future.set_exception(self._error)
            return
        self._futures.append((job.future, job.buffer))
        try:
            if job.ready is not None:
                torch.cuda.current_stream().wait_event(job.ready)
            if self._step is None:
                self._step = self.sync.begin()
            self.sync.sync_part(self._step, job.pairs)
            if not job.last:
                return
            step, self._step = self._step, None
            self.sync.end(step)
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the futures
            self._error = exc
            futures, self._futures, self._step = self._futures, [], None
            for fut, _ in futures:
                fut.set_exception(exc)
            return
        futures, self._futures = self._futures, []
        for fut, buffer in futures:
            fut.set_result(buffer)


def _work(ref: weakref.ref[BucketPipeline], jobs: queue.SimpleQueue, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while True:
        job = jobs.get()
        pipeline = ref()
        if job is None or pipeline is None:
            return
        pipeline._run(job)
        del pipeline
