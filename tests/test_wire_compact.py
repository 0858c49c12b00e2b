"""Compact wire formats: Rice-coded gaps, bitmaps, automatic choice; round trips, sizes, layouts."""

from __future__ import annotations

import math

import pytest
import torch

from dgc import wire
from dgc.comm import Comm
from dgc.compressors import build_compressor
from dgc.compressors.base import Item
from dgc.timing import Phases
from tests import multiproc
from tests.test_wire import _cases, _payload, _random_positions

NEW_FORMATS = ("rice", "bitmap", "auto")
ALL_FORMATS = ("int32", "delta16", *NEW_FORMATS)


def _numels(cases) -> list[int]:
    return [n for n, _ in cases]


@pytest.mark.parametrize("values_fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("indices_fmt", NEW_FORMATS)
def test_round_trip(values_fmt, indices_fmt):
    cases = _cases()
    values, indices, offsets = _payload(cases)
    fmt = wire.WireFormat(values_fmt, indices_fmt)
    message = wire.encode(values, indices, fmt, _numels(cases))
    assert message.dtype == torch.uint8 and message.dim() == 1 and message.numel() % 4 == 0
    flat, decoded = wire.decode(message, offsets, fmt)
    expected = torch.cat([idx + off for idx, off in zip(indices, offsets.tolist())])
    assert torch.equal(flat, expected)
    assert torch.equal(decoded, torch.cat(values).to(fmt.value_dtype).float())


@pytest.mark.parametrize("indices_fmt", ALL_FORMATS)
def test_encoded_size_is_exact(indices_fmt):
    cases = _cases()
    values, indices, _ = _payload(cases)
    for values_fmt in ("fp32", "fp16"):
        fmt = wire.WireFormat(values_fmt, indices_fmt)
        message = wire.encode(values, indices, fmt, _numels(cases))
        assert wire.encoded_size(values, indices, fmt, _numels(cases)) == message.numel()


def test_random_index_sets_round_trip():
    gen = torch.Generator().manual_seed(11)
    for trial in range(25):
        num_tensors = int(torch.randint(1, 7, (1,), generator=gen))
        numels = [int(torch.randint(1, 300_000, (1,), generator=gen)) for _ in range(num_tensors)]
        indices = []
        for n in numels:
            m = int(torch.randint(0, min(n, 2000) + 1, (1,), generator=gen))
            indices.append(_random_positions(gen, n, m))
        values = [torch.randn(i.numel(), generator=gen) for i in indices]
        numel_t = torch.tensor(numels)
        offsets = torch.cumsum(numel_t, 0) - numel_t
        for name in NEW_FORMATS:
            fmt = wire.WireFormat("fp16", name)
            flat, vals = wire.decode(wire.encode(values, indices, fmt, numels), offsets, fmt)
            assert torch.equal(flat, torch.cat([i + o for i, o in zip(indices, offsets.tolist())])), (trial, name)
            assert torch.equal(vals, torch.cat(values).half().float()), (trial, name)


def test_rice_layout_by_hand():
    # positions 0, 3, 10: gaps 1, 3, 7, coded as gap - 1 = 0, 2, 6. Bits per b: b=0: 8 + 3 = 11,
    # b=1: 4 + 6 = 10, b=2: 1 + 9 = 10 -> b = 1 (the smallest best). q = 0, 1, 3; r = 0, 0, 0.
    idx = torch.tensor([0, 3, 10])
    vals = torch.tensor([1.0, -2.0, 3.0])
    fmt = wire.WireFormat("fp32", "rice")
    msg = wire.encode([vals], [idx], fmt)
    header = msg[:8].view(torch.int32).tolist()
    assert header == [3, 1]  # m = 3, b = 1
    assert torch.equal(msg[8:20].view(torch.float32), vals)
    assert msg[20:24].view(torch.int32).item() == 7  # unary bits: "0" "10" "1110"
    assert msg[24].item() == 0b0111010  # LSB first: 0,1,0,1,1,1,0
    assert msg[28].item() == 0  # three remainder bits, all zero
    assert msg.numel() == 32
    flat, out = wire.decode(msg, torch.tensor([0]), fmt)
    assert torch.equal(flat, idx) and torch.equal(out, vals)


def test_rice_parameters_minimize_bits():
    gen = torch.Generator().manual_seed(3)
    for n, m in [(1_000_000, 1000), (100_000, 5000), (10_000, 9000), (5_000_000, 50)]:
        idx = _random_positions(gen, n, m)
        counts = torch.tensor([m])
        best = int(wire.rice_parameters(idx, counts)[0])
        x = torch.diff(idx, prepend=torch.tensor([-1])) - 1

        bits = [int((x >> b).sum()) + m * (1 + b) for b in range(32)]
        assert bits[best] == min(bits)


def test_rice_costs_under_twelve_bits_per_index_at_density_0001():
    gen = torch.Generator().manual_seed(0)
    n, m = 2_000_000, 2000  # density 0.001: mean gap 1000, entropy of geometric gaps about 11.4 bits
    idx = _random_positions(gen, n, m)
    vals = torch.randn(m, generator=gen)
    rice = wire.encode([vals], [idx], wire.WireFormat("fp16", "rice"))
    delta = wire.encode([vals], [idx], wire.WireFormat("fp16", "delta16"))
    index_bytes = rice.numel() - 8 - 2 * m - 4
    assert index_bytes * 8 / m < 12.0
    assert rice.numel() < 0.9 * delta.numel()
    assert rice.numel() / m < 3.6  # bytes per sent value, fp16 values included


def test_bitmap_layout_and_sizes():
    idx = [torch.tensor([0, 9]), torch.tensor([2])]
    numels = [10, 3]
    vals = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    fmt = wire.WireFormat("fp32", "bitmap")
    msg = wire.encode(vals, idx, fmt, numels)
    header = msg[:16].view(torch.int32).view(2, 2).tolist()
    assert header == [[2, 2], [1, 1]]  # bytes per tensor: ceil(10/8) = 2, ceil(3/8) = 1
    ipos = 16 + 12
    assert msg[ipos : ipos + 3].tolist() == [0b00000001, 0b00000010, 0b00000100]
    assert msg.numel() == 16 + 12 + 4
    flat, out = wire.decode(msg, torch.tensor([0, 10]), fmt)
    assert flat.tolist() == [0, 9, 12] and out.tolist() == [1.0, 2.0, 3.0]


def test_auto_picks_the_smaller_format():
    gen = torch.Generator().manual_seed(5)
    n = 100_000
    fmt = wire.WireFormat("fp16", "auto")
    for density, expected in [(0.001, "rice"), (0.01, "rice"), (0.6, "bitmap"), (1.0, "bitmap")]:
        m = max(1, int(n * density))
        idx = _random_positions(gen, n, m)
        vals = torch.randn(m, generator=gen)
        msg = wire.encode([vals], [idx], fmt, [n])
        tag = int(msg[:4].view(torch.int32)[0])
        assert tag == {"rice": 1, "bitmap": 2}[expected], density
        sizes = {
            name: wire.encoded_size([vals], [idx], wire.WireFormat("fp16", name), [n]) for name in ("rice", "bitmap")
        }
        assert msg.numel() == 4 + min(sizes.values())
        flat, out = wire.decode(msg, torch.tensor([0]), fmt)
        assert torch.equal(flat, idx) and torch.equal(out, vals.half().float())


def test_formats_that_need_sizes_say_so():
    vals, idx = [torch.ones(1)], [torch.tensor([0])]
    for name in ("bitmap", "auto"):
        with pytest.raises(ValueError, match="numels"):
            wire.encode(vals, idx, wire.WireFormat("fp32", name))


def test_empty_selections():
    values = [torch.zeros(0), torch.zeros(0)]
    indices = [torch.zeros(0, dtype=torch.int64)] * 2
    for name in NEW_FORMATS:
        fmt = wire.WireFormat("fp16", name)
        msg = wire.encode(values, indices, fmt, [10, 20])
        flat, vals = wire.decode(msg, torch.tensor([0, 10]), fmt)
        assert flat.numel() == 0 and vals.numel() == 0


def test_bad_name_lists_every_format():
    with pytest.raises(ValueError) as err:
        wire.WireFormat(indices="golomb")
    for name in ALL_FORMATS:
        assert name in str(err.value)


@pytest.mark.parametrize("indices_fmt", NEW_FORMATS)
def test_dgc_conservation_with_compact_formats(indices_fmt):
    """The compressor path: what is sent plus the residual is the accumulator, whatever the format."""
    comp = build_compressor("dgc", density=0.05, wire_values="fp16", wire_indices=indices_fmt, seed=2)
    comm = Comm()
    comp.bind(comm)
    shapes = [(40, 30), (7,), (200, 5)]
    params = [torch.zeros(s) for s in shapes]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        items = [Item(f"t{i}", p, g.clone(), momentum=0.0) for i, (p, g) in enumerate(zip(params, grads))]
        before = [
            comp.state[it.name]["v"].clone() if it.name in comp.state else torch.zeros(p.numel())
            for it, p in zip(items, params)
        ]
        comp.exchange(items, comm, Phases())
        for it, b, g in zip(items, before, grads):
            v = comp.state[it.name]["v"]
            torch.testing.assert_close(it.grad.view(-1) + v, b + g.view(-1), rtol=0, atol=0)
            sent = it.grad.view(-1) != 0
            assert 0 < int(sent.sum()) <= math.ceil(it.grad.numel() * 0.05)


def _exchange_two_ranks(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    shapes = [(300, 100), (50,), (64, 64)]
    out = {}
    for indices_fmt in ("int32", "rice", "auto"):
        comp = build_compressor("dgc", density=0.02, wire_values="fp32", wire_indices=indices_fmt, seed=1)
        comm = Comm()
        comp.bind(comm)
        gen = torch.Generator().manual_seed(100 + rank)
        outs = []
        for _ in range(3):
            items = [Item(f"t{i}", torch.zeros(s), torch.randn(s, generator=gen)) for i, s in enumerate(shapes)]
            comp.exchange(items, comm, Phases())
            outs.append(torch.cat([it.grad.view(-1) for it in items]))
        out[indices_fmt] = outs
    return out


def test_compact_formats_exchange_the_same_values_across_ranks():
    """Two real processes: rice and auto deliver exactly what int32 indices deliver."""
    results = multiproc.run(_exchange_two_ranks, 2)
    for rank in range(2):
        for name in ("rice", "auto"):
            for a, b in zip(results[rank]["int32"], results[rank][name]):
                assert torch.equal(a, b), name
    for a, b in zip(results[0]["rice"], results[1]["rice"]):
        assert torch.equal(a, b)  # every rank holds the same average
