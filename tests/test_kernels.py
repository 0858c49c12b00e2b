"""The native accumulate-and-select kernel, the fused DGC path, and threshold reuse."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import pytest
import torch

from dgc import kernels
from dgc.compressors import DGC, build_compressor
from dgc.compressors.base import Item
from dgc.select import Candidates, Scratch, threshold_select
from dgc.timing import Phases

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"no native kernel: {kernels.unavailable_reason()}")


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 3


@needs_kernel
@pytest.mark.parametrize("n", [1, 63, 64, 100_003, 1 << 18])
@pytest.mark.parametrize("mode", [kernels.COMPARE, kernels.ADD, kernels.MOMENTUM, kernels.NESTEROV])
def test_acc_select_matches_pytorch(n, mode):
    g, u, v = _data(n, seed=n)
    m, thr = 0.9, 4.0
    eu, ev = u.clone(), v.clone()
    if mode == kernels.ADD:
        ev.add_(g)
    elif mode == kernels.MOMENTUM:
        torch.add(g, eu, alpha=m, out=eu)
        ev.add_(eu)
    elif mode == kernels.NESTEROV:
        eu.add_(g).mul_(m)
        ev.add_(eu).add_(g)
    count, pos = kernels.acc_select(v, thr, n, mode=mode, g=g, u=u, momentum=m)
    expected = torch.nonzero(ev.abs() >= thr).view(-1)
    torch.testing.assert_close(u, eu, rtol=0, atol=0)
    torch.testing.assert_close(v, ev, rtol=0, atol=0)
    assert count == expected.numel()
    assert pos is not None and torch.equal(pos, expected)


@needs_kernel
def test_acc_select_overflow_keeps_the_count():
    _, _, v = _data(200_000)
    count, pos = kernels.acc_select(v, 0.5, 100)
    assert pos is None
    assert count == int((v.abs() >= 0.5).sum())
    count, pos = kernels.acc_select(v, float("inf"), 100)
    assert count == 0 and pos is not None and pos.numel() == 0


@needs_kernel
def test_acc_select_needs_its_inputs():
    v = torch.zeros(10)
    with pytest.raises(ValueError):
        kernels.acc_select(v, 1.0, 10, mode=kernels.MOMENTUM, g=torch.zeros(10))


@needs_kernel
def test_candidates_overflow_falls_back_to_the_mask():
    _, _, v = _data(100_000)
    found = Candidates(v, 1.0, 10, Scratch())
    assert found.count == int((v.abs() >= 1.0).sum())
    assert torch.equal(found.positions(), torch.nonzero(v.abs() >= 1.0).view(-1))


def _run_dgc(steps: int, n: int, *, nesterov: bool = False, **kwargs) -> tuple[list[torch.Tensor], DGC]:
    comp = DGC(density=0.001, seed=4, **kwargs)
    gen = torch.Generator().manual_seed(9)
    chosen = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        item = Item("w", torch.zeros(n), g, momentum=0.9, nesterov=nesterov)
        idx, v = comp.select(item, 0.001, Phases())
        chosen.append(idx.clone())
        v[idx] = 0
    return chosen, comp


@needs_kernel
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("correction", [True, False])
def test_fused_dgc_selects_what_the_pytorch_path_selects(nesterov, correction):
    """Sampling from the predicted accumulator gives the same selections as sampling after step 1."""
    n = 1 << 18
    fused, comp_f = _run_dgc(6, n, nesterov=nesterov, momentum_correction=correction)
    with kernels.disabled():
        plain, comp_p = _run_dgc(6, n, nesterov=nesterov, momentum_correction=correction)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    for key in comp_p.state["w"]:
        torch.testing.assert_close(comp_f.state["w"][key], comp_p.state["w"][key], rtol=0, atol=0)
    assert comp_f.thresholds == comp_p.thresholds


def _stationary_steps(comp: DGC, steps: int, n: int = 200_000, seed: int = 0) -> list[dict[str, int]]:
    """Steps whose accumulator has the same distribution every time (v is cleared before each)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    k = math.ceil(n * comp.density())
    for _ in range(steps):
        item = Item("w", torch.zeros(n), torch.randn(n, generator=gen), momentum=0.0)
        if "w" in comp.state:
            comp.state["w"]["v"].zero_()
        phases = Phases()
        before = item.grad.clone()
        idx, v = comp.select(item, comp.density(), phases)
        assert 0.8 * k <= idx.numel() <= k
        unsent = torch.ones(n, dtype=torch.bool)
        unsent[idx] = False
        assert before.abs()[unsent].max() <= before.abs()[idx].min()  # the m largest
        out.append(dict(phases.counters))
    return out


