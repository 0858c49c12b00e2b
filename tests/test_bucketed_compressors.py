"""TernGrad, PowerSGD and top-k on a flat bucket equal their per-tensor definitions, on 2 real ranks.

The references below are each paper's step written tensor by tensor (what these compressors did before they
moved onto one bucket), issuing the same collectives through a :class:`~dgc.comm.Comm`. Over 20 steps of a
model with repeated and interleaved shapes, vectors and a scalar, every averaged gradient and every piece of
state must be bit-identical on every rank.
"""

from __future__ import annotations

import zlib

import torch

from dgc import bits, seeding
from dgc.comm import Comm
from dgc.compressors import PowerSGD, TernGrad, TopK
from dgc.compressors.base import Item
from dgc.timing import Phases
from tests.multiproc import run

#: conv and linear shapes in an order that interleaves the shape groups, plus vectors and a scalar
SHAPES = [(8, 4, 3, 3), (8,), (16, 8, 3, 3), (8, 4, 3, 3), (1,), (16, 8, 3, 3), (10, 16), (10,), (8, 36), (3, 2)]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=gen) * (1 + i % 3) for i, s in enumerate(SHAPES)]


def reference_terngrad(grads, comm, gen, clip_sigma):
    flat = [g.reshape(-1).clone() for g in grads]
    if clip_sigma is not None:
        for g in flat:
            if g.numel() > 1:
                bound = float(clip_sigma * g.std())
                g.clamp_(-bound, bound)
    scales = comm.allreduce_max_(torch.stack([g.abs().max() for g in flat]))
    codes = []
    for g, s in zip(flat, scales):
        prob = g.abs() / s.clamp_min(1e-30)
        rand = torch.rand(g.numel(), generator=gen)
        codes.append((torch.sign(g) * (rand < prob)).to(torch.int8) + 1)
    rows = comm.allgather(bits.pack(torch.cat(codes), 2))
    total = bits.unpack(rows, sum(c.numel() for c in codes), 2).to(torch.float32).sum(0) - rows.shape[0]
    out, start = [], 0
    for g, s in zip(grads, scales):
        out.append((total[start : start + g.numel()] * (s / rows.shape[0])).view(g.shape))
        start += g.numel()
    return out


def reference_powersgd(grads, comm, state, rank, seed, error_feedback, warm_start):
    def dims(g):
        n = g.shape[0] if g.dim() else 1
        return n, g.numel() // max(n, 1)

    def low_rank(g):
        n, m = dims(g)
        return g.dim() > 1 and min(rank, n, m) * (n + m) < n * m

    low = [i for i, g in enumerate(grads) if low_rank(g)]
    mats, ps = {}, {}
    for i in low:
        n, m = dims(grads[i])
        r = min(rank, n, m)
        mats[i] = grads[i].reshape(n, m) + state.get(("error", i), torch.zeros(n, m))
        q = state.get(("q", i))
        if q is None or not warm_start:
            gen = seeding.generator(seed, zlib.crc32(f"t{i}".encode()))
            q = torch.randn(m, r, generator=gen)
        ps[i] = mats[i] @ q
    dense = [i for i in range(len(grads)) if i not in mats]
    first = comm.allreduce_mean_(torch.cat([ps[i].view(-1) for i in low] + [grads[i].view(-1) for i in dense]))
    out, start, orth = {}, 0, {}
    for i in low:
        orth[i] = torch.linalg.qr(first[start : start + ps[i].numel()].view_as(ps[i])).Q
        start += ps[i].numel()
    for i in dense:
        out[i] = first[start : start + grads[i].numel()].view_as(grads[i])
        start += grads[i].numel()
    qs = {i: mats[i].t() @ orth[i] for i in low}
    second = comm.allreduce_mean_(torch.cat([qs[i].view(-1) for i in low]))
    start = 0
    for i in low:
        q = second[start : start + qs[i].numel()].view_as(qs[i])
        start += q.numel()
        approx = orth[i] @ q.t()
        if error_feedback:
            state[("error", i)] = mats[i] - approx
        state[("q", i)] = q.clone()
        out[i] = approx.view(grads[i].shape)
    return [out[i] for i in range(len(grads))]


def _same(a, b, exact):
    # not exact: rounding, which the warm-started power iteration carries on (~2e-4 of the largest value by step 20)
    return torch.equal(a, b) if exact else bool((a - b).abs().max() <= 1e-3 * b.abs().max() + 1e-6)


