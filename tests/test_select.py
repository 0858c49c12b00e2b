"""Selection of the largest-magnitude entries: exact top-k and DGC's sampled threshold."""

from __future__ import annotations

import pytest
import torch

from dgc.select import Scratch, exact_topk, keep_largest, mask_positions, sampled_select, target_count


def _distribution(name: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name == "normal":
        return torch.randn(n, generator=gen)
    if name == "heavy":  # Cauchy-like: a few huge entries
        return torch.randn(n, generator=gen) / torch.randn(n, generator=gen).abs().clamp_min(1e-3)
    if name == "sparse":  # 99% exact zeros
        x = torch.zeros(n)
        pos = torch.randperm(n, generator=gen)[: n // 100]
        x[pos] = torch.randn(pos.numel(), generator=gen)
        return x
    if name == "mostly_zero_few_ties":  # 97% zeros and the rest equal magnitude
        x = torch.zeros(n)
        pos = torch.randperm(n, generator=gen)[: n * 3 // 100]
        x[pos] = torch.where(torch.rand(pos.numel(), generator=gen) < 0.5, -2.0, 2.0)
        return x
    if name == "constant":
        return torch.full((n,), -0.5)
    if name == "zeros":
        return torch.zeros(n)
    if name == "exponential":  # magnitudes spread over many orders
        return torch.exp(torch.randn(n, generator=gen) * 5) * torch.randn(n, generator=gen).sign()
    raise ValueError(name)


DISTRIBUTIONS = ("normal", "heavy", "sparse", "mostly_zero_few_ties", "constant", "zeros", "exponential")


def _assert_largest(x: torch.Tensor, idx: torch.Tensor) -> None:
    """``idx`` are ascending, unique, and no unsent |x| exceeds the smallest sent |x|."""
    assert idx.dtype == torch.int64 and idx.dim() == 1
    if idx.numel() > 1:
        assert torch.all(idx[1:] > idx[:-1]), "positions must be strictly ascending"
    if idx.numel():
        assert 0 <= int(idx[0]) and int(idx[-1]) < x.numel()
    sent = torch.zeros(x.numel(), dtype=torch.bool)
    sent[idx] = True
    if idx.numel() and (~sent).any():
        assert x.abs()[~sent].max() <= x.abs()[sent].min()


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("n,density", [(100_000, 0.001), (50_000, 0.01), (20_000, 0.05), (3_001, 0.02)])
def test_sampled_select_is_a_top_m(dist, n, density):
    x = _distribution(dist, n, seed=n)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # several random sampling offsets
        idx, info = sampled_select(x, density, generator=gen)
        k = target_count(n, density)
        _assert_largest(x, idx)
        assert info.k == k
        assert info.selected == idx.numel()
        assert 0 <= idx.numel() <= k
        assert 0 <= info.adaptations <= 10
        assert not info.exact
        if info.adaptations < 10 or info.candidates >= 0.8 * k:
            assert idx.numel() >= 0.8 * k
        if info.candidates > k:
            assert idx.numel() == k


def _start(seed: int, stride: int) -> int:
    """The sampling start that ``sampled_select`` draws from a generator seeded with ``seed``."""
    return int(torch.randint(stride, (1,), generator=torch.Generator().manual_seed(seed)))


def _spiked(n: int, stride: int, start: int, spikes: int, rest: float) -> torch.Tensor:
    """``rest`` everywhere and ``spikes`` entries of 2**30 at sampled positions only."""
    x = torch.full((n,), rest)
    x[start : start + spikes * stride : stride] = 2.0**30
    return x


def test_sampled_select_lowers_the_threshold_until_enough_pass():
    # n = 100k, density 1%: k = 1000, 1000 samples with stride 100, threshold = 10th largest sample.
    # 10 spikes sit at sampled positions, so the first threshold is 2**30 and only 10 entries pass;
    # the rest is 2**29: the threshold must fall 4 times (x0.8: 0.8, 0.64, 0.512, 0.4096 of 2**30).
    n, density, seed = 100_000, 0.01, 3
    x = _spiked(n, 100, _start(seed, 100), spikes=10, rest=2.0**29)
    idx, info = sampled_select(x, density, generator=torch.Generator().manual_seed(seed))
    assert info.k == 1000
    assert info.adaptations == 4
    assert info.candidates == n
    assert idx.numel() == 1000
    _assert_largest(x, idx)
    assert int((x[idx] == 2.0**30).sum()) == 10


@pytest.mark.parametrize("max_adaptations", [0, 3])
def test_sampled_select_gives_up_after_max_adaptations(max_adaptations):
    n, density, seed = 100_000, 0.01, 3
    x = _spiked(n, 100, _start(seed, 100), spikes=10, rest=2.0**29)
    idx, info = sampled_select(
        x, density, generator=torch.Generator().manual_seed(seed), max_adaptations=max_adaptations
    )
    assert info.adaptations == max_adaptations
    # gave up: only the 10 spikes are sent, still "the m largest" but m < 0.8 k
    assert info.candidates == 10 and idx.numel() == 10
    assert torch.all(x[idx] == 2.0**30)
    _assert_largest(x, idx)


def test_sampled_select_gives_up_with_default_limit():
    # rest = 1: ten steps of x0.8 bring 2**30 down to 1.15e8 only
    n, density, seed = 100_000, 0.01, 5
    x = _spiked(n, 100, _start(seed, 100), spikes=10, rest=1.0)
    idx, info = sampled_select(x, density, generator=torch.Generator().manual_seed(seed))
    assert info.adaptations == 10
    assert idx.numel() == 10
    _assert_largest(x, idx)


def test_near_target_keeps_largest_not_lowest_index():
    # the authors' defect: with 1x-1.3x the target passing, they kept the lowest-index candidates.
    # n = 100k, density 0.1%: k = 100, 2000 samples with stride 50, threshold = 2nd largest sample.
    n, density, seed = 100_000, 0.001, 11
    start = _start(seed, 50)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.01
    pos = torch.arange(start, start + 120 * 50, 50)
    x[pos] = torch.linspace(1.0, 1.2, 120)  # 120 candidates, the largest at the highest positions
    idx, info = sampled_select(x, density, generator=torch.Generator().manual_seed(seed))
    # threshold 1.198 passes 2; x0.8 once passes all 120 (1.2 x the target)
    assert info.adaptations == 1
    assert info.candidates == 120
    assert torch.equal(idx, pos[-100:])


@pytest.mark.parametrize("k", [1, 300, 499, 500, 501, 700, 999, 1000, 1200])
def test_keep_largest_keeps_the_k_largest_in_ascending_order(k):
    # both ways: a top-k of the candidates (many too many) and dropping the few smallest (few too many)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5000, generator=gen)
    idx = torch.sort(torch.randperm(5000, generator=gen)[:1000]).values
    got = keep_largest(x, idx, k)
    want = idx[torch.topk(x[idx].abs(), min(k, 1000)).indices].sort().values
    assert torch.equal(got, want)


@pytest.mark.parametrize("dist", ("normal", "heavy", "constant", "sparse"))
@pytest.mark.parametrize("n,density", [(200, 0.01), (2000, 0.001), (39, 0.05), (40, 0.05)])
def test_small_tensors_use_exact_topk(dist, n, density):
    assert n <= 2 / density
    x = _distribution(dist, n, seed=5)
    idx, info = sampled_select(x, density, generator=torch.Generator().manual_seed(0))
    assert info.exact
    k = target_count(n, density)
    assert idx.numel() == k
    _assert_largest(x, idx)
    assert torch.equal(idx, exact_topk(x, k))


@pytest.mark.parametrize("n", [1, 5, 1000])
def test_density_one_sends_everything(n):
    x = torch.randn(n)
    idx, info = sampled_select(x, 1.0)
    assert torch.equal(idx, torch.arange(n))
    assert info.exact and info.selected == n
    assert torch.equal(exact_topk(x, n), torch.arange(n))
    assert torch.equal(exact_topk(x, n + 3), torch.arange(n))


def test_target_count():
    assert target_count(1000, 0.001) == 1
    assert target_count(1001, 0.001) == 2  # ceil
    assert target_count(10, 1e-9) == 1  # at least one
    assert target_count(10, 1.0) == 10
    assert target_count(100, 0.07) == 7  # 100 * 0.07 = 7.000000000000001 in floats
    assert target_count(1_000_000, 0.001) == 1000


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("k", [1, 7, 100, 999, 1000])
def test_exact_topk_matches_torch_topk(dist, k):
    x = _distribution(dist, 1000, seed=k)
    idx = exact_topk(x, k)
    assert idx.numel() == min(k, 1000)
    assert torch.all(idx[1:] > idx[:-1])
    _assert_largest(x, idx)
    ref = torch.topk(x.abs(), k).values
    # same multiset of magnitudes as torch.topk (identical sets when there are no ties)
    assert torch.equal(torch.sort(x.abs()[idx]).values, torch.sort(ref).values)
    if dist in ("normal", "heavy", "exponential"):
        assert set(idx.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("n", [8, 64, 1000, 4096, 100_003])
@pytest.mark.parametrize("p", [0.0, 0.001, 0.3, 1.0])
def test_mask_positions_equals_nonzero(n, p):
    gen = torch.Generator().manual_seed(n)
    padded = (n + 7) // 8 * 8
    mask = torch.zeros(padded, dtype=torch.bool)
    mask[:n] = torch.rand(n, generator=gen) < p
    if p == 0.001:
        mask[0] = True
        mask[n - 1] = True
    out = mask_positions(mask, n)
    assert torch.equal(out, mask.nonzero().view(-1))


def test_scratch_reuse_across_sizes_gives_same_result():
    scratch = Scratch()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen) for n in (50_000, 120_001, 30_007, 120_001)]
    for x in xs:
        a, _ = sampled_select(x, 0.01, generator=torch.Generator().manual_seed(1), scratch=scratch)
        b, _ = sampled_select(x, 0.01, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a, b)
        _assert_largest(x, a)


def test_sampled_select_does_not_modify_input():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    sampled_select(x, 0.001, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, before)


def test_sampled_select_is_reproducible_with_generator():
    x = _distribution("mostly_zero_few_ties", 100_000, seed=0)
    a, ia = sampled_select(x, 0.001, generator=torch.Generator().manual_seed(9))
    b, ib = sampled_select(x, 0.001, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b) and ia == ib
