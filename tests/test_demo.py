"""The DeMo compressor (dgc/compressors/demo.py) against the paper's update re-derived element by element."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc.comm import Comm
from dgc.compressors.base import Item
from dgc.compressors.demo import dct_matrix
from dgc.timing import Phases
from tests.multiproc import run

SHAPES = [(5, 6), (7,), (4, 4)]  # 53 values: 4 tiles of 4 x 4, the last one partly padding
TILE, TOPK, DECAY = 4, 3, 0.9


def grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def dct2(x: list[list[float]], inverse: bool = False) -> list[list[float]]:
    """The orthonormal 2-D DCT-II of a square (or its inverse), written out as sums of cosines."""
    n = len(x)

    def basis(k: int, i: int) -> float:
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        return scale * math.cos(math.pi * (i + 0.5) * k / n)

    if inverse:  # x[i][j] = sum_kq y[k][q] b(k, i) b(q, j)
        return [[sum(x[k][q] * basis(k, i) * basis(q, j) for k in range(n) for q in range(n)) for j in range(n)]
                for i in range(n)]  # fmt: skip
    return [[sum(x[i][j] * basis(k, i) * basis(q, j) for i in range(n) for j in range(n)) for q in range(n)]
            for k in range(n)]  # fmt: skip


def reference(world: int, steps: int, mean: str = "senders") -> list[torch.Tensor]:
    """DeMo's step on every rank: m = decay m + g; per tile the top-k |DCT(m)| sent and their inverse taken out of m;
    the sign of the inverse DCT of the mean of the sent coefficients: each coefficient's sum over the workers that
    sent it (``mean="senders"``, the authors' code) or over all workers (``"workers"``). The padding of the last tile
    keeps nothing."""
    numel = sum(math.prod(s) for s in SHAPES)
    chunk = TILE * TILE
    size = numel + (-numel % chunk)
    momenta = [[0.0] * size for _ in range(world)]
    out = []
    for step in range(steps):
        total, senders = [0.0] * size, [0] * size
        for r in range(world):
            g = torch.cat([x.reshape(-1) for x in grads(r, step)]).tolist() + [0.0] * (size - numel)
            m = momenta[r]
            for i in range(size):
                m[i] = DECAY * m[i] + g[i]
            for t in range(size // chunk):
                square = [[m[t * chunk + i * TILE + j] for j in range(TILE)] for i in range(TILE)]
                coeff = [v for row in dct2(square) for v in row]
                keep = sorted(range(chunk), key=lambda i: -abs(coeff[i]))[:TOPK]
                sparse = [coeff[i] if i in keep else 0.0 for i in range(chunk)]
                back = dct2([sparse[i * TILE : (i + 1) * TILE] for i in range(TILE)], inverse=True)
                for i in range(TILE):
                    for j in range(TILE):
                        m[t * chunk + i * TILE + j] -= back[i][j]
                for i in keep:
                    total[t * chunk + i] += sparse[i]
                    senders[t * chunk + i] += 1
            m[numel:] = [0.0] * (size - numel)  # the padding keeps no momentum
        total = [v / (max(n, 1) if mean == "senders" else world) for v, n in zip(total, senders)]
        decoded = []
        for t in range(size // chunk):
            square = [total[t * chunk + i * TILE : t * chunk + (i + 1) * TILE] for i in range(TILE)]
            decoded += [v for row in dct2(square, inverse=True) for v in row]
        out.append(torch.tensor(decoded[:numel], dtype=torch.float32).sign())
    return out


def _exchange(rank: int, world: int, steps: int, mean: str) -> list[torch.Tensor]:
    comp = dgc.build_compressor("demo", tile=TILE, topk=TOPK, decay=DECAY, mean=mean, tiles="flat")
    comm = Comm()
    comp.bind(comm)
    out = []
    for step in range(steps):
        items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads(rank, step))]
        comp.exchange(items, comm, Phases())
        out.append(torch.cat([it.grad.reshape(-1) for it in items]))
        sent = comm.reset_traffic().sent
        assert sent == 4 * TOPK * (4 + 2), sent  # 4 tiles x 3 coefficients, fp32 value and 16-bit position each
    return out


@pytest.mark.parametrize("mean", ["senders", "workers"])
def test_demo_equals_the_papers_update_on_three_ranks(mean):
    want = reference(3, 3, mean)
    for got in run(_exchange, 3, 3, mean):
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), step


def test_dividing_by_the_senders_is_the_authors_default_and_changes_the_step():
    assert dgc.build_compressor("demo").config.mean == "senders"
    # with a sign, the two means differ where a coefficient sent by few workers outweighs one sent by all
    assert any(not torch.equal(a, b) for a, b in zip(reference(3, 3, "senders"), reference(3, 3, "workers")))


def test_the_dct_is_orthonormal_and_the_momentum_keeps_what_was_not_sent():
    c = dct_matrix(8)
    torch.testing.assert_close(c @ c.T, torch.eye(8), rtol=0, atol=1e-6)
    comp = dgc.build_compressor("demo", tile=4, topk=16, decay=0.5, sign=False, tiles="flat")
    comm = Comm.local()
    comp.bind(comm)
    g = torch.randn(32)
    items = [Item("a", g, g.clone())]
    comp.exchange(items, comm, Phases())  # every coefficient sent: the mean is the gradient, nothing kept
    torch.testing.assert_close(items[0].grad, g, rtol=0, atol=1e-5)
    assert comp.state["a"]["momentum"].abs().max() < 1e-5


def test_bad_demo_options_name_the_valid_ones():
    with pytest.raises(ValueError, match="tile must be at most 256"):
        dgc.build_compressor("demo", tile=300)
    with pytest.raises(ValueError, match="topk must be at most tile\\*\\*2 = 16"):
        dgc.build_compressor("demo", tile=4, topk=17)
    with pytest.raises(ValueError, match="values must be one of fp32, fp16, bf16"):
        dgc.build_compressor("demo", values="int8")
    with pytest.raises(ValueError, match="mean must be one of workers, senders, got 'all'"):
        dgc.build_compressor("demo", mean="all")


def basis(n: int, k: int, i: int) -> float:
    scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
    return scale * math.cos(math.pi * (i + 0.5) * k / n)


def dct_block(x: list[list[float]], inverse: bool = False) -> list[list[float]]:
    """The orthonormal 2-D DCT-II of an ``h x w`` block (or its inverse), as sums of cosines."""
    h, w = len(x), len(x[0])
    if inverse:
        return [[sum(x[k][q] * basis(h, k, i) * basis(w, q, j) for k in range(h) for q in range(w)) for j in range(w)]
                for i in range(h)]  # fmt: skip
    return [[sum(x[i][j] * basis(h, k, i) * basis(w, q, j) for i in range(h) for j in range(w)) for q in range(w)]
            for k in range(h)]  # fmt: skip


def reference_by_tensor(world: int, steps: int, mean: str) -> list[torch.Tensor]:
    """DeMo as the authors' code cuts it: each tensor viewed as rows (its first dimension) x the rest, a 1-D tensor as
    one row, cut into blocks of the largest divisors of rows and columns at most TILE; per block the top min(TOPK,
    h * w) |DCT| sent and taken out of the momentum; each coefficient's sum divided by its senders (or all workers)."""
    shapes = [(s[0], math.prod(s[1:])) if len(s) > 1 else (1, s[0]) for s in SHAPES]
    momenta = [[[[0.0] * c for _ in range(r)] for r, c in shapes] for _ in range(world)]
    out = []
    for step in range(steps):
        result = []
        for t, (rows, cols) in enumerate(shapes):
            h = max(d for d in range(1, TILE + 1) if rows % d == 0)
            w = max(d for d in range(1, TILE + 1) if cols % d == 0)
            k = min(TOPK, h * w)
            total: dict[tuple[int, int, int, int], float] = {}
            senders: dict[tuple[int, int, int, int], int] = {}
            for r in range(world):
                g = grads(r, step)[t].reshape(rows, cols).tolist()
                m = momenta[r][t]
                for i in range(rows):
                    for j in range(cols):
                        m[i][j] = DECAY * m[i][j] + g[i][j]
                for bi in range(0, rows, h):
                    for bj in range(0, cols, w):
                        block = [[m[bi + i][bj + j] for j in range(w)] for i in range(h)]
                        coeff = dct_block(block)
                        flat = [(abs(coeff[i][j]), i, j) for i in range(h) for j in range(w)]
                        keep = {(i, j) for _, i, j in sorted(flat, reverse=True)[:k]}
                        sparse = [[coeff[i][j] if (i, j) in keep else 0.0 for j in range(w)] for i in range(h)]
                        back = dct_block(sparse, inverse=True)
                        for i in range(h):
                            for j in range(w):
                                m[bi + i][bj + j] -= back[i][j]
                        for i, j in keep:
                            total[(bi, bj, i, j)] = total.get((bi, bj, i, j), 0.0) + coeff[i][j]
                            senders[(bi, bj, i, j)] = senders.get((bi, bj, i, j), 0) + 1
            decoded = [[0.0] * cols for _ in range(rows)]
            for bi in range(0, rows, h):
                for bj in range(0, cols, w):
                    avg = [[total.get((bi, bj, i, j), 0.0) / (senders.get((bi, bj, i, j), 1) if mean == "senders"
                            else world) for j in range(w)] for i in range(h)]  # fmt: skip
                    back = dct_block(avg, inverse=True)
                    for i in range(h):
                        for j in range(w):
                            decoded[bi + i][bj + j] = back[i][j]
            result += [v for row in decoded for v in row]
        out.append(torch.tensor(result, dtype=torch.float32).sign())
    return out


def _exchange_by_tensor(rank: int, world: int, steps: int, mean: str) -> tuple[list[torch.Tensor], list[int]]:
    comp = dgc.build_compressor("demo", tile=TILE, topk=TOPK, decay=DECAY, mean=mean, tiles="tensor")
    comm = Comm()
    comp.bind(comm)
    out, sent = [], []
    for step in range(steps):
        items = [Item(f"t{i}", g, g.clone()) for i, g in enumerate(grads(rank, step))]
        comp.exchange(items, comm, Phases())
        out.append(torch.cat([it.grad.reshape(-1) for it in items]))
        sent.append(comm.reset_traffic().sent)
    return out, sent


@pytest.mark.parametrize("mean", ["senders", "workers"])
def test_tiles_cut_from_each_tensor_equal_the_authors_blocks_on_three_ranks(mean):
    want = reference_by_tensor(3, 3, mean)
    for got, sent in run(_exchange_by_tensor, 3, 3, mean):
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), step
        # (5, 6): 5 x 2 blocks of 1 x 3, all 3 sent; (7,): 7 blocks of 1, sent; (4, 4): one 4 x 4 block, 3 sent
        assert sent == [(10 * 3 + 7 + 3) * (4 + 2)] * 3
    assert dgc.build_compressor("demo").config.tiles == "tensor"
    with pytest.raises(ValueError, match="tiles must be one of tensor, flat, got 'rows'"):
        dgc.build_compressor("demo", tiles="rows")
