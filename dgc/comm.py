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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dgc.timing import Phases


@dataclass
class Traffic:
    """Bytes moved by one worker, and the number of collectives issued."""

    sent: int = 0
    recv: int = 0
    collectives: int = 0

    def add(self, sent: int, recv: int) -> None:
        self.sent += int(sent)
        self.recv += int(recv)
        self.collectives += 1


class Comm:
    """A process group plus byte accounting. ``group=None`` uses the default group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world_size, self.rank = 1, 0
        self.traffic = Traffic()
        #: collectives add their wall time to ``phases["communicate"]``
        self.phases = Phases()

    @classmethod
    def local(cls) -> Comm:
        """A world of one even inside a process group: every collective is the identity (counted)."""
        comm = cls()
        comm.distributed, comm.world_size, comm.rank = False, 1, 0
        return comm

    def reset_traffic(self) -> Traffic:
        """Return the traffic counted so far and start counting afresh."""
        done, self.traffic = self.traffic, Traffic()
        return done

    # -- collectives -----------------------------------------------------------
    def allreduce_mean_(self, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` over all workers in place (any float dtype).

        16-bit buffers are divided before the sum so that it cannot overflow.
        """
        nbytes = flat.numel() * flat.element_size()
        self.traffic.add(nbytes, nbytes if self.world_size > 1 else 0)
        if self.world_size > 1:
            pre_divide = flat.element_size() < 4
            if pre_divide:
                flat.div_(self.world_size)
            with self.phases("communicate"):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            if not pre_divide:
                flat.div_(self.world_size)
        return flat

    def allreduce_max_(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over all workers, in place."""
        nbytes = flat.numel() * flat.element_size()
        self.traffic.add(nbytes, nbytes if self.world_size > 1 else 0)
        if self.world_size > 1:
            with self.phases("communicate"):
                dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        return flat

    def allgather(self, buf: torch.Tensor) -> torch.Tensor:
        """Gather equal-sized 1-D tensors: returns ``[world_size, len(buf)]``."""
        nbytes = buf.numel() * buf.element_size()
        self.traffic.add(nbytes, nbytes * (self.world_size - 1))
        if self.world_size == 1:
            return buf.unsqueeze(0)
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
        if self.world_size == 1:
            self.traffic.add(buf.numel(), 0)
            return buf.unsqueeze(0), [buf.numel()]
        length = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
        lengths = self.allgather(length).view(-1).tolist()
        longest = max(lengths)
        if longest == 0:
            return buf.new_empty((self.world_size, 0)), lengths
        if buf.numel() < longest:
            padded = buf.new_zeros(longest)
            padded[: buf.numel()] = buf
            buf = padded
        return self.allgather(buf), lengths
