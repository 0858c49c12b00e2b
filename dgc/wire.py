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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgc import bits

#: value types on the wire, by name (also the dense exchange's)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INDEX_FORMATS = ("delta16", "int32", "rice", "bitmap", "auto")
#: the largest gap one delta16 word carries; a longer one is preceded by escape words
ESCAPE_GAP = 65535
_AUTO_TAGS = {"rice": 1, "bitmap": 2}
_MAX_RICE_B = 31


@dataclass(frozen=True)
class WireFormat:
    """How sparse values and indices are written. Validated on construction."""

    values: str = "fp32"
    indices: str = "delta16"

    def __post_init__(self) -> None:
        if self.values not in DTYPES:
            raise ValueError(f"wire values must be one of {sorted(DTYPES)}, got {self.values!r}")
        if self.indices not in INDEX_FORMATS:
            raise ValueError(f"wire indices must be one of {list(INDEX_FORMATS)}, got {self.indices!r}")

    @property
    def value_dtype(self) -> torch.dtype:
        return DTYPES[self.values]


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _segment_ids(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


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


def pack_bits(values: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 values into bytes, least significant bit first (:func:`dgc.bits.pack`)."""
    return bits.pack(values, 1)


def unpack_bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits as a uint8 tensor of 0/1."""
    return bits.unpack(data, nbits, 1)


# -- delta16 --------------------------------------------------------------------------------------------
def delta16_encode(indices: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode per-tensor sorted local positions into 16-bit gap words.

    ``indices``: int64, concatenation of T ascending runs; ``counts[t]`` = length of run t.
    Returns ``(words int32 in [0, 65535], words_per_tensor)``.
    """
    if indices.numel() == 0:
        return indices.new_zeros(0, dtype=torch.int32), torch.zeros_like(counts)
    words, escapes = _gap_words(_gaps(indices, counts))
    per_tensor = torch.zeros_like(counts).index_add_(0, _segment_ids(counts), escapes + 1)
    return words, per_tensor


def _gap_words(gaps: torch.Tensor, n_words: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta16 words of ``gaps`` (int32 in [0, 65535]) and each gap's number of escape words; ``n_words``:
    how many words there are, when the host already knows (else it is read from the device)."""
    escapes = torch.div(gaps - 1, ESCAPE_GAP, rounding_mode="floor")
    rest = gaps - escapes * ESCAPE_GAP
    slot = torch.cumsum(escapes + 1, 0) - 1  # where each remainder word lands
    words = torch.zeros(int(slot[-1]) + 1 if n_words is None else n_words, dtype=torch.int32, device=gaps.device)
    words[slot] = rest.to(torch.int32)
    return words, escapes


def delta16_decode(words: torch.Tensor, words_per_tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`delta16_encode`: local positions, tensor after tensor."""
    if words.numel() == 0:
        return words.new_zeros(0, dtype=torch.int64)
    w = words.to(torch.int64)
    escape = w == 0
    # an escape word advances 65535 and ends no gap: as gaps of the words, positions land on every word
    positions = _positions_from_gaps(torch.where(escape, torch.full_like(w, ESCAPE_GAP), w), words_per_tensor)
    return positions[~escape]


# -- rice -----------------------------------------------------------------------------------------------
def rice_parameters(indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per tensor, the Rice parameter b in [0, 31] that minimizes the tensor's coded bits."""
    num_tensors = counts.numel()
    if indices.numel() == 0:
        return torch.zeros(num_tensors, dtype=torch.int64, device=counts.device)
    x = _gaps(indices, counts) - 1
    bs = torch.arange(_MAX_RICE_B + 1, device=x.device)
    quotients = torch.zeros(num_tensors, bs.numel(), dtype=torch.int64, device=x.device)
    quotients.index_add_(0, _segment_ids(counts), x.unsqueeze(1) >> bs)
    nbits = quotients + counts.unsqueeze(1) * (1 + bs)
    return torch.argmin(nbits, dim=1)


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
    zeros_at = torch.nonzero(unpack_bits(unary, unary_bits) == 0).view(-1)
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


# -- bitmap ---------------------------------------------------------------------------------------------
def bitmap_encode(
    indices: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bitmap bytes, bytes per tensor)``: one bit per entry, each tensor starting on a byte."""
    nbytes = (numels + 7) // 8
    starts = torch.cumsum(nbytes, 0) - nbytes
    marks = torch.zeros(int(nbytes.sum()) * 8, dtype=torch.uint8, device=indices.device)
    if indices.numel():
        marks[indices + 8 * torch.repeat_interleave(starts, counts)] = 1
    return pack_bits(marks), nbytes


def bitmap_decode(data: torch.Tensor, nbytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`bitmap_encode`: ``(local positions, values per tensor)``."""
    hits = torch.nonzero(unpack_bits(data, data.numel() * 8)).view(-1)
    starts = torch.cumsum(nbytes, 0) - nbytes
    tensor_of = torch.searchsorted(8 * starts, hits, right=True) - 1
    counts = torch.bincount(tensor_of, minlength=nbytes.numel()) if hits.numel() else torch.zeros_like(nbytes)
    return hits - 8 * starts[tensor_of], counts


# -- the index formats: size, encode, decode of each in one place ---------------------------------------
@dataclass(frozen=True)
class _IndexCodec:
    #: (positions, counts, numels) -> bytes of the index block
    size: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], int]
    #: (positions, counts, numels) -> (per-tensor header words s_t, byte parts of the index block)
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, list[torch.Tensor]]]
    #: (message from the index block on, counts, s_t) -> local positions
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rice_size(idx: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor | None) -> int:
    n_vals = int(counts.sum())
    if n_vals == 0:
        return 4
    b = torch.repeat_interleave(rice_parameters(idx, counts), counts)
    unary = int(((_gaps(idx, counts) - 1) >> b).sum()) + n_vals
    return 4 + _pad4(_nbytes(unary)) + _pad4(_nbytes(int(b.sum())))


