"""dgc.segselect and DGC's bucketed path: the selection of every tensor at once equals the per-tensor one.

The bucketed path is the one CUDA tensors take (and the CPU's with ``DGC_KERNELS=0``); each test runs the same
steps through it and through the per-tensor path (``use_buckets = False``) and asks for the same averaged
gradients, the same residuals and momenta, the same thresholds, counters and generator state, bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dgc
from dgc import kernels, segselect
from dgc.compressors.dgc import DGC
from tests.multiproc import run
from tests.test_sync_dist import local_backward, make_model, params


def test_a_few_draws_equal_one_draw_per_tensor():
    # strides whose least common multiple passes 2**28 split the draws into runs; each run is one randint
    strides = [7, 100, 99, 97, 89, 83, 79, 73, 71, 2, 1, 64, 3, 101, 5]
    assert math.lcm(*strides) >= segselect.ONE_WORD_LIMIT
    runs = segselect._group_draws(strides)
    assert 1 < len(runs) < len(strides)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        single = [int(torch.randint(s, (1,), generator=g).item()) for s in strides]
        after_single = g.get_state()
        g = torch.Generator().manual_seed(seed)
        batched = torch.cat([torch.randint(0, r.high, (r.strides.numel(),), generator=g) % r.strides for r in runs])
        assert batched.tolist() == single
        assert torch.equal(g.get_state(), after_single)  # the stream goes on the same way


class Mixed(torch.nn.Module):
    """Tensors of many sizes: some too small to sample (exact top-k), some sampled, one with a long stride."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tiny = torch.nn.Linear(3, 4, bias=False)
        self.conv = torch.nn.Conv2d(8, 16, 3, bias=False)
        self.mid = torch.nn.Linear(300, 200)
        self.big = torch.nn.Linear(700, 300, bias=False)


def _fill(model: torch.nn.Module, gen: torch.Generator) -> None:
    for p in model.parameters():
        # heavy tails: thresholds that need lowering, and some that need many
        p.grad = torch.randn(p.shape, generator=gen) * (1 + 10 * torch.rand(p.shape, generator=gen) ** 4)


def _steps(model: torch.nn.Module, bucketed: bool, steps: int, nesterov: bool = False, warmup: bool = False,
           **options) -> tuple[list[list[torch.Tensor]], DGC, dgc.GradientSync]:  # fmt: skip
    model = copy.deepcopy(model)
    comp = DGC(**options)
    comp.use_buckets = bucketed
    sync = dgc.GradientSync(model, comp)
    dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        sync.set_epoch(step / 4 if warmup else 10.0)
        _fill(model, gen)
        sync.step()
        out.append([p.grad.clone() for _, p in sync.params])
    return out, comp, sync


def _assert_same(a, b) -> None:  # noqa: ANN001
    (ga, ca, sa), (gb, cb, sb) = a, b
    for step, (xs, ys) in enumerate(zip(ga, gb, strict=True)):
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(x, y), f"step {step}"
    assert set(ca.state) == set(cb.state)
    for name, slot in cb.state.items():
        for key, t in slot.items():
            assert torch.equal(ca.state[name][key], t), (name, key)
    assert ca.thresholds == cb.thresholds
    assert torch.equal(ca.generator.get_state(), cb.generator.get_state())
    counters = dict(sa.last.counters)
    assert counters.pop("selection_retries", 0) >= 0
    assert counters == sb.last.counters
    assert sa.last.sent_bytes == sb.last.sent_bytes


