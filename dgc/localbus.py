"""A machine's local bus for ``exchange=hierarchical``: how its ranks average their gradients and share the result.

A bus has three operations (:class:`LocalBus`): ``mean_shard`` (this rank's 1/R of the machine's mean of a list of
tensors, flattened: a reduce-scatter), ``share`` (every rank's shard, in local-rank order: an allgather) and
``share_sparse`` (the same for shards that are mostly zeros: only their nonzero entries need to travel). Two
implementations: :class:`GroupBus`, the machine's process group (NCCL on GPUs; gloo over TCP on loopback), and
:class:`SharedMemoryBus`, for CPU tensors, where the ranks read each other's memory. The hierarchical exchange
holds one of them and never asks which.

Between the ranks of one machine, gloo sends a reduce-scatter over TCP on loopback: every byte is copied
through the kernel's socket buffers, and with several ranks per core that "bus" runs at tens of MB/s,
slower than a 1 Gbps link (docs/performance.md). CPU ranks on one machine can instead read each other's
memory. :class:`SharedMemoryBus` maps one file under ``/dev/shm`` into every rank of the machine, per
``key`` R input slots and one result, and a round of one key is three calls:

* ``slot(key, numel, dtype)``: this rank's input slot; the rank writes its flat gradient into it (the
  flattening copy itself, no further one);
* ``reduce_scatter_mean(key)``: a barrier, then local rank i sums the slots' i-th 1/R (in rank order, so
  every machine adds the same way) into the i-th 1/R of the result and divides by R: the shard a
  ``reduce_scatter`` gives, in place in shared memory, where its owner may go on working on it;
* ``share(key)``: a barrier, and every rank reads the whole result (a view of the shared memory: copy it
  out before the next round of ``key``).

The two barriers (gloo barriers over the machine's group, a few bytes each) order the writes and reads:
a rank writes its slot and its shard of round t + 1 only after every rank passed the barrier that
follows their reads of round t.

The file is created by local rank 0 in ``$DGC_SHM_DIR`` (default ``/dev/shm``) with its full size
reserved (``posix_fallocate``: a too small ``/dev/shm``, 64 MB in a default Docker container, fails here
rather than with SIGBUS later), mapped by every rank (each looks for the name in its own
``$DGC_SHM_DIR``), checked with a random token (ranks that do not see the same file are not on one
machine) and removed as soon as all have mapped it, so a killed job leaves nothing behind. A buffer that
cannot be shared raises :class:`SharedMemoryError` on every rank of the machine, before any data moved:
``local_bus="auto"`` (:class:`dgc.exchanges.Hierarchical`) then falls back to the process group.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch
import torch.distributed as dist

from dgc import wire
from dgc.comm import Comm
from dgc.compressors.base import Item

#: ``sync.local_bus``: ``auto`` (shared memory for CPU tensors when it works, else the group), ``shm``, ``group``
LOCAL_BUSES = ("auto", "shm", "group")
#: where the buffers are created unless ``$DGC_SHM_DIR`` says otherwise
SHM_DIR = "/dev/shm"
_TOKEN = 16


class SharedMemoryError(RuntimeError):
    """The ranks of a machine could not share a buffer (one line: why, and what to use instead)."""


def _flatten(items: list[Item], multiple: int, dtype: torch.dtype) -> torch.Tensor:
    """The items' gradients end to end in ``dtype``, zero-padded to a multiple of ``multiple``."""
    flat = torch.cat([it.grad.view(-1) for it in items])
    pad = -flat.numel() % multiple
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).to(dtype)


