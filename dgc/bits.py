"""Packing small unsigned codes into bytes, least significant bits first.

``pack(codes, width)`` writes code ``i`` (an integer in ``[0, 2**width)``) into bits
``i * width ... i * width + width - 1`` of the output, bit ``j`` of the stream being bit
``j % 8`` of byte ``j // 8``. Widths that divide 8 (1, 2, 4) never split a code across bytes;
other widths (3 bits for 5-level QSGD, say) go through single bits. ``unpack`` is the inverse and
works on a batch (``[..., nbytes]``: one row per worker of an allgather).
"""

from __future__ import annotations

import torch


def packed_bytes(count: int, width: int) -> int:
    """Bytes of ``count`` codes of ``width`` bits."""
    return (count * width + 7) // 8


def _check(width: int) -> None:
    if not 1 <= width <= 8:
        raise ValueError(f"code width must be 1 to 8 bits, got {width}")


def pack(codes: torch.Tensor, width: int = 1) -> torch.Tensor:
    """Pack a 1-D tensor of codes in ``[0, 2**width)`` (any integer or bool dtype) into uint8."""
    _check(width)
    codes = codes.reshape(-1).to(torch.uint8)
    if 8 % width:
        shifts = torch.arange(width, dtype=torch.uint8, device=codes.device)
        return pack((codes.unsqueeze(1) >> shifts) & 1, 1)
    per_byte = 8 // width
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=codes.device)
    return (codes.view(-1, per_byte) << shifts).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """The first ``count`` codes of each row of ``packed`` (``[..., nbytes]`` uint8): ``[..., count]`` uint8."""
    _check(width)
    if 8 % width:
        bits = unpack(packed, count * width, 1).view(*packed.shape[:-1], count, width)
        weights = torch.tensor([1 << j for j in range(width)], dtype=torch.uint8, device=packed.device)
        return (bits * weights).sum(-1, dtype=torch.uint8)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return codes.flatten(-2)[..., :count]
