"""One way to derive seeds: ``mix(seed, rank)`` gives every (seed, rank) pair its own stream."""

from __future__ import annotations

import torch


def mix(*values: int, multiplier: int = 1_000_003) -> int:
    """A polynomial hash of ``values`` in ``[0, 2**63)``: ``mix(a, b) == a * multiplier + b`` for small values."""
    out = 0
    for v in values:
        out = (out * multiplier + int(v)) % 2**63
    return out


def generator(*values: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``mix(*values)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(mix(*values))
    return gen