class LocalBus:
    """The ranks of one machine (``comm``: its local communicator, ``comm.sub(group, local_bus=True)``)."""

    name = "group"

    def __init__(self, comm: Comm):
        self.comm = comm

    @property
    def ranks(self) -> int:
        return self.comm.world_size

    def mean_shard(self, key: str, items: list[Item], dtype: torch.dtype) -> torch.Tensor:
        """This rank's 1/R of the machine's mean of the items' gradients, flattened end to end in ``dtype`` and
        zero-padded to a multiple of R. ``key`` names the round (a bus may keep buffers per key)."""
        raise NotImplementedError

    def share(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` of round ``key`` end to end, in local-rank order (valid until the next round)."""
        raise NotImplementedError

    def share_sparse(self, key: str, shard: torch.Tensor, indices: str) -> torch.Tensor:
        """:meth:`share` for shards that are mostly zeros (``indices``: the wire's index format for what travels)."""
        return self.share(key, shard)


class GroupBus(LocalBus):
    """The machine's process group: a reduce-scatter and allgathers through its backend."""

    def mean_shard(self, key: str, items: list[Item], dtype: torch.dtype) -> torch.Tensor:
        with self.comm.phases("compress"):
            flat = _flatten(items, self.ranks, dtype)
        return self.comm.reduce_scatter_mean(flat)

    def share(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        return self.comm.allgather(shard).view(-1)

    def share_sparse(self, key: str, shard: torch.Tensor, indices: str) -> torch.Tensor:
        """Each rank sends its shard's nonzero entries (fp32 values, exact), not the dense shard."""
        phases = self.comm.phases
        with phases("compress"):
            pos = shard.nonzero().view(-1)
            fmt = wire.WireFormat("fp32", indices)
            message = wire.encode([shard[pos]], [pos], fmt, [shard.numel()])
        rows, lengths = self.comm.allgather_bytes(message)
        with phases("decompress"):
            whole = shard.new_zeros(shard.numel() * self.ranks)
            for j in range(rows.shape[0]):
                start = torch.tensor([j * shard.numel()], device=whole.device)
                at, values = wire.decode(rows[j, : lengths[j]], start, fmt)
                whole[at] = values.to(whole.dtype)
        return whole


class SharedMemoryBus(LocalBus):
    """Shared-memory reduce-scatter and share among the ranks of ``comm`` (CPU tensors; ``first_rank``: the global
    rank of its local rank 0): the module docstring says how."""

    name = "shm"

    def __init__(self, comm: Comm, first_rank: int):
        super().__init__(comm)
        self.first_rank = first_rank
        self.directory = os.environ.get("DGC_SHM_DIR") or SHM_DIR
        #: key -> (slots [R, numel], result [numel]), both in one mapping (kept alive by the tensors' storage)
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _barrier(self) -> None:
        with self.comm.phases("communicate"):
            dist.barrier(group=self.comm.group)

    def _buffer(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._buffers.get(key)
        if have is not None and have[1].numel() == numel and have[1].dtype == dtype:
            return have
        self._buffers.pop(key, None)
        r, item = self.ranks, dtype.itemsize
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
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device="cpu")  # CPU ranks only, on gloo
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

    def slot(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's input slot of ``key`` (``numel`` divisible by R), to fill before :meth:`reduce_scatter_mean`.
        The first call of a key (or of a new size) maps its buffer: collective, SharedMemoryError if it fails."""
        if numel % self.ranks:
            raise ValueError(f"the local bus needs a length divisible by {self.ranks}, got {numel}")
        return self._buffer(key, numel, dtype)[0][self.comm.rank]

    def reduce_scatter_mean(self, key: str) -> torch.Tensor:
        """This rank's 1/R of the mean of the machine's slots of ``key``: a view of the shared result, which this
        rank may change in place before :meth:`share`."""
        slots, result = self._buffers[key]
        r, numel = self.ranks, result.numel()
        nbytes = numel * result.element_size()
        self.comm.count(nbytes * (r - 1) // r, nbytes * (r - 1) // r)
        self._barrier()
        n = numel // r
        lo = self.comm.rank * n
        with self.comm.phases("communicate"):
            shard = result[lo : lo + n]
            torch.add(slots[0, lo : lo + n], slots[1, lo : lo + n], out=shard)
            for j in range(2, r):
                shard.add_(slots[j, lo : lo + n])
        return shard.div_(r)

    def mean_shard(self, key: str, items: list[Item], dtype: torch.dtype) -> torch.Tensor:
        """The flattening copy goes straight into this rank's slot; the shard is a view of the shared result."""
        if items[0].grad.device.type != "cpu":
            raise SharedMemoryError(f"shared-memory local bus: for CPU tensors, not {items[0].grad.device}")
        total = sum(it.grad.numel() for it in items)
        slot = self.slot(key, total + (-total % self.ranks), dtype)
        with self.comm.phases("compress"):
            pos = 0
            for it in items:
                n = it.grad.numel()
                slot[pos : pos + n].copy_(it.grad.view(-1))
                pos += n
            slot[pos:].zero_()
        return self.reduce_scatter_mean(key)

    def share(self, key: str, shard: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's shard of ``key`` in local-rank order: the whole result, a view of shared memory valid until
        the next round of ``key`` (copy it out). The shards are already there: the owners changed them in place."""
        result = self._buffers[key][1]
        nbytes = result.numel() // self.ranks * result.element_size()
        self.comm.count(nbytes, nbytes * (self.ranks - 1))
        self._barrier()
        return result
