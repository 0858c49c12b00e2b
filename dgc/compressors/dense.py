"""Dense baselines: the plain fp32 allreduce (``none``) and a 16-bit allreduce (``fp16``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from dgc.comm import Comm
from dgc.compressors.base import Compressor, Item, Phases, copy_back, flat_views

DENSE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def allreduce_dense(items: list[Item], comm: Comm, phases: Phases, dtype: torch.dtype) -> None:
    """Average the items' gradients with one allreduce of their concatenation in ``dtype``."""
    if not items:
        return
    with phases("compress"):
        flat = torch.cat(flat_views(items)).to(dtype)
    comm.allreduce_mean_(flat)
    with phases("decompress"):
        copy_back(items, flat.to(items[0].grad.dtype))


class Dense(Compressor):
    """Dense allreduce of every gradient in ``dtype`` (``none``: fp32, the baseline)."""

    name: ClassVar[str] = "none"
    handles_all_tensors: ClassVar[bool] = True
    dtype_name: ClassVar[str] = "fp32"

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        allreduce_dense(items, comm, phases, DENSE_DTYPES[self.dtype_name])


class FP16(Dense):
    """Dense allreduce in fp16 (2 bytes per value): the baseline any compression must beat."""

    name: ClassVar[str] = "fp16"
    dtype_name: ClassVar[str] = "fp16"
