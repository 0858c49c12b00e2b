"""Which tensors a compressor gets, and how the others (biases, BatchNorm) are exchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgc.wire import DTYPES

#: how the tensors the policy leaves dense are exchanged
DENSE_VALUES = (*DTYPES, "1bit")


@dataclass
class Policy:
    """Which tensors are compressed: ``ndim >= min_ndim`` and ``numel >= min_numel``.

    The default is the paper's: weights of convolutions and linear layers (dim > 1) compressed;
    biases and BatchNorm parameters sent dense, in ``dense_values``: fp32, fp16 or bf16 (an
    allreduce), or ``1bit`` (signs and one scale per tensor, with error feedback:
    :mod:`dgc.compressors.onebit`).
    """

    min_ndim: int = 2
    min_numel: int = 1
    dense_values: str = "fp32"

    def __post_init__(self) -> None:
        if self.min_ndim < 0 or self.min_numel < 0:
            raise ValueError("policy min_ndim and min_numel must be >= 0")
        if self.dense_values not in DENSE_VALUES:
            raise ValueError(f"policy dense_values must be one of {list(DENSE_VALUES)}, got {self.dense_values!r}")

    def compresses(self, param: torch.Tensor) -> bool:
        return param.dim() >= self.min_ndim and param.numel() >= self.min_numel