def _rice_encode(idx: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor | None):  # noqa: ANN202
    params = rice_parameters(idx, counts)
    unary, unary_bits, rem = rice_encode(idx, counts, params)
    word = torch.tensor([unary_bits], dtype=torch.int32, device=idx.device)
    return params, [_as_bytes(word), unary, rem]


def _rice_decode(block: torch.Tensor, counts: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    unary_bits = int(block[:4].view(torch.int32)[0])
    ubytes = _nbytes(unary_bits)
    rpos = 4 + _pad4(ubytes)
    rem = block[rpos : rpos + _nbytes(int((counts * params).sum()))]
    return rice_decode(block[4 : 4 + ubytes], unary_bits, rem, counts, params)


def _bitmap_decode(block: torch.Tensor, counts: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    local, found = bitmap_decode(block[: int(nbytes.sum())], nbytes)
    if not torch.equal(found.to(counts.device), counts):
        raise ValueError("corrupt bitmap message: set bits do not match the value counts")
    return local


def _int32_encode(idx: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor | None):  # noqa: ANN202
    return counts, [_as_bytes(idx.to(torch.int32))]


def _int32_decode(block: torch.Tensor, counts: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    return block[: 4 * int(words.sum())].view(torch.int32).to(torch.int64)


def _delta16_encode(idx: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor | None):  # noqa: ANN202
    words, per_tensor = delta16_encode(idx, counts)
    return per_tensor, [_as_bytes(words.to(torch.uint16))]


def _delta16_decode(block: torch.Tensor, counts: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    return delta16_decode(block[: 2 * int(words.sum())].view(torch.uint16).to(torch.int32), words)


def _bitmap_encode(idx: torch.Tensor, counts: torch.Tensor, numels: torch.Tensor | None):  # noqa: ANN202
    assert numels is not None
    data, nbytes = bitmap_encode(idx, counts, numels)
    return nbytes, [data]


_CODECS: dict[str, _IndexCodec] = {
    "int32": _IndexCodec(lambda idx, counts, numels: 4 * int(counts.sum()), _int32_encode, _int32_decode),
    "delta16": _IndexCodec(
        lambda idx, counts, numels: _pad4(2 * int(delta16_encode(idx, counts)[1].sum())),
        _delta16_encode,
        _delta16_decode,
    ),
    "rice": _IndexCodec(_rice_size, _rice_encode, _rice_decode),
    "bitmap": _IndexCodec(
        lambda idx, counts, numels: _pad4(int(((numels + 7) // 8).sum())), _bitmap_encode, _bitmap_decode
    ),
}


def _numels_tensor(numels: list[int] | None, fmt: WireFormat, tensors: int, device: torch.device):  # noqa: ANN202
    if numels is None or len(numels) != tensors:
        if fmt.indices in ("bitmap", "auto"):
            raise ValueError(f"the {fmt.indices} index format needs the tensor sizes (numels), one per tensor")
        return None
    return torch.tensor(numels, dtype=torch.int64, device=device)


def _flat(values: list[torch.Tensor], indices: list[torch.Tensor], fmt: WireFormat):  # noqa: ANN202
    device = values[0].device if values else torch.device("cpu")
    counts = torch.tensor([v.numel() for v in values], dtype=torch.int64, device=device)
    vals = torch.cat(values).to(fmt.value_dtype) if values else torch.zeros(0, dtype=fmt.value_dtype, device=device)
    idx = torch.cat(indices).to(torch.int64) if indices else torch.zeros(0, dtype=torch.int64, device=device)
    return counts, vals, idx


def _auto_choice(values, indices, fmt: WireFormat, numels: list[int] | None) -> WireFormat:  # noqa: ANN001
    return min(
        (WireFormat(fmt.values, name) for name in _AUTO_TAGS),
        key=lambda f: encoded_size(values, indices, f, numels),
    )


def encoded_size(
    values: list[torch.Tensor], indices: list[torch.Tensor], fmt: WireFormat, numels: list[int] | None = None
) -> int:
    """Bytes :func:`encode` would produce (computes the Rice parameters, not the streams)."""
    if fmt.indices == "auto":
        _numels_tensor(numels, fmt, len(values), torch.device("cpu"))
        return 4 + encoded_size(values, indices, _auto_choice(values, indices, fmt, numels), numels)
    # a size, computed on the host (a bench and the auto format's choice; never on the way to a collective)
    counts = torch.tensor([v.numel() for v in values], dtype=torch.int64, device="cpu")
    idx = torch.cat(indices).to(torch.int64).cpu() if indices else torch.zeros(0, dtype=torch.int64, device="cpu")
    n_vals = int(counts.sum())
    base = 8 * len(values) + _pad4(n_vals * fmt.value_dtype.itemsize)
    return base + _CODECS[fmt.indices].size(idx, counts, _numels_tensor(numels, fmt, len(values), idx.device))


def _join(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The byte parts one after the other, each padded with zeros to a multiple of 4 bytes (one ``cat``)."""
    joined = []
    for p in parts:
        joined.append(p.to(device))
        if pad := _pad4(p.numel()) - p.numel():
            joined.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(joined) if joined else torch.zeros(0, dtype=torch.uint8, device=device)


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
        _numels_tensor(numels, fmt, len(values), torch.device("cpu"))
        choice = _auto_choice(values, indices, fmt, numels)
        inner = encode(values, indices, choice, numels)
        tag = torch.tensor([_AUTO_TAGS[choice.indices]], dtype=torch.int32, device=inner.device).view(torch.uint8)
        return torch.cat([tag, inner])
    counts, vals, idx = _flat(values, indices, fmt)
    per_tensor, index_parts = _CODECS[fmt.indices].encode(
        idx, counts, _numels_tensor(numels, fmt, len(values), idx.device)
    )
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
    vpos = _pad4(8 * num_tensors)
    vbytes = int(counts.sum()) * fmt.value_dtype.itemsize
    values = message[vpos : vpos + vbytes].view(fmt.value_dtype).to(torch.float32)
    local = _CODECS[fmt.indices].decode(message[vpos + _pad4(vbytes) :], counts, per_tensor)
    flat = local + torch.repeat_interleave(offsets.to(local.device), counts.to(local.device))
    return flat, values


# -- messages whose sizes the host already knows (the bucketed selection, :mod:`dgc.segselect`) -------------
#: the index formats :func:`encode_known` and :func:`decode_known` write and read without a host read
KNOWN_FORMATS = ("delta16", "int32")


def encode_known(
    values: torch.Tensor,
    local: torch.Tensor | None,
    gaps: torch.Tensor | None,
    counts: list[int],
    words: list[int],
    fmt: WireFormat,
) -> torch.Tensor:
    """The message :func:`encode` writes for the same selection, made without reading the device: the
    per-tensor value counts (and, for delta16, the words they take) come from the host. ``values`` are tensor
    after tensor, each tensor's positions ascending; int32 needs ``local`` (the positions within their tensors),
    delta16 ``gaps`` (:func:`_gaps` of them)."""
    if fmt.indices not in KNOWN_FORMATS:
        raise ValueError(f"encode_known writes {'/'.join(KNOWN_FORMATS)} indices, not {fmt.indices!r}")
    device = values.device
    per_tensor = words if fmt.indices == "delta16" else counts
    header = torch.tensor([x for pair in zip(counts, per_tensor) for x in pair], dtype=torch.int32, device=device)
    vals = _as_bytes(values.to(fmt.value_dtype))
    if fmt.indices == "int32":
        index = _as_bytes(local.to(torch.int32))
    elif sum(words) == sum(counts):  # no gap needs an escape word: the gaps are the words
        index = _as_bytes(gaps.to(torch.uint16))
    else:
        index = _as_bytes(_gap_words(gaps, sum(words))[0].to(torch.uint16))
    return _join([_as_bytes(header), vals, index], device)


def decode_known(
    rows: torch.Tensor, offsets: tuple[int, ...] | list[int], fmt: WireFormat
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every worker's message of :func:`encode_known` (``rows[r]``, as :meth:`dgc.comm.Comm.allgather_bytes`
    returns them; ``offsets``: where each tensor starts in the flat space) decoded together with one host read
    (all the headers): ``(flat positions, fp32 values, ends)``, worker after worker, ``ends[r]`` where worker r's
    entries end."""
    if fmt.indices not in KNOWN_FORMATS:
        raise ValueError(f"decode_known reads {'/'.join(KNOWN_FORMATS)} indices, not {fmt.indices!r}")
    device, (R, width), T = rows.device, rows.shape, len(offsets)
    flat_rows = rows.view(-1)
    header = flat_rows[: 8 * T] if R == 1 else rows[:, : 8 * T].contiguous()
    header = header.view(torch.int32).view(R, T, 2).tolist()  # the one host read
    counts = [h[0] for row in header for h in row]
    per_tensor = [h[1] for row in header for h in row]
    values, blocks, ends, total = [], [], [], 0
    word_bytes = 2 if fmt.indices == "delta16" else 4
    for r in range(R):
        n_values = sum(counts[r * T : (r + 1) * T])
        n_words = sum(per_tensor[r * T : (r + 1) * T])
        vpos = r * width + _pad4(8 * T)
        vbytes = n_values * fmt.value_dtype.itemsize
        ipos = vpos + _pad4(vbytes)
        values.append(flat_rows[vpos : vpos + vbytes].view(fmt.value_dtype))
        blocks.append(flat_rows[ipos : ipos + word_bytes * n_words])
        total += n_values
        ends.append(total)
    vals = (values[0] if R == 1 else torch.cat(values)).to(torch.float32)
    block = blocks[0] if R == 1 else torch.cat(blocks)
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), vals, ends
    if fmt.indices == "int32":
        table = torch.tensor(counts + list(offsets) * R, dtype=torch.int64, device=device)
        return block.view(torch.int32) + table[R * T :].repeat_interleave(table[: R * T], output_size=total), vals, ends
    # per (worker, tensor): where its words start, how many values, its offset minus one
    firsts, pos = [], 0
    for w in per_tensor:
        firsts.append(pos)
        pos += w
    n_words = pos
    firsts = [min(f, n_words - 1) for f in firsts]
    escapes = n_words != total
    table = torch.tensor(firsts + counts + [o - 1 for o in offsets] * R + (per_tensor if escapes else []),
                         dtype=torch.int64, device=device)  # fmt: skip
    firsts_t, counts_t, shift_t = table[: R * T], table[R * T : 2 * R * T], table[2 * R * T : 3 * R * T]
    w = block.view(torch.uint16).to(torch.int64)
    if not escapes:  # every word is a gap: position = (gaps so far) - (gaps before the tensor) - 1 + offset
        ends_at = torch.cumsum(w, 0)
        before = (ends_at - w)[firsts_t] - shift_t
        return ends_at - before.repeat_interleave(counts_t, output_size=total), vals, ends
    escape = w == 0  # an escape word advances 65535 and ends no gap
    gaps = torch.where(escape, ESCAPE_GAP, w)
    ends_at = torch.cumsum(gaps, 0)
    before = (ends_at - gaps)[firsts_t].repeat_interleave(table[3 * R * T :], output_size=n_words)
    local = (ends_at - before)[torch.argsort(escape.to(torch.uint8), stable=True)[:total]]
    return local + shift_t.repeat_interleave(counts_t, output_size=total), vals, ends