def _both(rank, world, name, options, exact):
    torch.set_num_threads(1)
    comm = Comm()
    comp = TernGrad(**options) if name == "terngrad" else PowerSGD(**options)
    comp.bind(comm)
    gen = seeding.generator(options.get("seed", 0), rank)
    state: dict = {}
    equal = []
    for step in range(20):
        grads = _grads(rank, step)
        items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads)]
        comp.exchange(items, comm, Phases())
        if name == "terngrad":
            expect = reference_terngrad(grads, comm, gen, options.get("clip_sigma", 2.5))
        else:
            flags = options.get("error_feedback", True), options.get("warm_start", True)
            expect = reference_powersgd(grads, comm, state, options.get("rank", 4), options.get("seed", 0), *flags)
            for (key, i), value in state.items():
                equal.append(_same(comp.state[f"t{i}"][key].view(value.shape), value, exact))
        equal += [_same(it.grad, e, exact) for it, e in zip(items, expect, strict=True)]
        equal.append(all(it.grad.shape == g.shape for it, g in zip(items, grads)))
    return equal


#: (compressor, options, bit-identical): at rank 1 the per-tensor P = M q is a matrix-vector product (another
#: summation order than the batched matrix product): equal to rounding there
CASES = [
    ("terngrad", {"seed": 3}, True),
    ("terngrad", {"clip_sigma": None}, True),
    ("powersgd", {}, True),
    ("powersgd", {"rank": 1, "seed": 2}, False),
    ("powersgd", {"warm_start": False}, True),
    ("powersgd", {"error_feedback": False}, True),
]


def _topk_both(rank, options, big):
    """The bucketed top-k against the per-tensor path (``use_buckets = False``): the same averaged gradients and
    residuals, bit for bit, over 20 steps (``big``: a tensor of 300,000 values too, where gaps need escape words)."""
    comm = Comm()
    comps = [TopK(**options), TopK(**options)]
    comps[1].use_buckets = False
    for comp in comps:
        comp.bind(comm)
    shapes = SHAPES + ([(300, 1000)] if big else [])
    equal = []
    for step in range(20):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        got = []
        for comp in comps:
            items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads)]
            comp.exchange(items, comm, Phases())
            got.append([it.grad for it in items])
        equal += [torch.equal(a, b) for a, b in zip(*got, strict=True)]
        equal += [torch.equal(comps[0].state[n]["residual"], comps[1].state[n]["residual"]) for n in comps[1].state]
    return equal


#: (options, with the big tensor): densities where small tensors send everything, both index formats, 16-bit values
TOPK_CASES = [
    ({"density": 0.1}, False),
    ({"density": 0.3, "wire_indices": "int32"}, False),
    ({"density": 0.05, "wire_values": "fp16"}, False),
    ({"density": 0.00001}, True),
    ({"density": 0.00001, "wire_indices": "int32"}, True),
]


def _every_case(rank, world):
    torch.set_num_threads(1)
    return ([_both(rank, world, name, options, exact) for name, options, exact in CASES],
            [_topk_both(rank, options, big) for options, big in TOPK_CASES])  # fmt: skip


def test_on_two_ranks_the_bucket_equals_the_per_tensor_definition():
    for per_rank, topk in run(_every_case, 2):  # one pair of processes for every case
        for (name, options, _), equal in zip(CASES, per_rank, strict=True):
            assert equal and all(equal), (name, options, equal.index(False))
        for (options, _), equal in zip(TOPK_CASES, topk, strict=True):
            assert equal and all(equal), ("topk", options, equal.index(False))


def test_powersgd_groups_matrices_by_shape_and_keeps_state_by_name():
    comp = PowerSGD(rank=2)
    comm = Comm()
    comp.bind(comm)
    grads = _grads(0, 0)
    items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads)]
    comp.exchange(items, comm, Phases())
    # the matrices of one shape are neighbours in the buffers whatever their order: t0, t3 (8x4x3x3) and t8 (8x36)
    q = {i: comp.state[f"t{i}"]["q"] for i in (0, 2, 3, 5, 6, 8)}
    assert q[3].data_ptr() == q[0].data_ptr() + q[0].nbytes and q[8].data_ptr() == q[3].data_ptr() + q[3].nbytes
    assert q[5].data_ptr() == q[2].data_ptr() + q[2].nbytes
    low = {f"t{i}" for i in (0, 2, 3, 5, 6, 8)}
    assert {n for n, s in comp.state.items() if s} == low
    for i in (0, 2, 8):
        assert comp.state[f"t{i}"]["error"].shape == (grads[i].numel(),)
    saved = comp.state_dict()
    other = PowerSGD(rank=2)
    other.bind(comm)
    other.load_state_dict(saved)
    again = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(_grads(0, 1))]
    more = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(_grads(0, 1))]
    comp.exchange(again, comm, Phases())
    other.exchange(more, comm, Phases())
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(again, more))
