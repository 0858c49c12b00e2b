"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870): momentum that is also the error feedback, a DCT over fixed
tiles, the top coefficients of each tile sent, the sign of the decoded mean applied.

Per step, on the momentum of every tensor:

1. ``m = decay * m + g``: the momentum (``decay`` 0.999, the paper's) takes the gradient;
2. each tensor is cut into blocks, as the authors' code cuts it (``tiles=tensor``): the tensor viewed as rows (its
   first dimension) by columns (the rest; a 1-D tensor is one row), the block ``h x w`` the largest divisors of the
   rows and of the columns at most ``tile`` (64: a 768 x 768 matrix in 64 x 64 blocks, a bias of 768 in runs of
   64, a vocabulary of 65 rows in blocks of 65 x 64, a prime dimension in runs of 1); each block goes through the
   orthonormal 2-D DCT-II and its ``min(topk, h * w)`` largest coefficients are chosen (:mod:`dgc.chunkselect`: a
   fixed-size message, 16-bit positions in the block). ``tiles=flat`` cuts runs of ``tile * tile`` consecutive
   values of the flattened tensors instead, padded to whole tiles (one transform for all; a small tensor shares a
   tile with its neighbours and gets no ``k`` of its own: a bias of 768 in a 4096-value tile, where the authors'
   blocks send half of it);
3. what they stand for leaves the momentum: ``m -= IDCT(sent)`` (the momentum is its own error feedback);
4. one allgather; each worker averages every worker's coefficients, transforms back and writes ``sign(mean)`` into
   the gradient (``sign=false``: the mean itself). As in the authors' code, a coefficient's sum is divided by the
   number of workers that sent it (``mean=senders``); ``mean=workers`` divides by all of them instead.

The optimizer then applies ``p -= lr * (sign + weight_decay * p)``: with a sign, SGD's weight decay is the decoupled
one DeMo uses. So the optimizer runs without momentum (the momentum is here) and at a sign method's learning rate:
the ``demo`` preset sets ``optim.momentum=0`` and ``optim.lr=0.001`` (not scaled by the workers).

