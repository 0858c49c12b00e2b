"""Dense baselines: the plain fp32 allreduce (``none``) and 16-bit allreduces (``fp16``, ``bf16``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgc.bucket import Buckets
from dgc.collectives import Collective, Steps
from dgc.comm import Comm
from dgc.compressors.base import Compressor, CompressorConfig, Item, Phases, register
from dgc.wire import DTYPES


def allreduce_dense(items: list[Item], comm: Comm, phases: Phases, dtype: torch.dtype, buckets: Buckets) -> None:
    """Average the items' gradients with one allreduce of their concatenation in ``dtype`` (made in the bucket of
    ``buckets`` for these items)."""
    if not items:
        return
    if not comm.collective and dtype == items[0].grad.dtype:
        # the average over one worker is its own gradient: count the bytes it would send, move none
        comm.traffic.add(sum(it.grad.numel() for it in items) * dtype.itemsize, 0)
        return
    with phases("compress"):
        bucket = buckets.of("dense", items)
        flat = bucket.gather(items).to(dtype)
    comm.allreduce_mean_(flat)
    with phases("decompress"):
        bucket.scatter(items, flat)


@dataclass
class AverageDense(Collective):
    """The items' gradients averaged in place (:func:`allreduce_dense`): a collective of its own so that one worker
    alone skips the flattening copies too."""

    items: list[Item]
    dtype: torch.dtype
    buckets: Buckets
    phases: Phases

    def run(self, comm: Comm) -> None:
        allreduce_dense(self.items, comm, self.phases, self.dtype, self.buckets)


@dataclass
class DenseConfig(CompressorConfig):
    """The fp32 allreduce: no options."""

    name: str = "none"


@register
class Dense(Compressor):
    """Dense allreduce of every gradient in ``dtype`` (``none``: fp32, the baseline)."""

    name: ClassVar[str] = "none"
    config_class = DenseConfig
    handles_all_tensors: ClassVar[bool] = True
    dtype_name: ClassVar[str] = "fp32"

    def __init__(self, config: CompressorConfig | None = None, **options) -> None:  # noqa: ANN003
        super().__init__(config, **options)
        self.buckets = Buckets()

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        yield AverageDense(items, DTYPES[self.dtype_name], self.buckets, phases)


@dataclass
class FP16Config(CompressorConfig):
    """The fp16 allreduce: no options."""

    name: str = "fp16"


@register
class FP16(Dense):
    """Dense allreduce in fp16 (2 bytes per value): the baseline any compression must beat."""

    name: ClassVar[str] = "fp16"
    config_class = FP16Config
    dtype_name: ClassVar[str] = "fp16"


@dataclass
class BF16Config(CompressorConfig):
    """The bf16 allreduce: no options."""

    name: str = "bf16"


@register
class BF16(Dense):
    """Dense allreduce in bf16 (2 bytes per value, fp32's range, 8 bits of mantissa): what DDP's
    ``bf16_compress_hook`` sends, and DiLoCo's pseudo-gradients in 16 bits."""

    name: ClassVar[str] = "bf16"
    config_class = BF16Config
    dtype_name: ClassVar[str] = "bf16"
