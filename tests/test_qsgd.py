"""QSGD: levels and signs on the wire, unbiasedness, bytes, and the average over real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc.comm import Comm
from dgc.compressors.base import Item
from dgc.compressors.qsgd import QSGD
from dgc.timing import Phases
from tests.multiproc import run


def quantize(grads: list[torch.Tensor], comp: QSGD) -> list[torch.Tensor]:
    """What one worker alone sends for ``grads`` (the exchange over a world of one), decoded."""
    items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads)]
    comp.exchange(items, Comm.local(), Phases())
    return [it.grad for it in items]


def test_values_are_bucket_norms_times_signed_levels():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1000, generator=gen)
    comp = QSGD(levels=3, bucket_size=100)
    (q,) = quantize([g], comp)
    for b in range(10):
        part, orig = q[100 * b : 100 * (b + 1)], g[100 * b : 100 * (b + 1)]
        levels = part.abs() / orig.norm() * 3
        torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-5)  # integers 0..3
        assert levels.max() <= 3 + 1e-5
        # a level is the floor or the ceiling of |v| / norm * s, with the sign of v
        exact = orig.abs() / orig.norm() * 3
        assert bool(((levels.round() - exact.floor()).abs() <= 1).all() and (levels.round() >= exact.floor()).all())
        nonzero = part != 0
        assert torch.equal(part[nonzero].sign(), orig[nonzero].sign())


def test_quantization_is_unbiased():
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(300, generator=gen)
    comp = QSGD(levels=2, bucket_size=0, seed=5)
    draws = torch.stack([quantize([g], comp)[0] for _ in range(4000)])
    # each entry is a two-point variable with spread norm / s: the mean of 4000 draws is within ~6 sd
    bound = 6 * g.norm() / 2 / math.sqrt(4000)
    assert (draws.mean(0) - g).abs().max() < bound
    assert (draws.std(0).max() > 0) and torch.unique(draws[:, 0]).numel() <= 2


def test_bytes_on_the_wire():
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Linear(40, 3))
    sizes = [p.numel() for p in model.parameters()]  # 2000, 40, 120, 3
    for levels, bucket in ((7, 512), (1, 0), (15, 64)):
        sync = dgc.GradientSync(model, dgc.build_compressor("qsgd", levels=levels, bucket_size=bucket))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        stats = sync.step()
        buckets = sum(math.ceil(n / bucket) for n in sizes) if bucket else len(sizes)
        width = levels.bit_length() + 1
        assert stats.sent_bytes == 4 * buckets + math.ceil(sum(sizes) * width / 8)
        assert stats.values_sent == sum(sizes) and stats.collectives == 1


@pytest.mark.parametrize(
    "options, message",
    [({"levels": 0}, "levels"), ({"levels": 128}, r"\[1, 127\]"), ({"levels": 2.5}, "levels"),
     ({"bucket_size": -1}, "bucket_size"), ({"levles": 3}, "valid: levels, bucket_size, seed")],
)  # fmt: skip
def test_bad_options_name_the_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        dgc.build_compressor("qsgd", **options)


def _average(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Linear(30, 4))
    comp = dgc.build_compressor("qsgd", levels=5, bucket_size=64, seed=2)
    sync = dgc.GradientSync(model, comp)
    gen = torch.Generator().manual_seed(rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    # this worker's own quantization: the same draws from the same stream, on a world of one
    alone = QSGD(comp.config)
    alone.generator.set_state(comp.generator.get_state())
    mine = quantize([p.grad.view(-1) for p in model.parameters()], alone)
    sync.step()
    return {"mine": mine, "got": [p.grad.view(-1).clone() for p in model.parameters()]}


@pytest.mark.parametrize("world", [2, 4])
def test_workers_get_the_average_of_every_quantization(world):
    outs = run(_average, world)
    for t in range(len(outs[0]["mine"])):
        expected = torch.stack([o["mine"][t] for o in outs]).mean(0)
        for o in outs:
            torch.testing.assert_close(o["got"][t], expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(outs[0]["mine"][0], outs[1]["mine"][0])  # each worker draws its own stream