Where this differs from the paper's code, by choice: the momentum takes the gradient, not ``lr * gradient`` (the same
direction while the rate is constant; the sign discards the scale); positions are 16-bit, not int64; a tensor of more
than two dimensions (a convolution) is viewed as rows by the rest (the authors' code takes matrices and vectors
only). DeMo handles every tensor (biases and BatchNorm too). ``cpu-frontier`` ran with ``tiles=flat mean=workers``
(before the preset followed the authors' code); its rows say so.
"""

from __future__ import annotations

import math
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

#: ``DeMoConfig.tiles``
TILES = ("tensor", "flat")


@dataclass
class DeMoConfig(CompressorConfig):
    name: str = "demo"
    #: the DCT's tiles: tile x tile consecutive values (tile**2 at most 65536: positions are 16-bit)
    tile: int = 64
    #: coefficients sent per tile (the paper's 32 of 64 x 64)
    topk: int = 32
    #: the momentum's decay: m = decay * m + g
    decay: float = 0.999
    #: the coefficients on the wire: fp32 | fp16 | bf16 (what a 16-bit value cannot carry stays in the momentum)
    values: str = "fp32"
    #: apply the sign of the decoded mean (the paper's); false: the mean itself
    sign: bool = True
    #: what a coefficient's sum is divided by: "senders", the workers that sent it (the authors' code: a coefficient
    #: one worker sent keeps its value); "workers", all of them (a true mean: a worker that kept a coefficient counts
    #: as a zero)
    mean: str = "senders"
    #: how the tiles are cut: "tensor", from each tensor's own dimensions (the authors' code: a tensor viewed as
    #: rows x columns, its first dimension by the rest, in blocks of the largest divisors of each at most ``tile``; a
    #: 1-D tensor in runs of the largest divisor of its length at most ``tile``; ``min(topk, block size)`` sent per
    #: block); "flat", runs of ``tile * tile`` consecutive values of the flattened tensors, padded to whole tiles
    #: (one transform for all, a small tensor shares a tile with its neighbours)
    tiles: str = "tensor"

    def __post_init__(self) -> None:
        check_int(self.tile, "tile", 2)
        if self.tile**2 > chunkselect.MAX_CHUNK:
            raise ValueError(f"tile must be at most 256 (tile**2 positions in 16 bits), got {self.tile}")
        check_int(self.topk, "topk", 1)
        if self.topk > self.tile**2:
            raise ValueError(f"topk must be at most tile**2 = {self.tile**2}, got {self.topk}")
        check_number(self.decay, "decay", 0.0, 1.0, low_open=False)
        if self.values not in DTYPES:
            raise ValueError(f"values must be one of {', '.join(DTYPES)}, got {self.values!r}")
        if self.mean not in chunkselect.MEAN_OVER:
            raise ValueError(f"mean must be one of {', '.join(chunkselect.MEAN_OVER)}, got {self.mean!r}")
        if self.tiles not in TILES:
            raise ValueError(f"tiles must be one of {', '.join(TILES)}, got {self.tiles!r}")


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` (``C @ x`` transforms, ``C.T @ y`` inverts)."""
    k = torch.arange(n, dtype=torch.float64, device="cpu").view(-1, 1)
    i = torch.arange(n, dtype=torch.float64, device="cpu").view(1, -1)
    c = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c.to(dtype=dtype, device=device)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (1 for a prime above it)."""
    return next(d for d in range(min(n, at_most), 0, -1) if n % d == 0)


@dataclass(frozen=True)
class Blocks:
    """One tensor cut into blocks (``tiles="tensor"``): its place in the flat bucket, its ``rows x cols`` view, the
    block ``h x w``, the coefficients ``k`` sent per block, and its bytes in the message."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int
    k: int
    nbytes: int

    @property
    def count(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    def cut(self, flat: torch.Tensor) -> torch.Tensor:
        """``[blocks, h, w]`` from this tensor's part of a flat buffer (a copy)."""
        x = flat[self.offset : self.offset + self.rows * self.cols]
        x = x.view(self.rows // self.h, self.h, self.cols // self.w, self.w).transpose(1, 2)
        return x.reshape(-1, self.h, self.w)

    def join(self, blocks: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`cut`: this tensor's values, flat."""
        x = blocks.view(self.rows // self.h, self.cols // self.w, self.h, self.w).transpose(1, 2)
        return x.reshape(-1)


def blocks_of(shapes: tuple[torch.Size, ...], offsets: tuple[int, ...], tile: int, topk: int,
              value_bytes: int) -> list[Blocks]:  # fmt: skip
    out = []
    for shape, offset in zip(shapes, offsets):
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 1
        cols = numel // rows if rows else 0
        if numel == 0:
            continue
        h, w = largest_divisor(rows, tile), largest_divisor(cols, tile)
        k = min(topk, h * w)
        count = (rows // h) * (cols // w)
        out.append(Blocks(offset, rows, cols, h, w, k, count * k * (value_bytes + 2)))
    return out


@register
class DeMo(Compressor):
    """Momentum as error feedback, DCT tiles, top-k coefficients, the sign of the mean (see the module docstring)."""

    name: ClassVar[str] = "demo"
    config_class = DeMoConfig
    config: DeMoConfig
    handles_all_tensors: ClassVar[bool] = True

    def __init__(self, config: DeMoConfig | None = None, **options) -> None:  # noqa: ANN003
        super().__init__(config, **options)
        self.buckets = Buckets()
        self._dct: torch.Tensor | None = None
        self._dcts: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._density: float | None = None

    def make_memory(self) -> Memory:
        return Residual("momentum", decay=self.config.decay)

    def density(self) -> float:
        """Coefficients sent per value: ``topk / tile**2`` with flat tiles; with tiles cut from each tensor, what the
        last exchange's blocks sent (before the first, the nominal ``topk / tile**2``)."""
        if self._density is not None:
            return self._density
        return self.config.topk / self.config.tile**2

    def _dct_of(self, n: int, like: torch.Tensor) -> torch.Tensor:
        key = (n, like.dtype, like.device)
        if key not in self._dcts:
            self._dcts[key] = dct_matrix(n, like.dtype, like.device)
        return self._dcts[key]

    def _matrix(self, like: torch.Tensor) -> torch.Tensor:
        if self._dct is None or self._dct.dtype != like.dtype or self._dct.device != like.device:
            self._dct = dct_matrix(self.config.tile, like.dtype, like.device)
        return self._dct

    def _forward(self, flat: torch.Tensor) -> torch.Tensor:
        c, t = self._matrix(flat), self.config.tile
        return (c @ flat.view(-1, t, t) @ c.T).reshape(-1)

    def _inverse(self, flat: torch.Tensor) -> torch.Tensor:
        c, t = self._matrix(flat), self.config.tile
        return (c.T @ flat.view(-1, t, t) @ c).reshape(-1)

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        if len({(it.grad.dtype, it.grad.device) for it in items}) != 1:
            raise ValueError("the demo compressor needs one dtype and device for every tensor")
        if self.config.tiles == "tensor":
            yield from self._steps_by_tensor(items, phases)
            return
        cfg = self.config
        chunk, dtype = cfg.tile**2, DTYPES[cfg.values]
        with phases("compress"):
            bucket = self.buckets.of("demo", items, multiple=chunk)
            bucket.adopt(self.state, self.memory.keys)
            m = self.memory.compensate(bucket.gather(items), bucket.buffers)
            coefficients = self._forward(m)
            local, positions = chunkselect.select(coefficients, chunk, cfg.topk)
            values = coefficients[positions].to(dtype)
            sent = torch.zeros_like(m)
            sent[positions] = values.to(m.dtype)
            m.sub_(self._inverse(sent))
            m[bucket.layout.total :].zero_()  # the padding's share is no tensor's: not kept (nor checkpointed)
            phases.counters["values_sent"] += positions.numel()
            phases.counters["values_target"] += positions.numel()
            message = chunkselect.encode(values, local, dtype)
        rows = yield Allgather(message)
        with phases("decompress"):
            chunkselect.decode_mean_into(bucket.grad, rows, chunk, cfg.topk, dtype, cfg.mean)
            mean = self._inverse(bucket.grad)
            bucket.grad.copy_(mean.sign() if cfg.sign else mean)
            bucket.grad[bucket.layout.total :].zero_()  # the padding stays zero (a gather never writes it)
            bucket.scatter(items)

    def _steps_by_tensor(self, items: list[Item], phases: Phases) -> Steps:
        """``tiles="tensor"``: the same steps on blocks cut from each tensor's own dimensions, one message."""
        cfg = self.config
        dtype = DTYPES[cfg.values]
        with phases("compress"):
            bucket = self.buckets.of("demo", items)
            plan = bucket.plans.get("blocks")
            if plan is None:
                layout = bucket.layout
                plan = bucket.plans["blocks"] = blocks_of(layout.shapes, layout.offsets, cfg.tile, cfg.topk,
                                                          dtype.itemsize)  # fmt: skip
            bucket.adopt(self.state, self.memory.keys)
            m = self.memory.compensate(bucket.gather(items), bucket.buffers)
            messages, sent_count = [], 0
            for b in plan:
                ch, cw = self._dct_of(b.h, m), self._dct_of(b.w, m)
                coefficients = (ch @ b.cut(m) @ cw.T).reshape(-1)
                local, positions = chunkselect.select(coefficients, b.h * b.w, b.k)
                values = coefficients[positions].to(dtype)
                sent = torch.zeros_like(coefficients)
                sent[positions] = values.to(m.dtype)
                back = ch.T @ sent.view(-1, b.h, b.w) @ cw
                m[b.offset : b.offset + b.rows * b.cols].sub_(b.join(back))
                messages.append(chunkselect.encode(values, local, dtype))
                sent_count += positions.numel()
            phases.counters["values_sent"] += sent_count
            phases.counters["values_target"] += sent_count
            self._density = sent_count / max(bucket.layout.total, 1)
            message = torch.cat(messages) if messages else torch.zeros(0, dtype=torch.uint8, device=m.device)
        rows = yield Allgather(message)
        with phases("decompress"):
            lo = 0
            for b in plan:
                ch, cw = self._dct_of(b.h, m), self._dct_of(b.w, m)
                mean = torch.zeros(b.count * b.h * b.w, dtype=m.dtype, device=m.device)
                segment = rows[:, lo : lo + b.nbytes].clone()  # its own storage: the dtype views need alignment
                chunkselect.decode_mean_into(mean, segment, b.h * b.w, b.k, dtype, cfg.mean)
                decoded = b.join(ch.T @ mean.view(-1, b.h, b.w) @ cw)
                bucket.grad[b.offset : b.offset + b.rows * b.cols].copy_(decoded.sign() if cfg.sign else decoded)
                lo += b.nbytes
            bucket.scatter(items)
