"""Collectives used by the compressors, with exact byte accounting.

Every collective a compressor issues goes through a :class:`Comm`, which counts
the bytes this worker contributes (``sent``) and the bytes it receives from the
other workers (``recv``). ``sent`` is the size of the message this worker puts
into the collective, the quantity the DGC paper's compression ratio divides by;
what a particular collective algorithm moves on the links (a ring allreduce
sends ``2 (N-1)/N`` of its buffer) is left to the cost model.

Without an initialized process group (single process), a :class:`Comm` has
world size 1 and every collective is the identity, so the compression path
still runs (and is accounted) end to end.

gloo has no allgather for tensors of different sizes, so :meth:`Comm.allgather_bytes`
exchanges lengths first, pads every message to the longest and counts the padding
it sends as sent bytes.

An exchange over several process groups (inside a machine, between machines) uses
:meth:`Comm.sub` communicators, which count into their parent's traffic and phases, so a step's
bytes are the sum over every group it used.

Devices. A process group serves one kind of device: NCCL only CUDA tensors (a CPU tensor raises "No
backend type associated with device type cpu"), gloo CPU tensors. :attr:`Comm.device` is that device
(the current CUDA device under NCCL, else the CPU), every tensor a :class:`Comm` builds for a collective
(counts, lengths) is built there, and an input that is elsewhere is moved there and back (a host value
such as the control flags costs one copy each way, not a failure). The library builds its tensors on
the gradients' device (``tests/test_devices.py`` and ``tools/check_devices.py`` check it); host values
come back with one ``.tolist()`` per collective, not tensor by tensor.

NCCL's rules for the collectives used here (PyTorch's ``torch.distributed`` documentation):

* ``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_to_all_single`` (with
  uneven split sizes) and ``broadcast`` take tensors on the rank's current CUDA device; the padded
  allgather of :meth:`Comm.allgather_bytes` and the uneven all-to-all are fine under NCCL.
* The object collectives (``broadcast_object_list``, ``gather_object``, ``all_gather_object``) pickle
  through tensors on the current CUDA device: ``torch.cuda.set_device`` must have been called
  (:func:`dgc.distributed.init_distributed` does); they sync with the host, so they stay off the per-step path.
* ``new_group`` is collective: every rank calls it for every group, in the same order, even for groups
  it is not in (:mod:`dgc.topology`). A sub-group takes the default group's backend, so a machine's
  group is NCCL too; the shared-memory local bus (:mod:`dgc.localbus`) is for CPU tensors only.
* ``barrier`` under NCCL runs on the current device; ``monitored_barrier`` exists only on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dgc.distributed import collectives_at_world_1
from dgc.timing import Phases


@dataclass
class Traffic:
    """Bytes moved by one worker, and the number of collectives issued."""

    sent: int = 0
    recv: int = 0
    collectives: int = 0
    #: what went over a machine's own bus (a local communicator's collectives): not in ``sent``/``recv``
    local_sent: int = 0

    def add(self, sent: int, recv: int, local: bool = False) -> None:
        if local:
            self.local_sent += int(sent)
        else:
            self.sent += int(sent)
            self.recv += int(recv)
        self.collectives += 1


class Comm:
    """A process group plus byte accounting. ``group=None`` uses the default group."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world_size, self.rank = 1, 0
        #: whether collectives run (world size 1: each is the identity, unless DGC_COLLECTIVES_AT_WORLD_1=1)
        self.collective = self.distributed and (self.world_size > 1 or collectives_at_world_1())
        #: the device of the tensors this communicator's collectives take (see the module docstring)
        self.device = torch.device(device) if device is not None else group_device(group, self.distributed)
        self._traffic = Traffic()
        self._phases = Phases()
        self.parent: Comm | None = None
        self.local_bus = False  # a machine-local communicator: its bytes are counted apart

    @property
    def traffic(self) -> Traffic:
        return self.parent.traffic if self.parent is not None else self._traffic

    @property
    def phases(self) -> Phases:
        """Collectives add their wall time to ``phases["communicate"]``."""
        return self.parent.phases if self.parent is not None else self._phases

    @phases.setter
    def phases(self, value: Phases) -> None:
        if self.parent is not None:
            self.parent.phases = value
        else:
            self._phases = value

    def sub(self, group: dist.ProcessGroup | None, local_bus: bool = False) -> Comm:
        """A communicator over ``group`` (None: a world of one) that counts into this one; ``local_bus``: its
        ranks share a machine, and its bytes count as ``Traffic.local_sent``, not as network traffic."""
        comm = Comm(group, self.device) if group is not None else Comm.local(self.device)
        comm.parent = self
        comm.local_bus = local_bus
        return comm

    def count(self, sent: int, recv: int) -> None:
        """Account one collective (this worker's ``sent`` and ``recv`` bytes); for transports outside this
        object that move a collective's data (the shared-memory local bus, :mod:`dgc.localbus`)."""
        self.traffic.add(sent, recv, local=self.local_bus)

    @classmethod
    def local(cls, device: torch.device | str | None = None) -> Comm:
        """A world of one even inside a process group: every collective is the identity (counted)."""
        comm = cls(device=device if device is not None else "cpu")
        comm.distributed, comm.world_size, comm.rank, comm.group = False, 1, 0, None
        comm.collective = False
        return comm

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on :attr:`device` (itself when it is there already)."""
        return t if t.device == self.device else t.to(self.device)

    def _all_reduce_(self, flat: torch.Tensor, op: dist.ReduceOp) -> None:
        work = self.place(flat)
        with self.phases("communicate"):
            dist.all_reduce(work, op=op, group=self.group)
        if work is not flat:
            flat.copy_(work)

    def reset_traffic(self) -> Traffic:
        """Return the traffic counted so far and start counting afresh."""
        if self.parent is not None:
            return self.parent.reset_traffic()
        done, self._traffic = self._traffic, Traffic()
        return done

    # -- collectives -----------------------------------------------------------
    def allreduce_mean_(self, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` over all workers in place (any float dtype).

        16-bit buffers are divided before the sum so that it cannot overflow.
        """
        nbytes = flat.numel() * flat.element_size()
        self.count(nbytes, nbytes if self.world_size > 1 else 0)
        if self.collective:
            pre_divide = flat.element_size() < 4
            if pre_divide:
                flat.div_(self.world_size)
            self._all_reduce_(flat, dist.ReduceOp.SUM)
            if not pre_divide:
                flat.div_(self.world_size)
        return flat

    def allreduce_max_(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over all workers, in place."""
        nbytes = flat.numel() * flat.element_size()
        self.count(nbytes, nbytes if self.world_size > 1 else 0)
        if self.collective:
            self._all_reduce_(flat, dist.ReduceOp.MAX)
        return flat

    def reduce_scatter_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """This worker's 1/N of the average of ``flat`` over all workers (its length a multiple of N)."""
        n = self.world_size
        if flat.numel() % n:
            raise ValueError(f"reduce_scatter_mean needs a length divisible by {n}, got {flat.numel()}")
        nbytes = flat.numel() * flat.element_size()
        # a reduce-scatter moves (N-1)/N of the buffer out of and into each worker
        self.count(nbytes * (n - 1) // n, nbytes * (n - 1) // n)
        if not self.collective:
            return flat
        flat = self.place(flat)
        out = flat.new_empty(flat.numel() // n)
        with self.phases("communicate"):
            dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out.div_(n)

    def all_to_all(self, buf: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Send ``buf[sum(counts[:j]) : ...][:counts[j]]`` to worker j (a 1-D tensor, any dtype); returns what the
        workers sent here, in worker order, and how much came from each. Two collectives: the counts, the data."""
        n = self.world_size
        if len(counts) != n or sum(counts) != buf.numel():
            raise ValueError(f"all_to_all wants {n} counts adding up to {buf.numel()}, got {counts}")
        if not self.collective:
            self.count(0, 0)
            return buf, list(counts)
        buf = self.place(buf)
        sizes = torch.tensor(counts, dtype=torch.int64, device=self.device)
        got = torch.empty_like(sizes)
        self.count(8 * (n - 1), 8 * (n - 1))
        with self.phases("communicate"):
            dist.all_to_all_single(got, sizes, group=self.group)
        recv_counts = got.tolist()
        out = buf.new_empty(sum(recv_counts))
        item = buf.element_size()
        mine = counts[self.rank]
        self.count((buf.numel() - mine) * item, (out.numel() - recv_counts[self.rank]) * item)
        with self.phases("communicate"):
            dist.all_to_all_single(out, buf, recv_counts, list(counts), group=self.group)
        return out, recv_counts

    def allgather(self, buf: torch.Tensor) -> torch.Tensor:
        """Gather equal-sized 1-D tensors: returns ``[world_size, len(buf)]``."""
        nbytes = buf.numel() * buf.element_size()
        self.count(nbytes, nbytes * (self.world_size - 1))
        if not self.collective:
            return buf.unsqueeze(0)
        buf = self.place(buf)
        out = buf.new_empty((self.world_size, buf.numel()))
        with self.phases("communicate"):
            dist.all_gather_into_tensor(out.view(-1), buf.contiguous(), group=self.group)
        return out

    def allgather_bytes(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Variable-length allgather of a 1-D uint8 message.

        Returns ``(rows, lengths)``: ``rows[r, :lengths[r]]`` is rank r's message.
        Two collectives: the lengths (8 bytes each), then the messages padded to
        the longest one.
        """
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError("allgather_bytes takes a 1-D uint8 tensor")
        if not self.collective:  # counted as the two collectives would be: the length, then the message
            self.count(8, 0)
            if buf.numel():
                self.count(buf.numel(), 0)
            return buf.unsqueeze(0), [buf.numel()]
        length = torch.tensor([buf.numel()], dtype=torch.int64, device=self.device)
        lengths = self.allgather(length).view(-1).tolist()
        longest = max(lengths)
        if longest == 0:
            return buf.new_empty((self.world_size, 0)), lengths
        if buf.numel() < longest:
            padded = buf.new_zeros(longest)
            padded[: buf.numel()] = buf
            buf = padded
        return self.allgather(buf), lengths


def group_device(group: dist.ProcessGroup | None, distributed: bool) -> torch.device:
    """The device whose tensors ``group``'s collectives take: the current CUDA device if its backend is NCCL
    (also ``cpu:gloo,cuda:nccl``, where the gradients are CUDA tensors), else the CPU."""
    if distributed and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
