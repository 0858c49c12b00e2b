"""Wire format of sparse payloads: one byte message per worker per step.

A message carries the selected entries of T tensors (the same T tensors, in the
same order, on every worker)::

    header   int32[2T]       per tensor: number of values m_t, and s_t (below)
    values   m values        fp32 | fp16 | bf16, tensor after tensor
    indices  index block     by format (below), tensor after tensor

each block padded to a multiple of 4 bytes. Index formats:

* ``int32``: each position as an int32 (s_t = m_t words): 4 bytes per value.
* ``delta16``: the paper's encoding: each selected position is written as the gap to
  the previous one (the first as position + 1) in 16 bits (s_t = number of words). A gap
  larger than 65535 is written as ``q`` escape words (value 0, meaning "advance 65535, no
  value") followed by the remainder in [1, 65535], so any gap is representable and the
  common case costs 2 bytes. With fp32 values that is 6 bytes per sent value, against 8
  for fp32 + int32.
* ``rice``: the same gaps, minus one, Golomb-Rice coded with a parameter b_t per tensor
  (s_t = b_t, chosen to minimize the tensor's bits): gap - 1 = q * 2**b + r is written as
  q one-bits and a zero-bit in a *unary* bit stream, and r in b bits in a *remainder* bit
  stream. The index block is ``int32 unary_bits``, the unary stream, then the remainder
  stream (bits LSB first, each stream padded to 4 bytes). Rice codes are within a few
  percent of the entropy of geometric gaps, the gaps of uniformly scattered positions: at
  density 0.001 about 11.5 bits per value instead of 16. Splitting the streams makes both
  directions vectorizable: the zero-bits of the unary stream delimit the codes.
* ``bitmap``: one bit per entry of each tensor (s_t = ceil(numel_t / 8) bytes, each
  tensor's bitmap starting on a byte): 8 / density bits per value, cheaper than gap codes
  above roughly 40% density (warm-up densities, small tensors).
* ``auto``: per message, whichever of ``rice`` and ``bitmap`` is smaller, flagged by a
  leading int32 word (1: rice, 2: bitmap) before the message of that format.

``bitmap`` and ``auto`` need the tensors' sizes (``numels``) to encode; decoding takes
them from the offsets and the header. Everything is vectorized torch code: no Python
loop runs over values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INDEX_FORMATS = ("delta16", "int32", "rice", "bitmap", "auto")
_ESCAPE_GAP = 65535
_AUTO_TAGS = {"rice": 1, "bitmap": 2}
_MAX_RICE_B = 31


@dataclass(frozen=True)
class WireFormat:
    """How sparse values and indices are written. Validated on construction."""

    values: str = "fp32"
    indices: str = "delta16"

    def __post_init__(self) -> None:
        if self.values not in VALUE_DTYPES:
            raise ValueError(f"wire values must be one of {sorted(VALUE_DTYPES)}, got {self.values!r}")
        if self.indices not in INDEX_FORMATS:
            raise ValueError(f"wire indices must be one of {list(INDEX_FORMATS)}, got {self.indices!r}")

    @property
    def value_dtype(self) -> torch.dtype:
        return VALUE_DTYPES[self.values]


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _segment_ids(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def delta16_encode(indices: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode per-tensor sorted local positions into 16-bit gap words.

    ``indices``: int64, concatenation of T ascending runs; ``counts[t]`` = length of run t.
    Returns ``(words int32 in [0, 65535], words_per_tensor)``.
    """
    if indices.numel() == 0:
        return indices.new_zeros(0, dtype=torch.int32), torch.zeros_like(counts)
    prev = torch.empty_like(indices)
    prev[1:] = indices[:-1]
    starts = torch.cumsum(counts, 0) - counts  # first entry of each run
    starts = starts[counts > 0]
    prev[starts] = -1
    gaps = indices - prev  # >= 1 within sorted runs
    escapes = torch.div(gaps - 1, _ESCAPE_GAP, rounding_mode="floor")
    rest = gaps - escapes * _ESCAPE_GAP
    slot = torch.cumsum(escapes + 1, 0) - 1  # where each remainder word lands
    words = torch.zeros(int(slot[-1]) + 1, dtype=torch.int32, device=indices.device)
    words[slot] = rest.to(torch.int32)
    per_tensor = torch.zeros_like(counts).index_add_(0, _segment_ids(counts), escapes + 1)
    return words, per_tensor


