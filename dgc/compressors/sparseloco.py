"""SparseLoCo's compressor (Sarfi et al. 2025, arXiv 2508.15706): decaying error feedback, chunk-wise top-k, 2-bit
values.

Per exchange, on a flat bucket of the tensors (padded with zeros to whole chunks):

1. ``e = decay * e + g``: the error-feedback buffer (:class:`~dgc.memory.Residual` with a decay, ``beta`` in the
   paper) takes the gradient it is given; under local steps (:mod:`dgc.localsteps`) that is the pseudo-gradient, and
   the decaying buffer stands in for DiLoCo's outer momentum;
2. the ``k = density * chunk_size`` largest ``|e|`` of every chunk (:mod:`dgc.chunkselect`): a fixed-size message;
3. their values quantized (``values=2bit``): a sign bit and one bit choosing between two magnitudes of the chunk,
   the mean ``|e|`` of its selected entries at or below their median and the mean of those above it (two fp32
   scales per chunk). What the two bits cannot carry stays in ``e``: the sent values leave ``e`` as they were
   decoded, so the quantization error is fed back like the unselected entries;
4. one allgather of every worker's message; each decodes the mean.

The message per chunk: ``k`` 2-bit codes, 2 fp32 scales and ``k`` 16-bit positions within the chunk (the positions
dominate: at k = 82 of 4096, 20.5 + 8 + 164 bytes against 16,384 dense). ``values=fp32|fp16|bf16`` send the
selected values themselves instead (the quantizer's share of the result, in comparisons).

The paper's quantizer is not specified to the bit here; this one is ours: deterministic (no random rounding: the
error feedback keeps what rounding loses), two levels per sign chosen per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgc import chunkselect
from dgc.bucket import Buckets
from dgc.collectives import Allgather, Steps
from dgc.compressors.base import Compressor, CompressorConfig, Item, check_int, check_number, register
from dgc.memory import Memory, Residual
from dgc.timing import Phases
from dgc.wire import DTYPES

#: ``SparseLoCoConfig.values``
VALUES = ("2bit", "fp32", "fp16", "bf16")


@dataclass
class SparseLoCoConfig(CompressorConfig):
    name: str = "sparseloco"
    #: fraction of every chunk sent: k = round(density * chunk_size) values per chunk, at least 1 (paper: 1-3%)
    density: float = 0.02
    #: values per chunk (at most 65536: positions within a chunk are 16-bit)
    chunk_size: int = 4096
    #: the error-feedback buffer's decay, beta: e = decay * e + g
    decay: float = 0.95
    #: 2bit (a sign and one of two magnitudes per chunk) | fp32 | fp16 | bf16
    values: str = "2bit"

    def __post_init__(self) -> None:
        check_number(self.density, "density", 0.0, 1.0)
        check_int(self.chunk_size, "chunk_size", 2)
        if self.chunk_size > chunkselect.MAX_CHUNK:
            raise ValueError(f"chunk_size must be at most {chunkselect.MAX_CHUNK} (16-bit positions), "
                             f"got {self.chunk_size}")  # fmt: skip
        check_number(self.decay, "decay", 0.0, 1.0, low_open=False)
        if self.values not in VALUES:
            raise ValueError(f"values must be one of {', '.join(VALUES)}, got {self.values!r}")


def quantize2(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` ``[chunks, k]`` as 2-bit codes ``[chunks, k]`` (uint8: bit 1 the sign, bit 0 "above the median")
    and their chunk's two magnitudes ``[chunks, 2]`` (low, high: the mean ``|v|`` at or below the median, above it)."""
    mag = values.abs()
    median = mag.median(dim=1, keepdim=True).values  # the lower median: k = 1 puts the one value in "low"
    high = mag > median
    n_high = high.sum(1)
    n_low = values.shape[1] - n_high
    s_high = torch.where(high, mag, 0.0).sum(1) / n_high.clamp(min=1)
    s_low = torch.where(high, 0.0, mag).sum(1) / n_low.clamp(min=1)
    s_high = torch.where(n_high > 0, s_high, s_low)
    codes = high.to(torch.uint8) | ((values < 0).to(torch.uint8) << 1)
    return codes, torch.stack([s_low, s_high], dim=1)


