"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870): momentum that is also the error feedback, a DCT over fixed
tiles, the top coefficients of each tile sent, the sign of the decoded mean applied.

Per step, on a flat bucket of every tensor (padded with zeros to whole tiles):

1. ``m = decay * m + g``: the momentum (``decay`` 0.999, the paper's) takes the gradient;
2. each run of ``tile * tile`` consecutive values of ``m``, viewed as a ``tile x tile`` square, goes through the
   orthonormal 2-D DCT-II, and the ``topk`` largest coefficients of each tile are chosen (:mod:`dgc.chunkselect`:
   a fixed-size message, 16-bit positions in the tile);
3. what they stand for leaves the momentum: ``m -= IDCT(sent)`` (the momentum is its own error feedback);
4. one allgather; each worker averages every worker's coefficients, transforms back and writes ``sign(mean)`` into
   the gradient (``sign=false``: the mean itself). As in the authors' code, a coefficient's sum is divided by the
   number of workers that sent it (``mean=senders``); ``mean=workers`` divides by all of them instead.

The optimizer then applies ``p -= lr * (sign + weight_decay * p)``: with a sign, SGD's weight decay is the decoupled
one DeMo uses. So the optimizer runs without momentum (the momentum is here) and at a sign method's learning rate:
the ``demo`` preset sets ``optim.momentum=0`` and ``optim.lr=0.001`` (not scaled by the workers).

Where this differs from the paper's code, by choice: tiles are cut from the flattened bucket, not from each tensor's
own dimensions (one transform for every tensor, a small tensor shares a tile with its neighbours, as in chunk
selection); the momentum takes the gradient, not ``lr * gradient`` (the same direction while the rate is constant;
the sign discards the scale); positions are 16-bit, not int64. DeMo handles every tensor (biases and BatchNorm too).
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


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` (``C @ x`` transforms, ``C.T @ y`` inverts)."""
    k = torch.arange(n, dtype=torch.float64, device="cpu").view(-1, 1)
    i = torch.arange(n, dtype=torch.float64, device="cpu").view(1, -1)
    c = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c.to(dtype=dtype, device=device)


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

    def make_memory(self) -> Memory:
        return Residual("momentum", decay=self.config.decay)

    def density(self) -> float:
        return self.config.topk / self.config.tile**2

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