def delta16_decode(words: torch.Tensor, words_per_tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`delta16_encode`: local positions, tensor after tensor."""
    if words.numel() == 0:
        return words.new_zeros(0, dtype=torch.int64)
    w = words.to(torch.int64)
    escape = w == 0
    steps = torch.where(escape, torch.full_like(w, _ESCAPE_GAP), w)
    total = torch.cumsum(steps, 0)
    # subtract the running total reached before each tensor's first word
    ends = torch.cumsum(words_per_tensor, 0)
    before = torch.zeros_like(words_per_tensor)
    nonempty_prev = (ends - words_per_tensor) > 0
    before[nonempty_prev] = total[(ends - words_per_tensor)[nonempty_prev] - 1]
    local = total - torch.repeat_interleave(before, words_per_tensor) - 1
    return local[~escape]


def _nbytes(bits: int) -> int:
    return (bits + 7) // 8


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 values (any integer or bool dtype) into bytes, least significant bit first."""
    n = bits.numel()
    padded = torch.zeros(_nbytes(n) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=bits.device)
    return (padded.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits as a uint8 tensor of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(1) >> shifts) & 1).view(-1)[:nbits]


def _gaps(indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-tensor gaps of ascending positions (the first one is position + 1); all >= 1."""
    prev = torch.empty_like(indices)
    prev[1:] = indices[:-1]
    starts = torch.cumsum(counts, 0) - counts
    prev[starts[counts > 0]] = -1
    return indices - prev


def _positions_from_gaps(gaps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_gaps`."""
    total = torch.cumsum(gaps, 0)
    ends = torch.cumsum(counts, 0)
    before = torch.zeros_like(counts)
    nonempty_prev = (ends - counts) > 0
    before[nonempty_prev] = total[(ends - counts)[nonempty_prev] - 1]
    return total - torch.repeat_interleave(before, counts) - 1


def rice_parameters(indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per tensor, the Rice parameter b in [0, 31] that minimizes the tensor's coded bits."""
    num_tensors = counts.numel()
    if indices.numel() == 0:
        return torch.zeros(num_tensors, dtype=torch.int64, device=counts.device)
    x = _gaps(indices, counts) - 1
    bs = torch.arange(_MAX_RICE_B + 1, device=x.device)
    quotients = torch.zeros(num_tensors, bs.numel(), dtype=torch.int64, device=x.device)
    quotients.index_add_(0, _segment_ids(counts), x.unsqueeze(1) >> bs)
    bits = quotients + counts.unsqueeze(1) * (1 + bs)
    return torch.argmin(bits, dim=1)


def rice_encode(
    indices: torch.Tensor, counts: torch.Tensor, params: torch.Tensor
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(unary stream bytes, unary bit count, remainder stream bytes)`` of ascending per-tensor positions."""
    device = indices.device
    if indices.numel() == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=device)
        return empty, 0, empty
    x = _gaps(indices, counts) - 1
    b = torch.repeat_interleave(params.to(device), counts)
    q = x >> b
    r = x - (q << b)
    # unary: q ones, then a zero
    zeros_at = torch.cumsum(q + 1, 0) - 1
    unary_bits = int(zeros_at[-1]) + 1
    unary = torch.ones(unary_bits, dtype=torch.uint8, device=device)
    unary[zeros_at] = 0
    # remainders: b bits each, LSB first
    ends = torch.cumsum(b, 0)
    rem_bits = int(ends[-1])
    rem = torch.zeros(rem_bits, dtype=torch.uint8, device=device)
    width = int(b.max())
    if width:
        j = torch.arange(width, device=device)
        keep = j < b.unsqueeze(1)
        where = (ends - b).unsqueeze(1) + j
        rem[where[keep]] = ((r.unsqueeze(1) >> j) & 1)[keep].to(torch.uint8)
    return pack_bits(unary), unary_bits, pack_bits(rem)


def rice_decode(
    unary: torch.Tensor, unary_bits: int, rem: torch.Tensor, counts: torch.Tensor, params: torch.Tensor
) -> torch.Tensor:
    """Inverse of :func:`rice_encode`: local positions, tensor after tensor."""
    device = unary.device
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    bits = unpack_bits(unary, unary_bits)
    zeros_at = torch.nonzero(bits == 0).view(-1)
    if zeros_at.numel() != total:
        raise ValueError(f"corrupt rice stream: {zeros_at.numel()} codes for {total} values")
    prev = torch.cat([zeros_at.new_tensor([-1]), zeros_at[:-1]])
    q = zeros_at - prev - 1
    b = torch.repeat_interleave(params.to(device), counts.to(device))
    r = torch.zeros_like(q)
    width = int(b.max())
    if width:
        ends = torch.cumsum(b, 0)
        rbits = unpack_bits(rem, int(ends[-1])).to(torch.int64)
        j = torch.arange(width, device=device)
        keep = j < b.unsqueeze(1)
        where = ((ends - b).unsqueeze(1) + j).clamp_(max=max(int(ends[-1]) - 1, 0))
        r = ((rbits[where] * keep) << j).sum(1)
    gaps = (q << b) + r + 1
    return _positions_from_gaps(gaps, counts.to(device))


def bitmap_encode(
    indices: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bitmap bytes, bytes per tensor)``: one bit per entry, each tensor starting on a byte."""
    nbytes = (numels + 7) // 8
    starts = torch.cumsum(nbytes, 0) - nbytes
    bits = torch.zeros(int(nbytes.sum()) * 8, dtype=torch.uint8, device=indices.device)
    if indices.numel():
        bits[indices + 8 * torch.repeat_interleave(starts, counts)] = 1
    return pack_bits(bits), nbytes


def bitmap_decode(data: torch.Tensor, nbytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`bitmap_encode`: ``(local positions, values per tensor)``."""
    hits = torch.nonzero(unpack_bits(data, data.numel() * 8)).view(-1)
    starts = torch.cumsum(nbytes, 0) - nbytes
    tensor_of = torch.searchsorted(8 * starts, hits, right=True) - 1
    counts = torch.bincount(tensor_of, minlength=nbytes.numel()) if hits.numel() else torch.zeros_like(nbytes)
    return hits - 8 * starts[tensor_of], counts


def _values_block(values: list[torch.Tensor], fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    device = values[0].device if values else torch.device("cpu")
    counts = torch.tensor([v.numel() for v in values], dtype=torch.int64, device=device)
    vals = torch.cat(values).to(fmt.value_dtype) if values else torch.zeros(0, dtype=fmt.value_dtype)
    return counts, vals


def _join(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = sum(_pad4(p.numel()) for p in parts)
    out = torch.zeros(total, dtype=torch.uint8, device=device)
    pos = 0
    for p in parts:
        out[pos : pos + p.numel()] = p.to(out.device)
        pos += _pad4(p.numel())
    return out


def encoded_size(
    values: list[torch.Tensor], indices: list[torch.Tensor], fmt: WireFormat, numels: list[int] | None = None
) -> int:
    """Bytes :func:`encode` would produce (computes the Rice parameters, not the streams)."""
    counts = torch.tensor([v.numel() for v in values], dtype=torch.int64)
    n_vals = int(counts.sum())
    base = 8 * len(values) + _pad4(n_vals * torch.finfo(fmt.value_dtype).bits // 8)
    idx = torch.cat(indices).to(torch.int64).cpu() if indices else torch.zeros(0, dtype=torch.int64)
    if fmt.indices == "int32":
        return base + 4 * n_vals
    if fmt.indices == "delta16":
        _, per_tensor = delta16_encode(idx, counts)
        return base + _pad4(2 * int(per_tensor.sum()))
    if fmt.indices == "bitmap":
        if numels is None:
            raise ValueError("the bitmap index format needs the tensor sizes (numels)")
        return base + _pad4(sum((n + 7) // 8 for n in numels))
    if fmt.indices == "rice":
        if n_vals == 0:
            return base + 4
        params = rice_parameters(idx, counts)
        x = _gaps(idx, counts) - 1
        b = torch.repeat_interleave(params, counts)
        unary = int((x >> b).sum()) + n_vals
        return base + 4 + _pad4(_nbytes(unary)) + _pad4(_nbytes(int(b.sum())))
    return 4 + min(encoded_size(values, indices, WireFormat(fmt.values, name), numels) for name in ("rice", "bitmap"))


def encode(
    values: list[torch.Tensor],
    indices: list[torch.Tensor],
    fmt: WireFormat,
    numels: list[int] | None = None,
) -> torch.Tensor:
    """Pack per-tensor ``(values, local indices)`` into one uint8 message.

    Indices of each tensor must be ascending for the gap formats (the selectors return
    them so). ``numels`` (the tensors' sizes) is needed by ``bitmap`` and ``auto``.
    """
    if fmt.indices == "auto":
        if numels is None:
            raise ValueError("the auto index format needs the tensor sizes (numels)")
        choice = min(
            ("rice", "bitmap"), key=lambda name: encoded_size(values, indices, WireFormat(fmt.values, name), numels)
        )
        inner = encode(values, indices, WireFormat(fmt.values, choice), numels)
        tag = torch.tensor([_AUTO_TAGS[choice]], dtype=torch.int32).view(torch.uint8).to(inner.device)
        return torch.cat([tag, inner])
    counts, vals = _values_block(values, fmt)
    idx = torch.cat(indices).to(torch.int64) if indices else torch.zeros(0, dtype=torch.int64)
    if fmt.indices == "int32":
        index_parts, per_tensor = [_as_bytes(idx.to(torch.int32))], counts
    elif fmt.indices == "delta16":
        words, per_tensor = delta16_encode(idx, counts)
        index_parts = [_as_bytes(words.to(torch.uint16))]
    elif fmt.indices == "rice":
        per_tensor = rice_parameters(idx, counts)
        unary, unary_bits, rem = rice_encode(idx, counts, per_tensor)
        word = torch.tensor([unary_bits], dtype=torch.int32, device=vals.device)
        index_parts = [_as_bytes(word), unary, rem]
    else:  # bitmap
        if numels is None or len(numels) != len(values):
            raise ValueError("the bitmap index format needs the tensor sizes (numels), one per tensor")
        data, per_tensor = bitmap_encode(idx, counts, torch.tensor(numels, dtype=torch.int64, device=idx.device))
        index_parts = [data]
    header = torch.stack([counts, per_tensor.to(counts.device)], 1).view(-1).to(torch.int32)
    return _join([_as_bytes(header), _as_bytes(vals), *index_parts], vals.device)


def decode(message: torch.Tensor, offsets: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack one worker's message into ``(flat positions, fp32 values)``.

    ``offsets[t]`` is where tensor t starts in the flat space of all T tensors.
    """
    if fmt.indices == "auto":
        tag = int(message[:4].view(torch.int32)[0])
        names = {v: k for k, v in _AUTO_TAGS.items()}
        if tag not in names:
            raise ValueError(f"corrupt auto message: unknown index format tag {tag}")
        return decode(message[4:], offsets, WireFormat(fmt.values, names[tag]))
    num_tensors = offsets.numel()
    header = message[: 8 * num_tensors].view(torch.int32).view(num_tensors, 2).to(torch.int64)
    counts, per_tensor = header[:, 0], header[:, 1]
    n_vals, n_words = int(counts.sum()), int(per_tensor.sum())
    value_dtype = fmt.value_dtype
    vpos = _pad4(8 * num_tensors)
    vbytes = n_vals * torch.finfo(value_dtype).bits // 8
    values = message[vpos : vpos + vbytes].view(value_dtype).to(torch.float32)
    ipos = vpos + _pad4(vbytes)
    if fmt.indices == "int32":
        local = message[ipos : ipos + 4 * n_words].view(torch.int32).to(torch.int64)
    elif fmt.indices == "delta16":
        words = message[ipos : ipos + 2 * n_words].view(torch.uint16).to(torch.int32)
        local = delta16_decode(words, per_tensor)
    elif fmt.indices == "rice":
        unary_bits = int(message[ipos : ipos + 4].view(torch.int32)[0])
        ubytes = _nbytes(unary_bits)
        unary = message[ipos + 4 : ipos + 4 + ubytes]
        rpos = ipos + 4 + _pad4(ubytes)
        rem_bits = int((counts * per_tensor).sum())
        rem = message[rpos : rpos + _nbytes(rem_bits)]
        local = rice_decode(unary, unary_bits, rem, counts, per_tensor)
    else:  # bitmap
        local, found = bitmap_decode(message[ipos : ipos + n_words], per_tensor)
        if not torch.equal(found.to(counts.device), counts):
            raise ValueError("corrupt bitmap message: set bits do not match the value counts")
    flat = local + torch.repeat_interleave(offsets.to(local.device), counts.to(local.device))
    return flat, values
