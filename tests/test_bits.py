"""dgc.bits: codes of 1 to 8 bits packed least significant first, unpacked one row per worker."""

from __future__ import annotations

import pytest
import torch

from dgc import bits


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 4 * 25 + 3])
def test_round_trip_of_every_width(width, count):
    gen = torch.Generator().manual_seed(width * 100 + count)
    codes = torch.randint(0, 2**width, (count,), generator=gen).to(torch.uint8)
    packed = bits.pack(codes, width)
    assert packed.dtype == torch.uint8 and packed.numel() == bits.packed_bytes(count, width)
    assert torch.equal(bits.unpack(packed, count, width), codes)
    rows = torch.stack([packed, bits.pack(codes.flip(0), width)])  # one row per worker
    assert torch.equal(bits.unpack(rows, count, width), torch.stack([codes, codes.flip(0)]))


def test_layout_is_least_significant_first():
    # code i of width w sits in bits i*w .. i*w+w-1 of the stream; bit j of the stream is bit j % 8 of byte j // 8
    assert bits.pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0b1000_0001, 0b1]
    assert bits.pack(torch.tensor([3, 0, 1, 2]), 2).tolist() == [0b10_01_00_11]
    assert bits.pack(torch.tensor([5, 2, 7]), 3).tolist() == [0b11_010_101, 0b1]


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="1 to 8 bits"):
        bits.pack(torch.zeros(3), 9)