@pytest.mark.parametrize("use_kernel", [True, False])
def test_threshold_reuse_and_reestimation_period(use_kernel):
    if use_kernel and not kernels.available():
        pytest.skip("no native kernel")
    # k = 2000 and 10,000 samples: the sampled threshold lets through k +- 10%
    comp = DGC(density=0.01, sample_ratio=0.05, reestimate_every=4, momentum_correction=False, seed=1)
    if use_kernel:
        counters = _stationary_steps(comp, 12)
    else:
        with kernels.disabled():
            counters = _stationary_steps(comp, 12)
    reused = [c.get("threshold_reused", 0) for c in counters]
    sampled = [c.get("threshold_sampled", 0) for c in counters]
    assert all(r + s == 1 for r, s in zip(reused, sampled))
    assert sum(reused) >= 7  # a stationary distribution: the threshold stays good
    run = 0
    for r in reused:  # never more than reestimate_every - 1 reuses in a row
        run = run + 1 if r else 0
        assert run <= 3


def test_reestimate_every_one_never_reuses():
    comp = DGC(density=0.001, reestimate_every=1, momentum_correction=False)
    counters = _stationary_steps(comp, 4)
    assert all(c.get("threshold_reused", 0) == 0 and c["threshold_sampled"] == 1 for c in counters)


def test_threshold_select_rejects_counts_out_of_bounds():
    x = torch.arange(1000, dtype=torch.float32)
    idx, info = threshold_select(x, 100, 900.0)  # 100 pass
    assert idx is not None and info.reused and torch.equal(idx, torch.arange(900, 1000))
    idx, info = threshold_select(x, 100, 880.0)  # 120 pass: within 1.3 k, the 100 largest are kept
    assert idx is not None and torch.equal(idx, torch.arange(900, 1000)) and info.candidates == 120
    assert threshold_select(x, 100, 950.0)[0] is None  # 50 < 0.8 k
    assert threshold_select(x, 100, 850.0)[0] is None  # 150 > 1.3 k
    assert threshold_select(x, 100, 850.0, upper_bound=1.5)[0] is not None


def test_reuse_state_resumes_exactly():
    def run(comp: DGC, gen: torch.Generator, steps: int) -> list[torch.Tensor]:
        out = []
        for _ in range(steps):
            item = Item("w", torch.zeros(100_000), torch.randn(100_000, generator=gen), momentum=0.9)
            idx, v = comp.select(item, 0.001, Phases())
            v[idx] = 0
            out.append(idx)
        return out

    comp = DGC(density=0.001, reestimate_every=5, seed=3)
    gen = torch.Generator().manual_seed(0)
    run(comp, gen, 3)
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    gen_state = gen.get_state()
    rest = run(comp, gen, 6)
    buf.seek(0)
    resumed = DGC(density=0.001, reestimate_every=5, seed=3)
    saved = torch.load(buf, weights_only=False)
    assert saved["extra"]["thresholds"]["w"][1] >= 0  # the reuse state travels with the checkpoint
    resumed.load_state_dict(saved)
    gen.set_state(gen_state)
    again = run(resumed, gen, 6)
    for a, b in zip(rest, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"upper_bound": 0.9}, "upper_bound"),
        ({"upper_bound": float("nan")}, "upper_bound"),
        ({"reestimate_every": 0}, "reestimate_every"),
        ({"reestimate_every": 2.5}, "reestimate_every"),
        ({"reestimate_every": True}, "reestimate_every"),
    ],
)
def test_bad_reuse_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_compressor("dgc", **kwargs)


def test_a_corrupt_cached_library_is_built_again(tmp_path):
    """A cached .so that no longer loads (a build cut short, a disk error) is rebuilt, not a warning every run."""
    if kernels._compiler() is None:
        pytest.skip("no C compiler")
    env = {**os.environ, "DGC_KERNEL_CACHE": str(tmp_path), "DGC_KERNELS": "1"}
    probe = [sys.executable, "-W", "error", "-c", "from dgc import kernels; assert kernels.available(), "
             "kernels.unavailable_reason()"]  # fmt: skip
    assert subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300).returncode == 0
    (built,) = tmp_path.glob("dgc_kernels-*.so")
    built.write_bytes(b"not a shared library")
    out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1000:]
    assert built.read_bytes().startswith(b"\x7fELF")
