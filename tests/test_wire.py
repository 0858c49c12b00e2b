"""Wire format of sparse payloads: round trips, escape words, byte layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from dgc import wire

VALUE_FORMATS = ("fp32", "fp16", "bf16")
INDEX_FORMATS = ("int32", "delta16")
FORMATS = list(itertools.product(VALUE_FORMATS, INDEX_FORMATS))
VALUE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _random_positions(gen: torch.Generator, numel: int, m: int) -> torch.Tensor:
    return torch.sort(torch.randperm(numel, generator=gen)[:m]).values


def _cases() -> list[tuple[int, torch.Tensor]]:
    """(numel, ascending local positions) per tensor: edge cases and random sets."""
    gen = torch.Generator().manual_seed(1234)
    big = 300_000
    return [
        (10, torch.tensor([], dtype=torch.int64)),  # m = 0
        (10, torch.tensor([0])),  # first index 0
        (10, torch.tensor([9])),  # last index numel - 1
        (10, torch.arange(10)),  # everything, gaps of 1
        (big, torch.tensor([65534])),  # first gap exactly 65535: no escape
        (big, torch.tensor([65535])),  # first gap 65536: one escape + remainder 1
        (big, torch.tensor([0, 65535, 131071])),  # gaps 1, 65535, 65536
        (big, torch.tensor([3, 200_000, big - 1])),  # gaps of several escapes
        (big, torch.tensor([big - 1])),  # a single far position
        (7, torch.tensor([], dtype=torch.int64)),  # another empty selection in the middle
        (1000, _random_positions(gen, 1000, 37)),
        (big, _random_positions(gen, big, 50)),  # sparse: most gaps > 65535 are rare, some big
        (5000, _random_positions(gen, 5000, 4999)),
        (1, torch.tensor([0])),
    ]


def _payload(cases, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(idx.numel(), generator=gen) * 10 for _, idx in cases]
    indices = [idx.to(torch.int64) for _, idx in cases]
    numels = torch.tensor([n for n, _ in cases], dtype=torch.int64)
    offsets = torch.cumsum(numels, 0) - numels
    return values, indices, offsets


def _expected_words(idx: torch.Tensor) -> list[int]:
    """delta16 words written by hand from the documented rule (position + 1 first, escapes of 65535)."""
    words, prev = [], -1
    for p in idx.tolist():
        gap = p - prev
        while gap > 65535:
            words.append(0)
            gap -= 65535
        words.append(gap)
        prev = p
    return words


@pytest.mark.parametrize("values_fmt,indices_fmt", FORMATS)
def test_round_trip(values_fmt, indices_fmt):
    cases = _cases()
    values, indices, offsets = _payload(cases)
    fmt = wire.WireFormat(values_fmt, indices_fmt)
    message = wire.encode(values, indices, fmt)
    assert message.dtype == torch.uint8 and message.dim() == 1
    flat, decoded = wire.decode(message, offsets, fmt)

    expected_flat = torch.cat([idx + off for idx, off in zip(indices, offsets.tolist())])
    expected_vals = torch.cat(values).to(fmt.value_dtype).to(torch.float32)
    assert flat.dtype == torch.int64 and decoded.dtype == torch.float32
    assert torch.equal(flat, expected_flat)
    # values are exactly the inputs rounded to the wire dtype (fp32: unchanged)
    assert torch.equal(decoded, expected_vals)
    if values_fmt == "fp32":
        assert torch.equal(decoded, torch.cat(values))
    else:
        assert not torch.equal(decoded, torch.cat(values))  # randn * 10 is not 16-bit representable


@pytest.mark.parametrize("values_fmt,indices_fmt", FORMATS)
def test_message_layout(values_fmt, indices_fmt):
    cases = _cases()
    values, indices, _ = _payload(cases)
    fmt = wire.WireFormat(values_fmt, indices_fmt)
    message = wire.encode(values, indices, fmt)
    num_tensors = len(cases)
    m = sum(v.numel() for v in values)
    if indices_fmt == "int32":
        words_per_tensor = [idx.numel() for idx in indices]
        word_bytes = 4
    else:
        words_per_tensor = [len(_expected_words(idx)) for idx in indices]
        word_bytes = 2
    expected_len = 8 * num_tensors + _pad4(m * VALUE_BYTES[values_fmt]) + _pad4(sum(words_per_tensor) * word_bytes)
    assert message.numel() % 4 == 0
    assert message.numel() == expected_len
    header = message[: 8 * num_tensors].view(torch.int32).view(num_tensors, 2)
    assert header[:, 0].tolist() == [v.numel() for v in values]
    assert header[:, 1].tolist() == words_per_tensor
    # values block starts right after the header
    vbytes = m * VALUE_BYTES[values_fmt]
    vals = message[8 * num_tensors : 8 * num_tensors + vbytes].view(fmt.value_dtype)
    assert torch.equal(vals, torch.cat(values).to(fmt.value_dtype))
    # index block after the padded values; padding bytes are zero
    ipos = 8 * num_tensors + _pad4(vbytes)
    assert torch.all(message[8 * num_tensors + vbytes : ipos] == 0)
    nbytes = sum(words_per_tensor) * word_bytes
    assert torch.all(message[ipos + nbytes :] == 0)
    if indices_fmt == "delta16":
        words = message[ipos : ipos + nbytes].view(torch.uint16).to(torch.int64).tolist()
        expected = [w for idx in indices for w in _expected_words(idx)]
        assert words == expected
    else:
        words = message[ipos : ipos + nbytes].view(torch.int32).to(torch.int64)
        assert torch.equal(words, torch.cat(indices))


def test_delta16_escape_words_exact():
    counts = torch.tensor([1, 1, 1, 2])
    # first gaps: 65535 (no escape), 65536 (escape + 1), 2 * 65535 + 1 (two escapes + 1); then gap 65535 within a run
    idx = torch.tensor([65534, 65535, 131070, 5, 65540])
    words, per_tensor = wire.delta16_encode(idx, counts)
    assert words.tolist() == [65535, 0, 1, 0, 0, 1, 6, 65535]
    assert per_tensor.tolist() == [1, 2, 3, 2]
    assert torch.equal(wire.delta16_decode(words, per_tensor), idx)


def test_delta16_costs_two_bytes_per_index_with_small_gaps():
    n, m = 100_000, 1000
    gen = torch.Generator().manual_seed(0)
    idx = _random_positions(gen, n, m)  # mean gap 100, max far below 65535
    vals = torch.randn(m, generator=gen)
    small = wire.encode([vals], [idx], wire.WireFormat("fp32", "delta16"))
    large = wire.encode([vals], [idx], wire.WireFormat("fp32", "int32"))
    assert small.numel() == 8 + 4 * m + 2 * m  # 6 bytes per sent value
    assert large.numel() == 8 + 4 * m + 4 * m  # 8 bytes per sent value
    half = wire.encode([vals], [idx], wire.WireFormat("fp16", "delta16"))
    assert half.numel() == 8 + 2 * m + 2 * m


def test_random_sorted_index_sets_round_trip():
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        num_tensors = int(torch.randint(1, 6, (1,), generator=gen))
        numels = [int(torch.randint(1, 400_000, (1,), generator=gen)) for _ in range(num_tensors)]
        indices = []
        for n in numels:
            m = int(torch.randint(0, min(n, 300) + 1, (1,), generator=gen))
            indices.append(_random_positions(gen, n, m))
        values = [torch.randn(i.numel(), generator=gen) for i in indices]
        numel_t = torch.tensor(numels)
        offsets = torch.cumsum(numel_t, 0) - numel_t
        for fmt in (wire.WireFormat("fp32", "delta16"), wire.WireFormat("bf16", "int32")):
            flat, vals = wire.decode(wire.encode(values, indices, fmt), offsets, fmt)
            expected = torch.cat([i + o for i, o in zip(indices, offsets.tolist())])
            assert torch.equal(flat, expected), (trial, fmt)
            assert torch.equal(vals, torch.cat(values).to(fmt.value_dtype).float()), (trial, fmt)


def test_all_selections_empty():
    values = [torch.zeros(0), torch.zeros(0)]
    indices = [torch.zeros(0, dtype=torch.int64)] * 2
    for values_fmt, indices_fmt in FORMATS:
        fmt = wire.WireFormat(values_fmt, indices_fmt)
        message = wire.encode(values, indices, fmt)
        assert message.numel() == 16
        assert torch.all(message == 0)
        flat, vals = wire.decode(message, torch.tensor([0, 10]), fmt)
        assert flat.numel() == 0 and vals.numel() == 0


def test_fp16_values_round_to_nearest_fp16():
    # values between two fp16 neighbours round to the nearest one
    x = torch.tensor([1.0 + 2**-11 + 2**-13, 1.0 + 2**-12, 1000.3, -3.14159, 1e-6, 6.0e4])
    fmt = wire.WireFormat("fp16", "int32")
    _, vals = wire.decode(wire.encode([x], [torch.arange(x.numel())], fmt), torch.tensor([0]), fmt)
    assert torch.equal(vals, x.half().float())
    assert vals[0].item() == 1.0 + 2**-10
    assert vals[1].item() == 1.0  # tie rounds to even
    # every decoded value is an fp16 number
    assert torch.equal(vals.half().float(), vals)


@pytest.mark.parametrize(
    "kwargs,valid",
    [
        ({"values": "fp8"}, ["bf16", "fp16", "fp32"]),
        ({"values": "float32"}, ["bf16", "fp16", "fp32"]),
        ({"indices": "int16"}, ["delta16", "int32"]),
        ({"indices": "delta"}, ["delta16", "int32"]),
    ],
)
def test_bad_wire_format_names(kwargs, valid):
    with pytest.raises(ValueError) as err:
        wire.WireFormat(**kwargs)
    message = str(err.value)
    for name in valid:
        assert name in message
    assert repr(next(iter(kwargs.values()))) in message


# -- encode_known / decode_known: the bucketed path's messages, sizes known on the host ------------------


def _selection(gen: torch.Generator, numels: list[int], with_long_gaps: bool):
    values, local = [], []
    for n in numels:
        m = int(torch.randint(0, min(n, 40) + 1, (1,), generator=gen))
        pos = torch.randperm(n, generator=gen)[:m].sort().values
        if with_long_gaps and n > 200_000 and m:
            pos = torch.unique(torch.cat([pos, torch.tensor([0, 70_000, n - 1])]))
        local.append(pos)
        values.append(torch.randn(pos.numel(), generator=gen))
    return values, local


@pytest.mark.parametrize("values_fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("indices_fmt", list(wire.KNOWN_FORMATS))
@pytest.mark.parametrize("with_long_gaps", [False, True])
def test_messages_made_from_known_sizes_are_the_messages_of_encode(values_fmt, indices_fmt, with_long_gaps):
    fmt = wire.WireFormat(values_fmt, indices_fmt)
    big = 300_000 if with_long_gaps else 60_000  # no gap can pass 65535 in the second case
    numels = [7, 1000, big, 1, 5000]
    offsets = list(itertools.accumulate([0, *numels[:-1]]))
    gen = torch.Generator().manual_seed(3)
    messages, expected, escaped = [], [], False
    for _ in range(3):  # three workers
        values, local = _selection(gen, numels, with_long_gaps)
        counts = torch.tensor([v.numel() for v in values])
        idx = torch.cat(local)
        gaps = wire._gaps(idx, counts)
        words = wire.delta16_encode(idx, counts)[1].tolist()
        escaped |= sum(words) > counts.sum()
        message = wire.encode_known(torch.cat(values), idx, gaps, counts.tolist(), words, fmt)
        assert torch.equal(message, wire.encode(values, local, fmt))
        messages.append(message)
        expected.append(wire.decode(message, torch.tensor(offsets), fmt))
    longest = max(m.numel() for m in messages)
    rows = torch.zeros(3, longest, dtype=torch.uint8)
    for r, m in enumerate(messages):
        rows[r, : m.numel()] = m
    flat, vals, ends = wire.decode_known(rows, offsets, fmt)
    assert ends == list(itertools.accumulate(p.numel() for p, _ in expected))
    assert torch.equal(flat, torch.cat([p for p, _ in expected]))
    assert torch.equal(vals, torch.cat([v for _, v in expected]))
    assert escaped == with_long_gaps  # gaps over 65535: escape words written and read


def test_only_the_formats_with_known_sizes_are_written_that_way():
    with pytest.raises(ValueError, match="delta16/int32 indices, not 'rice'"):
        wire.encode_known(torch.zeros(0), torch.zeros(0), torch.zeros(0), [0], [0], wire.WireFormat("fp32", "rice"))