OPTIONS = {
    "paper": {"density": 0.001},
    "nesterov": {"density": 0.001, "nesterov": True},
    "dense-ish": {"density": 0.05},
    "warm-up": {"density": 0.001, "warmup_epochs": 4.0, "warmup": True},
    "fp16 values": {"density": 0.01, "wire_values": "fp16"},
    "int32 indices": {"density": 0.01, "wire_indices": "int32"},
    "no adaptation": {"density": 0.001, "max_adaptations": 0},
    "no momentum correction": {"density": 0.01, "momentum_correction": False},
    "no masking": {"density": 0.01, "momentum_masking": False},
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_the_bucketed_path_equals_the_per_tensor_path(case):
    options = dict(OPTIONS[case])
    extra = {k: options.pop(k) for k in ("nesterov", "warmup") if k in options}
    model = Mixed()
    with kernels.disabled():
        a = _steps(model, True, 12, **extra, **options)
        b = _steps(model, False, 12, **extra, **options)
    assert "dgc" in a[1].buckets and "dgc" not in b[1].buckets  # each took its own path
    _assert_same(a, b)


def test_a_misleading_sample_compares_again_with_lower_thresholds(monkeypatch):
    # no threshold below the sampled one computed at first: every tensor whose count falls short retries
    monkeypatch.setattr(segselect, "FIRST_LEVELS", 0)
    model = Mixed()
    with kernels.disabled():
        a = _steps(model, True, 6, density=0.001)
        b = _steps(model, False, 6, density=0.001)
    assert a[2].last.counters["selection_retries"] > 0
    _assert_same(a, b)


def test_gaps_longer_than_one_word_are_escaped_as_the_per_tensor_path_does():
    model = torch.nn.Linear(1000, 300, bias=False)
    gen = torch.Generator().manual_seed(0)
    runs = []
    for bucketed in (True, False):
        m = copy.deepcopy(model)
        comp = DGC(density=1e-5, momentum_correction=False)
        comp.use_buckets = bucketed
        sync = dgc.GradientSync(m, comp)
        grads = []
        for _ in range(3):
            g = torch.randn(300, 1000, generator=gen) * 1e-3
            g.view(-1)[[10, 100_000, 290_000]] = torch.tensor([5.0, -6.0, 7.0])  # k = 3, gaps > 65535
            m.weight.grad = g
            with kernels.disabled():
                sync.step()
            grads.append(m.weight.grad.clone())
        runs.append((grads, sync.last.sent_bytes))
    (ga, sa), (gb, sb) = runs
    assert sa == sb
    for x, y in zip(ga, gb, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(ga[-1].view(-1).nonzero().view(-1), torch.tensor([10, 100_000, 290_000]))


def test_a_resumed_run_continues_the_bucketed_path_exactly():
    model = Mixed()

    def build(m):  # noqa: ANN001, ANN202
        comp = DGC(density=0.01)
        sync = dgc.GradientSync(m, comp)
        opt = dgc.SGD(m.parameters(), sync, lr=0.1, momentum=0.9)
        return sync, opt

    def train(m, sync, opt, steps, gen):  # noqa: ANN001, ANN202
        for _ in range(steps):
            _fill(m, gen)
            sync.step()
            opt.step()

    with kernels.disabled():
        m1 = copy.deepcopy(model)
        s1, o1 = build(m1)
        gen = torch.Generator().manual_seed(3)
        train(m1, s1, o1, 4, gen)
        saved = copy.deepcopy((m1.state_dict(), o1.state_dict(), s1.state_dict(), gen.get_state()))
        train(m1, s1, o1, 4, gen)
        m2 = copy.deepcopy(model)
        s2, o2 = build(m2)
        m2.load_state_dict(saved[0])
        o2.load_state_dict(saved[1])
        s2.load_state_dict(saved[2])
        gen2 = torch.Generator()
        gen2.set_state(saved[3])
        train(m2, s2, o2, 4, gen2)
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    # the state saved is keyed by name, one tensor each, as the per-tensor path saves it
    tensors = saved[2]["compressor"]["tensors"]
    assert set(tensors) == {"tiny.weight", "conv.weight", "mid.weight", "big.weight"}
    assert tensors["big.weight"]["v"].shape == (700 * 300,)


def _both_paths(rank: int, world: int, exchange: str, r: int | None) -> dict:
    out = {}
    with kernels.disabled():
        for bucketed in (True, False):
            model = make_model()
            comp = dgc.build_compressor("dgc", density=0.05, warmup_epochs=0.5)
            comp.use_buckets = bucketed
            sync = dgc.GradientSync(model, comp, exchange=exchange, ranks_per_node=r)
            opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
            grads = []
            for step in range(20):
                sync.set_epoch(step / 8)
                local_backward(model, rank, step % 4)
                sync.step()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
            out[bucketed] = (params(model), grads, sync.last.sent_bytes, "dgc" in comp.buckets)
    return out


@pytest.mark.parametrize(("exchange", "world", "r"), [("flat", 2, None), ("hierarchical", 4, 2)])
def test_on_real_ranks_the_bucketed_path_averages_as_the_per_tensor_path(exchange, world, r):
    for out in run(_both_paths, world, exchange, r):
        (pa, ga, sa, used), (pb, gb, sb, unused) = out[True], out[False]
        assert used and not unused and sa == sb
        for x, y in zip(pa, pb, strict=True):
            assert torch.equal(x, y)
        for xs, ys in zip(ga, gb, strict=True):
            for x, y in zip(xs, ys, strict=True):
                assert torch.equal(x, y)
