"""A machine's local bus for ``exchange=hierarchical``: its ranks sum and share through shared memory.

Between the ranks of one machine, gloo sends a reduce-scatter over TCP on loopback: every byte is copied
through the kernel's socket buffers, and with several ranks per core that "bus" runs at tens of MB/s,
slower than a 1 Gbps link (docs/performance.md). CPU ranks on one machine can instead read each other's
memory. :class:`SharedMemoryBus` maps one file under ``/dev/shm`` into every rank of the machine:

* ``reduce_scatter_mean(key, flat)``: each rank writes its flat gradient into its own slot, a barrier,
  then local rank i sums the slots' i-th 1/R (in rank order, so every machine adds the same way) and
  divides by R: the same shard a ``reduce_scatter`` gives, without the copies through sockets;
* ``share(key, shard)``: each rank writes its shard into the common result, a barrier, and every rank
  reads the whole result (a view of the shared memory: copy it out before the next call with ``key``).

Two barriers per call (gloo barriers over the machine's group, a few bytes each) order the writes and
reads: a rank writes its slot of step t + 1 only after every rank passed the barrier that follows their
reads of step t.

The file is created by local rank 0 in ``$DGC_SHM_DIR`` (default ``/dev/shm``) with its full size
reserved (``posix_fallocate``: a too small ``/dev/shm``, 64 MB in a default Docker container, fails here
rather than with SIGBUS later), mapped by every rank (each looks for the name in its own
``$DGC_SHM_DIR``), checked with a random token (ranks that do not see the same file are not on one
machine) and removed as soon as all have mapped it, so a killed job leaves nothing behind. A buffer that
cannot be shared raises :class:`SharedMemoryError` on every rank of the machine, before any data moved:
``local_bus="auto"`` (:class:`dgc.exchange.Hierarchical`) then falls back to the process group.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch
import torch.distributed as dist

from dgc.comm import Comm

#: ``sync.local_bus``: ``auto`` (shared memory for CPU tensors when it works, else the group), ``shm``, ``group``
LOCAL_BUSES = ("auto", "shm", "group")
#: where the buffers are created unless ``$DGC_SHM_DIR`` says otherwise
SHM_DIR = "/dev/shm"
_TOKEN = 16


class SharedMemoryError(RuntimeError):
    """The ranks of a machine could not share a buffer (one line: why, and what to use instead)."""


class SharedMemoryBus:
    """Shared-memory reduce-scatter and share among the ranks of ``comm`` (a machine's local communicator,
    ``comm.sub(group, local_bus=True)``; ``first_rank``: the global rank of its local rank 0)."""

    def __init__(self, comm: Comm, first_rank: int):
        self.comm = comm
        self.first_rank = first_rank
        self.directory = os.environ.get("DGC_SHM_DIR") or SHM_DIR
        #: key -> (slots [R, numel], result [numel]), both in one mapping (kept alive by the tensors' storage)
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def ranks(self) -> int:
        return self.comm.world_size

    def _barrier(self) -> None:
        with self.comm.phases("communicate"):
            dist.barrier(group=self.comm.group)

    def _buffer(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._buffers.get(key)
        if have is not None and have[1].numel() == numel and have[1].dtype == dtype:
            return have
        self._buffers.pop(key, None)
        r, item = self.ranks, torch.empty((), dtype=dtype).element_size()
        nbytes = (r + 1) * numel * item
        mapped = self._map(key, nbytes)
        flat = mapped[:nbytes].view(dtype)
        self._buffers[key] = (flat[: r * numel].view(r, numel), flat[r * numel :])
        return self._buffers[key]

    def _map(self, key: str, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (+ the token) mapped by every rank of the machine (collective)."""
        total = nbytes + _TOKEN
        offer: list = [None]
        if self.comm.rank == 0:
            name = f"dgc-{os.getpid()}-{secrets.token_hex(6)}-{key}"
            path = os.path.join(self.directory, name)
            token = secrets.token_bytes(_TOKEN)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, total)
                    os.pwrite(fd, token, nbytes)
                finally:
                    os.close(fd)
                offer = [(name, token, "")]
            except OSError as exc:
                if os.path.exists(path):
                    os.unlink(path)
                offer = [(name, token, f"cannot reserve {total / 2**20:.1f} MiB in {self.directory}: {exc.strerror}")]
        dist.broadcast_object_list(offer, src=self.first_rank, group=self.comm.group)
        name, token, error = offer[0]
        path = os.path.join(self.directory, name)
        mapped = None
        if not error:
            try:
                fd = os.open(path, os.O_RDWR)  # never created here: a rank of another machine finds nothing
                try:
                    view = mmap.mmap(fd, total, mmap.MAP_SHARED)
                finally:
                    os.close(fd)
                if view[nbytes:total] != token:
                    error = f"rank {self.comm.rank} of the machine sees another {path}"
                else:
                    mapped = torch.frombuffer(view, dtype=torch.uint8)  # holds the mapping while it lives
            except (OSError, ValueError) as exc:
                error = f"rank {self.comm.rank} of the machine cannot map {path}: {exc}"
        ok = torch.tensor([0 if error else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.comm.group)  # every rank has mapped it, or gave up
        if self.comm.rank == 0 and os.path.exists(path):
            os.unlink(path)  # the mappings stay: nothing is left behind even if the job is killed
        if not int(ok):
            if not error:
                error = (
                    f"another rank of the machine could not map {path} (are its {self.ranks} ranks on one "
                    "machine? see sync.ranks_per_node)"
                )
            raise SharedMemoryError(f"shared-memory local bus: {error}")
        assert mapped is not None
        return mapped

    def reduce_scatter_mean(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """This rank's 1/R of the mean of ``flat`` over the machine (a new tensor; length divisible by R)."""
        r = self.ranks
        if flat.numel() % r:
            raise ValueError(f"reduce_scatter_mean needs a length divisible by {r}, got {flat.numel()}")
        slots, _ = self._buffer(key, flat.numel(), flat.dtype)
        nbytes = flat.numel() * flat.element_size()
        self.comm.count(nbytes * (r - 1) // r, nbytes * (r - 1) // r)
        with self.comm.phases("communicate"):
            slots[self.comm.rank].copy_(flat)
        self._barrier()
        n = flat.numel() // r
        lo = self.comm.rank * n
        with self.comm.phases("communicate"):
            shard = slots[0, lo : lo + n].clone()
            for j in range(1, r):
                shard.add_(slots[j, lo : lo + n])
        return shard.div_(r)

    def share(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` in local-rank order: the whole buffer, a view of shared memory valid until the
        next call with ``key`` (copy it out)."""
        r, n = self.ranks, shard.numel()
        _, result = self._buffer(key, n * r, shard.dtype)
        nbytes = n * shard.element_size()
        self.comm.count(nbytes, nbytes * (r - 1))
        with self.comm.phases("communicate"):
            result[self.comm.rank * n : (self.comm.rank + 1) * n].copy_(shard)
        self._barrier()
        return result
