"""What the sparse methods share: the density schedule, the wire format and the sparse exchange.

A sparse method accumulates locally, selects a few entries per tensor, and exchanges the selection
of all its tensors as one message per worker (see :mod:`dgc.wire`): one variable-length allgather
per step, not one collective per tensor. Every worker then scatter-adds all the messages and
divides by the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgc import wire
from dgc.bucket import Bucket
from dgc.collectives import AllgatherBytes, Steps
from dgc.compressors.base import Compressor, CompressorConfig, Item
from dgc.schedule import DensitySchedule
from dgc.select import target_count
from dgc.timing import Phases


@dataclass
class SparseConfig(CompressorConfig):
    """Options every sparse method has."""

    #: fraction of each tensor's entries sent per step after the warm-up
    density: float = 0.001
    #: density warm-up, in (fractional) epochs
    warmup_epochs: float = 0.0
    #: the warm-up's densities (default: the paper's 25%, 6.25%, 1.5625%, 0.4%)
    warmup_densities: list[float] | None = None
    #: or an exponential warm-up: stage j has density coeff**j
    warmup_coeff: float | None = None
    #: fp32 | fp16 | bf16 (16-bit: the rounding error stays in the residual)
    wire_values: str = "fp32"
    #: delta16 | int32 | rice | bitmap | auto (:mod:`dgc.wire`)
    wire_indices: str = "delta16"

    def __post_init__(self) -> None:
        self.schedule()
        self.wire_format()

    def schedule(self) -> DensitySchedule:
        return DensitySchedule(self.density, self.warmup_epochs, self.warmup_densities, self.warmup_coeff)

    def wire_format(self) -> wire.WireFormat:
        return wire.WireFormat(self.wire_values, self.wire_indices)


class SparseCompressor(Compressor):
    """Shared machinery: density schedule, wire format, the sparse exchange."""

    config: SparseConfig

    def __init__(self, config: SparseConfig | None = None, **options) -> None:
        super().__init__(config, **options)
        self.schedule = self.config.schedule()
        self.wire = self.config.wire_format()

    def density(self) -> float:
        return self.schedule(self.epoch)

    @property
    def picks_per_tensor(self) -> bool:
        """Whether :meth:`pick` gives this compressor's selection tensor by tensor (the exchanges that reduce the
        selections themselves need it: sparse_allreduce, densify)."""
        return True

    def select(self, item: Item, density: float, phases: Phases) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(ascending positions, accumulator)`` and leave the residual for the rest."""
        raise NotImplementedError

    def pick(
        self, items: list[Item], phases: Phases
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Select every tensor's entries to send: ``(ascending positions, values, accumulators)`` per tensor. The
        values leave the accumulators (what the wire's value type cannot carry stays in them)."""
        density = self.density()
        value_dtype = self.wire.value_dtype
        values, positions, accumulators = [], [], []
        for it in items:
            idx, acc = self.select(it, density, phases)
            # fp16 overflows above 65504: the largest finite value is sent, the excess stays in the residual
            val = self.memory.sent(self.state[it.name], idx, value_dtype)
            positions.append(idx)
            values.append(val)
            accumulators.append(acc)
        phases.counters["values_sent"] += sum(v.numel() for v in values)
        phases.counters["values_target"] += sum(target_count(it.grad.numel(), density) for it in items)
        return positions, values, accumulators

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        with phases("compress"):
            positions, values, _ = self.pick(items, phases)
            message = wire.encode(values, positions, self.wire, [it.grad.numel() for it in items])
        rows, lengths = yield AllgatherBytes(message)
        with phases("decompress"):
            self.decompress(items, rows, lengths, rows.shape[0])

    def decompress_bucket(self, rows: torch.Tensor, bucket: Bucket, items: list[Item]) -> None:
        """Write the average of every worker's :func:`~dgc.wire.encode_known` message (the bucket's tensors, in its
        order) into the items' gradients, through the bucket's gradient buffer."""
        positions, received, ends = wire.decode_known(rows, bucket.layout.offsets, self.wire)
        g = bucket.grad
        received = received.to(g.dtype)
        if rows.shape[0] > 1:
            received.div_(rows.shape[0])
        g.zero_()
        if len(ends) == 1:  # one worker: no slicing
            g.index_add_(0, positions, received)
        else:  # worker after worker: duplicates sum in worker order, on every device
            for start, end in zip([0, *ends[:-1]], ends):
                if end > start:
                    g.index_add_(0, positions[start:end], received[start:end])
        bucket.scatter(items)

    def decompress(self, items: list[Item], rows: torch.Tensor, lengths: list[int], world_size: int) -> None:
        """Write the average of every worker's sparse message into the items' gradients.

        The gradients are zeroed and receive the scatter-add of all messages directly (no
        full-size temporary), entries of the same tensor in worker order, so duplicates sum in
        the same order as a per-worker scatter-add would.
        """
        device = items[0].grad.device
        numels = torch.tensor([it.grad.numel() for it in items], dtype=torch.int64, device=device)
        offsets = torch.cumsum(numels, 0) - numels
        decoded = [wire.decode(rows[r, : lengths[r]], offsets, self.wire) for r in range(rows.shape[0])]
        pos = torch.cat([p for p, _ in decoded]) if len(decoded) > 1 else decoded[0][0]
        val = torch.cat([v for _, v in decoded]) if len(decoded) > 1 else decoded[0][1]
        grads = [it.grad.view(-1) for it in items]
        torch._foreach_zero_(grads)
        if pos.numel() == 0:
            return
        val = val.to(grads[0].dtype).div_(world_size)
        tensor_of = torch.searchsorted(offsets, pos, right=True) - 1
        if len(decoded) > 1:
            order = torch.argsort(tensor_of, stable=True)
            pos, val, tensor_of = pos[order], val[order], tensor_of[order]
        counts = torch.bincount(tensor_of, minlength=len(items)).tolist()
        local = pos - offsets[tensor_of]
        start = 0
        for grad, c in zip(grads, counts):
            if c:
                grad.index_add_(0, local[start : start + c], val[start : start + c])
                start += c