def dequantize2(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values ``codes`` ``[chunks, k]`` stand for, with ``scales`` ``[chunks, 2]``."""
    mag = torch.gather(scales, 1, (codes & 1).to(torch.int64))
    return torch.where((codes & 2).bool(), -mag, mag)


def pack2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (any shape) four to a byte."""
    flat = codes.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)]).view(-1, 4)
    return flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6)


def unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` codes of :func:`pack2`'s bytes (``packed``: ``[..., bytes]``), as ``[..., n]``."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def message_bytes(chunks: int, k: int, values: str) -> int:
    """The size of one worker's message."""
    n = chunks * k
    if values == "2bit":
        return (n + 3) // 4 + chunks * 2 * 4 + n * 2
    return n * DTYPES[values].itemsize + n * 2


@register
class SparseLoCo(Compressor):
    """Decaying error feedback, chunk-wise top-k, 2-bit values (see the module docstring)."""

    name: ClassVar[str] = "sparseloco"
    config_class = SparseLoCoConfig
    config: SparseLoCoConfig

    def __init__(self, config: SparseLoCoConfig | None = None, **options) -> None:  # noqa: ANN003
        super().__init__(config, **options)
        self.buckets = Buckets()

    def make_memory(self) -> Memory:
        return Residual("error", decay=self.config.decay)

    def density(self) -> float:
        return self.config.density

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        if len({(it.grad.dtype, it.grad.device) for it in items}) != 1:
            raise ValueError("the sparseloco compressor needs one dtype and device for every compressed tensor")
        cfg = self.config
        chunk = cfg.chunk_size
        with phases("compress"):
            bucket = self.buckets.of("sparseloco", items, multiple=chunk)
            bucket.adopt(self.state, self.memory.keys)
            e = self.memory.compensate(bucket.gather(items), bucket.buffers)
            k = chunkselect.per_chunk(cfg.density, chunk)
            local, positions = chunkselect.select(e, chunk, k)
            chunks = bucket.size // chunk
            phases.counters["values_sent"] += positions.numel()
            phases.counters["values_target"] += positions.numel()
            if cfg.values == "2bit":
                codes, scales = quantize2(e[positions].view(chunks, k))
                e.index_add_(0, positions, dequantize2(codes, scales).view(-1), alpha=-1.0)
                # a selected zero is sent as a chunk's low magnitude: the padding keeps nothing (nor is it saved)
                e[bucket.layout.total :].zero_()
                index = local.reshape(-1).to(torch.int32).to(torch.uint16).view(torch.uint8)
                message = torch.cat([pack2(codes), scales.to(torch.float32).view(-1).view(torch.uint8), index])
            else:
                sent = self.memory.sent(bucket.buffers, positions, DTYPES[cfg.values])
                message = chunkselect.encode(sent, local, DTYPES[cfg.values])
        rows = yield Allgather(message)
        with phases("decompress"):
            if cfg.values == "2bit":
                self._decode2(bucket.grad, rows, chunks, k)
            else:
                chunkselect.decode_mean_into(bucket.grad, rows, chunk, k, DTYPES[cfg.values])
            bucket.grad[bucket.layout.total :].zero_()  # the padding stays zero (a gather never writes it)
            bucket.scatter(items)

    def _decode2(self, out: torch.Tensor, rows: torch.Tensor, chunks: int, k: int) -> None:
        """The mean of every worker's 2-bit message into ``out`` (zeroed here), worker after worker. (The scales and
        positions are copied out before their dtype views: a row starts wherever the message's length puts it.)"""
        workers, n = rows.shape[0], chunks * k
        code_bytes = (n + 3) // 4
        scale_end = code_bytes + chunks * 8
        codes = unpack2(rows[:, :code_bytes], n).view(workers, chunks, k)
        scales = rows[:, code_bytes:scale_end].clone().view(-1).view(torch.float32).view(workers, chunks, 2)
        values = torch.stack([dequantize2(codes[r], scales[r]) for r in range(workers)]).view(workers, n).to(out.dtype)
        local = rows[:, scale_end:].clone().view(-1).view(torch.uint16).to(torch.int64).view(workers, chunks, k)
        chunkselect.add_mean_into(out, values, local, out.numel() // chunks)
