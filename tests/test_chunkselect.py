"""Chunk-wise fixed-k selection (dgc.chunkselect) and DGC with compression.selection=chunk."""

from __future__ import annotations

import pytest
import torch

import dgc
from dgc import chunkselect
from dgc.comm import Comm
from dgc.compressors import build_compressor
from dgc.compressors.base import Item
from dgc.timing import Phases
from tests.multiproc import run

SHAPES = [(40, 30), (7,), (50, 21), (3,)]  # 2,260 values: 9 chunks of 256, the last one partly padding


def test_each_chunk_sends_exactly_its_k_largest_magnitudes():
    v = torch.randn(10 * 64, generator=torch.Generator().manual_seed(0))
    local, flat = chunkselect.select(v, 64, 5)
    assert local.shape == (10, 5) and flat.shape == (50,)
    for c in range(10):
        want = set(torch.topk(v[c * 64 : (c + 1) * 64].abs(), 5).indices.tolist())
        assert set(local[c].tolist()) == want and set((flat[c * 5 : c * 5 + 5] - c * 64).tolist()) == want
    everything, _ = chunkselect.select(v, 64, 64)
    assert everything.shape == (10, 64)
    assert chunkselect.per_chunk(0.001, 4096) == 4 and chunkselect.per_chunk(1e-6, 4096) == 1
    assert chunkselect.per_chunk(1.0, 64) == 64


def test_one_worker_decodes_a_message_of_any_length():
    """At world size 1 the gathered row is a view of the message: 3 chunks x 1 value = 18 bytes, whose length is
    not a multiple of the value's 4 bytes."""
    comp = build_compressor("dgc", density=0.001, selection="chunk", chunk_size=64)
    comm = Comm.local()
    comp.bind(comm)
    g = torch.arange(1.0, 151.0)
    items = [Item("w", g, g.clone(), 0.0)]
    comp.exchange(items, comm, Phases())
    assert comm.reset_traffic().sent == 18
    assert items[0].grad.nonzero().view(-1).tolist() == [63, 127, 149]  # each chunk's largest, the last one partial


def reference(grads_by_rank, state, density, chunk, momentum):
    """DGC with chunk selection, re-derived on the concatenated tensors: u = m u + g, v += u, the k largest |v| of
    each chunk sent and cleared from v and u; the mean of every rank's sent values."""
    k = chunkselect.per_chunk(density, chunk)
    total = torch.zeros(0)
    for rank, grads in enumerate(grads_by_rank):
        g = torch.cat([x.reshape(-1) for x in grads])
        pad = -g.numel() % chunk
        g = torch.cat([g, g.new_zeros(pad)])
        u, v = state.setdefault(rank, (torch.zeros_like(g), torch.zeros_like(g)))
        u.mul_(momentum).add_(g)
        v.add_(u)
        sent = torch.zeros_like(v)
        for c in range(g.numel() // chunk):
            part = v[c * chunk : (c + 1) * chunk]
            at = torch.topk(part.abs(), k).indices + c * chunk
            sent[at] = v[at]
        v.sub_(sent)
        u.masked_fill_(sent != 0, 0)
        total = sent if rank == 0 else total + sent
    return total / len(grads_by_rank)


def _grads(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _two_ranks(rank, world):
    comm = Comm()
    comp = build_compressor("dgc", density=0.02, selection="chunk", chunk_size=256)
    comp.bind(comm)
    state, out = {}, []
    for step in range(8):
        grads = _grads(rank, step)
        items = [Item(f"t{i}", g, g.clone(), 0.9) for i, g in enumerate(grads)]
        comm.reset_traffic()
        comp.exchange(items, comm, Phases())
        sent = comm.reset_traffic().sent
        expect = reference([_grads(r, step) for r in range(world)], state, 0.02, 256, 0.9)
        got = torch.cat([it.grad.reshape(-1) for it in items])
        out.append((torch.allclose(got, expect[: got.numel()], rtol=1e-6, atol=1e-7), sent))
        if step == 3:  # a checkpoint in the middle: a fresh compressor continues exactly
            saved = comp.state_dict()
            comp = build_compressor("dgc", density=0.02, selection="chunk", chunk_size=256)
            comp.bind(comm)
            comp.load_state_dict(saved)
    return out


def test_dgc_with_chunk_selection_is_its_re_derivation_on_two_ranks():
    for per_rank in run(_two_ranks, 2):
        assert all(ok for ok, _ in per_rank), [ok for ok, _ in per_rank]
        # a fixed message: 9 chunks x k = 5 (0.02 x 256) values of 4 bytes and 2-byte positions, every step
        assert {sent for _, sent in per_rank} == {9 * 5 * 6}


def test_chunk_selection_options_and_the_exchanges_that_refuse_it():
    with pytest.raises(ValueError, match="selection must be one of sampled, chunk"):
        build_compressor("dgc", selection="exact")
    with pytest.raises(ValueError, match="chunk_size must be at most 65536"):
        build_compressor("dgc", selection="chunk", chunk_size=70000)
    model = torch.nn.Linear(8, 8)
    comp = build_compressor("dgc", selection="chunk")
    for exchange in ("sparse_allreduce", "densify"):
        with pytest.raises(ValueError, match=f"exchange={exchange} reduces selections tensor by tensor"):
            dgc.GradientSync(model, comp, exchange=exchange, comm=_FakeComm())


class _FakeComm(Comm):
    """A world of two that never communicates: enough to build an exchange and have it check the compressor."""

    def __init__(self):
        super().__init__()
        self.world_size, self.collective = 2, True
