"""QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, NeurIPS 2017): stochastic quantization to s levels.

Each tensor is cut into buckets of ``bucket_size`` consecutive values (0: the whole tensor is one
bucket), and every value ``v_i`` of a bucket with L2 norm ``n`` becomes

    n * sign(v_i) * l_i / s,   l_i = floor(|v_i| / n * s) + Bernoulli(frac(|v_i| / n * s)),

an unbiased estimate of ``v_i`` with ``l_i`` in ``0..s``. On the wire: the fp32 norms, then each value's
level and sign packed in ``1 + bit_length(s)`` bits (:mod:`dgc.bits`; the paper's Elias coding of the
levels would save a little more at small s). Every worker's message has the same size: one allgather,
then every worker decodes all messages and averages them. No error feedback, no state but the random
stream (each worker draws its own, :class:`~dgc.compressors.base.Stochastic`).

The default, 7 levels in buckets of 512 values, is the paper's "4-bit QSGD": 4 bits per value plus 32
bits per bucket, about 7.9x smaller than fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import bits
from dgc.bucket import Buckets
from dgc.collectives import Allgather, Steps
from dgc.compressors.base import CompressorConfig, Item, Stochastic, check_int, register
from dgc.timing import Phases


@dataclass
class QSGDConfig(CompressorConfig):
    name: str = "qsgd"
    #: s: the quantization levels of |v| / norm (1 to 127)
    levels: int = 7
    #: values that share one norm (0: one norm per tensor)
    bucket_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if check_int(self.levels, "levels", 1) > 127:
            raise ValueError(f"levels must be an integer in [1, 127], got {self.levels!r}")
        check_int(self.bucket_size, "bucket_size", 0)

    @property
    def code_bits(self) -> int:
        """Bits per value on the wire: the level and a sign bit."""
        return self.levels.bit_length() + 1


#: how many sets of tensor sizes QSGD keeps bucket ids for (one per DDP bucket under the overlapped hook; more means
#: the sets keep changing, and the kept ids are dropped)
KEPT_LAYOUTS = 64


@register
class QSGD(Stochastic):
    name: ClassVar[str] = "qsgd"
    config_class = QSGDConfig
    config: QSGDConfig
    handles_all_tensors: ClassVar[bool] = True

    def __init__(self, config: QSGDConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        #: the bucket ids of each set of tensor sizes (the overlapped hook's parts each have theirs)
        self._bucket_ids: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self.flat = Buckets()

    def bucket_ids(self, sizes: list[int], device: torch.device) -> torch.Tensor:
        """The bucket of every value of the concatenated tensors (buckets never span two tensors); made once per
        set of sizes (kept for up to :data:`KEPT_LAYOUTS` sets)."""
        key = (tuple(sizes), torch.device(device))
        ids = self._bucket_ids.get(key)
        if ids is None:
            d = self.config.bucket_size
            parts, first = [], 0
            for n in sizes:
                local = torch.arange(n, device=device) // d if d else torch.zeros(n, dtype=torch.int64, device=device)
                parts.append(local + first)
                first += (n + d - 1) // d if d else 1
            if len(self._bucket_ids) >= KEPT_LAYOUTS:
                self._bucket_ids.clear()
            ids = self._bucket_ids[key] = torch.cat(parts)
        return ids

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        s, width = self.config.levels, self.config.code_bits
        sizes = [it.grad.numel() for it in items]
        with phases("compress"):
            flat = self.flat.of("qsgd", items)
            x = flat.gather(items).float()
            bucket = self.bucket_ids(sizes, x.device)
            d = self.config.bucket_size
            count = sum((n + d - 1) // d for n in sizes) if d else len(sizes)
            norms = torch.zeros(count, device=x.device).index_add_(0, bucket, x * x).sqrt_()
            scaled = x.abs().div_(norms[bucket].clamp_min(torch.finfo(torch.float32).tiny)).mul_(s)
            level = scaled.floor()
            rand = torch.rand(x.numel(), generator=self.generator_on(x.device), device=x.device)
            level.add_(rand < scaled.sub_(level)).clamp_(max=s)
            codes = level.to(torch.uint8) | ((x < 0).to(torch.uint8) << (width - 1))
            message = torch.cat([norms.view(torch.uint8), bits.pack(codes, width)])
            phases.counters["values_sent"] += x.numel()
        rows = yield Allgather(message)
        with phases("decompress"):
            all_norms = rows[:, : 4 * count].reshape(-1).view(torch.float32).view(-1, count)  # [workers, buckets]
            all_codes = bits.unpack(rows[:, 4 * count :], x.numel(), width)  # [workers, values]
            level = (all_codes & ((1 << (width - 1)) - 1)).float()
            sign = 1.0 - 2.0 * (all_codes >> (width - 1)).float()
            mean = (sign * level * all_norms[:, bucket]).mean(0).div_(s)
            flat.scatter(items, mean)
