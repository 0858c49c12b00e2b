"""Compressors in a single process (world size 1): registry, conservation, DGC arithmetic, state."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import dgc
from dgc.comm import Comm
from dgc.compressors import DGC, PowerSGD, TernGrad, TopK, build_compressor, compressor_options
from dgc.compressors.base import Item
from dgc.timing import Phases

# -- helpers ---------------------------------------------------------------------------------


def _exchange(comp, items):
    comm = Comm()
    comp.bind(comm)
    comp.exchange(items, comm, Phases())


def _step(comp, items, comm):
    phases = Phases()
    comp.exchange(items, comm, phases)
    return phases


class RecordingDGC(DGC):
    """DGC that records the positions it selects, per tensor and step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.selected: list[dict[str, list[int]]] = []

    def exchange(self, items, comm, phases):
        self.selected.append({})
        super().exchange(items, comm, phases)

    def select(self, item, density, phases):
        idx, v = super().select(item, density, phases)
        self.selected[-1][item.name] = idx.tolist()
        return idx, v


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _loss_backward(model, step):
    x, y = _batch(step)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()


# -- registry and option validation ---------------------------------------------------------


def test_unknown_compressor_lists_valid_names():
    with pytest.raises(ValueError) as err:
        build_compressor("nope")
    assert "'nope'" in str(err.value)
    assert "valid: " + ", ".join(dgc.COMPRESSORS) in str(err.value)


@pytest.mark.parametrize("name", ["dgc", "topk", "terngrad", "powersgd"])
def test_unknown_option_names_valid_options(name):
    with pytest.raises(ValueError) as err:
        build_compressor(name, desnity=0.01)
    message = str(err.value)
    assert "desnity" in message
    for option in compressor_options(name):
        assert option in message


def test_options_of_dense_compressors():
    with pytest.raises(ValueError, match=r"valid: \(none\)"):
        build_compressor("none", density=0.1)
    assert compressor_options("fp16") == []
    assert "sample_ratio" in compressor_options("dgc") and "seed" in compressor_options("dgc")


@pytest.mark.parametrize("name", ["dgc", "topk"])
@pytest.mark.parametrize("density", [0, 0.0, 1.5, float("nan"), -0.01])
def test_bad_density_raises(name, density):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        build_compressor(name, density=density)


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("dgc", {"sample_ratio": 0.0}, "sample_ratio"),
        ("dgc", {"sample_ratio": 2.0}, "sample_ratio"),
        ("dgc", {"lower_bound": float("nan")}, "lower_bound"),
        ("dgc", {"max_adaptations": -1}, "max_adaptations"),
        ("dgc", {"max_adaptations": 2.5}, "max_adaptations"),
        ("dgc", {"wire_values": "fp64"}, "bf16, fp16, fp32|fp32"),
        ("topk", {"wire_indices": "int64"}, "delta16"),
        ("dgc", {"warmup_coeff": 0.25, "warmup_densities": [0.1]}, "not both"),
        ("powersgd", {"rank": 0}, "rank"),
        ("powersgd", {"rank": 1.5}, "rank"),
        ("terngrad", {"clip_sigma": 0.0}, "clip_sigma"),
        ("terngrad", {"clip_sigma": float("nan")}, "clip_sigma"),
    ],
)
def test_bad_options_raise(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_compressor(name, **kwargs)


def test_registry_builds_every_compressor():
    assert {"none", "fp16", "topk", "dgc", "terngrad", "powersgd"} <= set(dgc.COMPRESSORS)
    for name, cls in dgc.COMPRESSORS.items():
        comp = build_compressor(name)
        assert type(comp) is cls and comp.name == name and comp.config.name == name
        assert type(build_compressor(comp.config)) is cls  # from its config too


# -- conservation: sent + residual == accumulated ---------------------------------------------


def _grads(step, shapes, scale=1.0):
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(*s, generator=gen) * scale for s in shapes]


SHAPES = [(40, 50), (7, 3), (1, 1), (300,)]


@pytest.mark.parametrize("wire_values", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("wire_indices", ["delta16", "int32"])
def test_topk_conservation(wire_values, wire_indices):
    comp = build_compressor("topk", density=0.05, wire_values=wire_values, wire_indices=wire_indices)
    comm = Comm()
    comp.bind(comm)
    params = [torch.zeros(s) for s in SHAPES]
    for step in range(6):
        grads = _grads(step, SHAPES, scale=10.0 ** (step - 2))  # magnitudes from 0.01 to 1000
        items = [Item(f"t{i}", p, g.clone()) for i, (p, g) in enumerate(zip(params, grads))]
        before = [
            comp.state[it.name]["residual"].clone() if it.name in comp.state else torch.zeros(it.grad.numel())
            for it in items
        ]
        accumulated = [b + g.view(-1) for b, g in zip(before, grads)]
        phases = _step(comp, items, comm)
        sent_total = 0
        for it, acc in zip(items, accumulated):
            residual = comp.state[it.name]["residual"]
            sent = it.grad.view(-1)
            k = math.ceil(acc.numel() * 0.05)
            sent_pos = sent != 0
            sent_total += int(sent_pos.sum())
            assert int(sent_pos.sum()) == k
            # exactly the top-k of the accumulated values are sent
            top = torch.topk(acc.abs(), k).indices
            assert set(top.tolist()) == set(sent_pos.nonzero().view(-1).tolist())
            # conservation, exactly, whatever the value format: 16-bit rounding errors stay in the residual
            assert torch.equal(sent + residual, acc)
            if wire_values == "fp32":
                assert torch.equal(sent[sent_pos], acc[sent_pos])
                assert torch.all(residual[sent_pos] == 0)
            else:
                dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[wire_values]
                assert torch.equal(sent[sent_pos], acc[sent_pos].to(dtype).float())
                assert torch.equal(residual[sent_pos], acc[sent_pos] - acc[sent_pos].to(dtype).float())
            assert torch.equal(residual[~sent_pos], acc[~sent_pos])
        assert phases.counters["values_sent"] == sent_total


@pytest.mark.parametrize("wire_values", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [False, True])
def test_dgc_conservation(wire_values, nesterov, masking):
    comp = build_compressor("dgc", density=0.02, wire_values=wire_values, momentum_masking=masking, seed=3)
    comm = Comm()
    comp.bind(comm)
    params = [torch.zeros(s) for s in SHAPES]
    m = 0.9
    for step in range(6):
        grads = _grads(step, SHAPES, scale=10.0 ** (step - 2))
        items = [
            Item(f"t{i}", p, g.clone(), momentum=m, nesterov=nesterov) for i, (p, g) in enumerate(zip(params, grads))
        ]
        expected_u, expected_v = [], []
        for it, g in zip(items, grads):
            state = comp.state.get(it.name, {})
            u = state.get("u", torch.zeros(g.numel())).clone()
            v = state.get("v", torch.zeros(g.numel())).clone()
            g = g.view(-1)
            if nesterov:
                u = (u + g) * m
                v = v + u + g
            else:
                u = torch.add(g, u, alpha=m)
                v = v + u
            expected_u.append(u)
            expected_v.append(v)
        _step(comp, items, comm)
        for it, u, v in zip(items, expected_u, expected_v):
            sent = it.grad.view(-1)
            residual = comp.state[it.name]["v"]
            sent_pos = sent != 0
            assert sent_pos.any()
            # the sent part is the m largest |v| for some m <= k
            k = math.ceil(v.numel() * 0.02)
            assert int(sent_pos.sum()) <= k
            if (~sent_pos).any():
                assert v.abs()[~sent_pos].max() <= v.abs()[sent_pos].min()
            torch.testing.assert_close(sent + residual, v, rtol=0, atol=0)
            if wire_values == "fp32":
                assert torch.all(residual[sent_pos] == 0)
            # momentum masking clears u where v was sent
            u_after = comp.state[it.name]["u"]
            if masking:
                assert torch.all(u_after[sent_pos] == 0)
                torch.testing.assert_close(u_after[~sent_pos], u[~sent_pos], rtol=0, atol=0)
            else:
                torch.testing.assert_close(u_after, u, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_fp16_wire_beyond_fp16_range_keeps_conservation(name):
    # accumulated values above the fp16 maximum (65504): the sent value must stay finite
    # and the residual must keep what was not sent
    comp = build_compressor(name, density=0.5, wire_values="fp16")
    g = torch.tensor([1e5, -2e5, 1.0, 3e4])
    item = Item("w", torch.zeros(4), g.clone(), momentum=0.0)
    _exchange(comp, [item])
    acc_name = "residual" if name == "topk" else "v"
    residual = comp.state["w"][acc_name]
    assert torch.all(torch.isfinite(item.grad)) and torch.all(torch.isfinite(residual))
    torch.testing.assert_close(item.grad + residual, g, rtol=1e-6, atol=0)
    assert torch.equal(item.grad, torch.tensor([65504.0, -65504.0, 0.0, 0.0]))


# -- DGC's momentum correction and masking against a per-element reference -----------------


def _reference_dgc(grads, positions, momentum, nesterov, masking, correction=True):
    """Per-element DGC with Python floats: returns per-step (u, v, sent) lists."""
    n = len(grads[0])
    u, v = [0.0] * n, [0.0] * n
    out = []
    for g, sel in zip(grads, positions):
        for i in range(n):
            if not correction:
                v[i] += g[i]
            elif nesterov:
                u[i] = momentum * (u[i] + g[i])
                v[i] += u[i] + g[i]
            else:
                u[i] = momentum * u[i] + g[i]
                v[i] += u[i]
        # the library's positions must be the largest |v| of the reference (ties within rounding)
        chosen = set(sel)
        if chosen and len(chosen) < n:
            smallest_sent = min(abs(v[i]) for i in chosen)
            largest_unsent = max(abs(v[i]) for i in range(n) if i not in chosen)
            assert largest_unsent <= smallest_sent * (1 + 1e-5)
        sent = [0.0] * n
        for i in chosen:
            sent[i] = v[i]
            v[i] = 0.0
            if masking and correction:
                u[i] = 0.0
        out.append((list(u), list(v), sent))
    return out


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("density", [0.05, 1.0])
def test_dgc_matches_per_element_reference(nesterov, masking, density):
    shape, steps, m = (10, 20), 8, 0.9
    comp = RecordingDGC(density=density, momentum_masking=masking, seed=1)
    comm = Comm()
    comp.bind(comm)
    param = torch.zeros(shape)
    gen = torch.Generator().manual_seed(42)
    grads = [torch.randn(shape, generator=gen) for _ in range(steps)]
    library = []
    for g in grads:
        item = Item("w", param, g.clone(), momentum=m, nesterov=nesterov)
        _step(comp, [item], comm)
        state = comp.state["w"]
        library.append((state["u"].clone(), state["v"].clone(), item.grad.view(-1).clone()))
    positions = [sel["w"] for sel in comp.selected]
    k = math.ceil(200 * density)
    assert all(0.8 * k <= len(p) <= k for p in positions)
    if density == 1.0:
        assert all(p == list(range(200)) for p in positions)
    reference = _reference_dgc([g.view(-1).tolist() for g in grads], positions, m, nesterov, masking)
    for step, ((u, v, sent), (ru, rv, rsent)) in enumerate(zip(library, reference)):
        for got, want in ((u, ru), (v, rv), (sent, rsent)):
            torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # the accumulators must actually carry something over (not a trivial all-sent run)
    if density < 1.0:
        assert library[-1][1].abs().sum() > 0
        if not masking:
            assert library[-1][0].abs().sum() > 0


def test_dgc_without_momentum_correction_matches_reference():
    comp = RecordingDGC(density=0.05, momentum_correction=False, seed=2)
    assert not comp.owns_momentum
    comm = Comm()
    comp.bind(comm)
    param = torch.zeros(200)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(200, generator=gen) for _ in range(6)]
    library = []
    for g in grads:
        item = Item("w", param, g.clone(), momentum=0.9)  # ignored without correction
        _step(comp, [item], comm)
        assert "u" not in comp.state["w"]
        library.append((comp.state["w"]["v"].clone(), item.grad.clone()))
    positions = [sel["w"] for sel in comp.selected]
    reference = _reference_dgc([g.tolist() for g in grads], positions, 0.9, False, True, correction=False)
    for (v, sent), (_, rv, rsent) in zip(library, reference):
        torch.testing.assert_close(v, torch.tensor(rv), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sent, torch.tensor(rsent), rtol=1e-5, atol=1e-6)


# -- density 1.0 equivalences with torch.optim.SGD ------------------------------------------------


def _train(model, sync, opt, steps, start=0, epochs_per_step=None):
    trajectory = []
    for step in range(start, start + steps):
        if sync is not None and epochs_per_step is not None:
            sync.set_epoch(step * epochs_per_step)
        _loss_backward(model, step)
        if sync is not None:
            sync.step()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_without_masking_is_momentum_sgd(nesterov):
    model = _model()
    ref = copy.deepcopy(model)
    hyper = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    sync = dgc.GradientSync(model, build_compressor("dgc", density=1.0, momentum_masking=False))
    opt = dgc.SGD(model.parameters(), sync, **hyper)
    ref_opt = torch.optim.SGD(ref.parameters(), **hyper)
    got = _train(model, sync, opt, 12)
    want = _train(ref, None, ref_opt, 12)
    assert sync.owns_momentum(model[0].weight) and not sync.owns_momentum(model[0].bias)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
    # and it is not plain SGD: the momentum matters over 12 steps
    plain = _model()
    no_momentum = _train(plain, None, torch.optim.SGD(plain.parameters(), lr=0.05, weight_decay=1e-2), 12)
    assert not torch.allclose(no_momentum[-1][0], want[-1][0], atol=1e-4)


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_with_masking_is_sgd_without_momentum_on_compressed_tensors(nesterov):
    model = _model()
    ref = copy.deepcopy(model)
    lr, m, wd = 0.05, 0.9, 1e-2
    sync = dgc.GradientSync(model, build_compressor("dgc", density=1.0, momentum_masking=True))
    opt = dgc.SGD(model.parameters(), sync, lr=lr, momentum=m, nesterov=nesterov, weight_decay=wd)
    weights = [p for p in ref.parameters() if p.dim() > 1]
    biases = [p for p in ref.parameters() if p.dim() <= 1]
    # compressed weights: every coordinate is sent every step, so masking leaves no momentum;
    # Nesterov's v = u + g = (1 + m) g scales the rate. Biases are sent dense and get ordinary momentum.
    ref_opt = torch.optim.SGD(
        [
            {"params": weights, "momentum": 0.0, "nesterov": False, "lr": lr * (1 + m) if nesterov else lr},
            {"params": biases, "momentum": m, "nesterov": nesterov},
        ],
        lr=lr,
        weight_decay=wd,
    )
    got = _train(model, sync, opt, 12)
    want = _train(ref, None, ref_opt, 12)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


# -- state_dict: an interrupted run continues exactly ----------------------------------------------


def _bigger_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))


def _make_run(name, kwargs, seed):
    model = _bigger_model(seed)
    sync = dgc.GradientSync(model, build_compressor(name, **kwargs))
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return model, sync, opt


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


STATEFUL = [
    ("dgc", {"density": 0.05, "warmup_epochs": 1.0, "seed": 7}),
    ("dgc", {"density": 0.05, "warmup_coeff": 0.5, "warmup_epochs": 1.0, "wire_values": "fp16", "seed": 1}),
    ("topk", {"density": 0.05, "warmup_epochs": 1.0}),
    ("terngrad", {"seed": 3}),
    ("powersgd", {"rank": 2, "seed": 4}),
]


def _save_resume(name, kwargs, drop_extra=False):
    epochs_per_step = 0.1  # warm-up (1 epoch) spans steps 0-9: the resume happens mid-warm-up
    model, sync, opt = _make_run(name, kwargs, seed=0)
    _train(model, sync, opt, 5, 0, epochs_per_step)
    saved = _roundtrip({"sync": sync.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()})
    uninterrupted = _train(model, sync, opt, 5, 5, epochs_per_step)[-1]

    model2, sync2, opt2 = _make_run(name, kwargs, seed=123)  # fresh objects, different init
    model2.load_state_dict(saved["model"])
    if drop_extra:
        saved["sync"]["compressor"]["extra"] = {}
    sync2.load_state_dict(saved["sync"])
    opt2.load_state_dict(saved["opt"])
    assert sync2.steps == 5
    resumed = _train(model2, sync2, opt2, 5, 5, epochs_per_step)[-1]
    return uninterrupted, resumed, saved


@pytest.mark.parametrize("name,kwargs", STATEFUL, ids=[f"{n}-{i}" for i, (n, _) in enumerate(STATEFUL)])
def test_state_dict_resume_is_exact(name, kwargs):
    uninterrupted, resumed, saved = _save_resume(name, kwargs)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)
    tensors = saved["sync"]["compressor"]["tensors"]
    weight_names = {"0.weight", "2.weight"}
    assert set(tensors) == weight_names or name == "terngrad"
    expected_keys = {"dgc": {"u", "v"}, "topk": {"residual"}, "powersgd": {"error", "q"}}.get(name)
    if expected_keys:
        assert all(set(tensors[n]) == expected_keys for n in weight_names)
    if name in ("dgc", "terngrad"):
        assert "generator" in saved["sync"]["compressor"]["extra"]


@pytest.mark.parametrize("name", list(dgc.COMPRESSORS))
def test_every_compressor_resumes_exactly_with_its_defaults(name):
    uninterrupted, resumed, _ = _save_resume(name, {})
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name,kwargs", [STATEFUL[0], STATEFUL[3]], ids=["dgc", "terngrad"])
def test_resume_without_generator_state_diverges(name, kwargs):
    # control for the test above: the random state does matter for the trajectory
    uninterrupted, resumed, _ = _save_resume(name, kwargs, drop_extra=True)
    assert not all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


def test_load_state_of_another_compressor_raises():
    model, sync, _ = _make_run("topk", {"density": 0.1}, seed=0)
    _, other, _ = _make_run("dgc", {"density": 0.1}, seed=0)
    with pytest.raises(ValueError, match="topk"):
        other.load_state_dict(sync.state_dict())


# -- TernGrad -----------------------------------------------------------------------------------


def test_terngrad_values_are_ternary_and_unbiased():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(50, generator=gen)
    copies = 4000
    g = base.repeat(copies, 1)  # one tensor, every row the same gradient: one draw per row
    comp = TernGrad(clip_sigma=None, seed=0)
    item = Item("w", torch.zeros_like(g), g.clone())
    phases = Phases()
    comm = Comm()
    comp.bind(comm)
    comp.exchange([item], comm, phases)
    s = float(base.abs().max())
    out = item.grad
    assert set(torch.unique(out).tolist()) <= {-s, 0.0, s}
    assert set(torch.unique(out).tolist()) == {-s, 0.0, s}
    # signs agree with g where a value is sent
    assert torch.all(out * base >= 0)
    # the largest entry is always sent
    assert torch.all(out[:, base.abs().argmax()] == s * base[base.abs().argmax()].sign())
    mean = out.mean(0)
    stderr = s * 0.5 / math.sqrt(copies)
    assert torch.all((mean - base).abs() < 5 * stderr), (mean - base).abs().max()
    assert phases.counters["values_sent"] == g.numel()
    # two draws differ (stochastic), and the generator advanced
    item2 = Item("w", torch.zeros_like(g), g.clone())
    comp.exchange([item2], comm, Phases())
    assert not torch.equal(item2.grad, out)


def test_terngrad_clips_to_sigma():
    g = torch.zeros(1000)
    g[:999] = torch.randn(999, generator=torch.Generator().manual_seed(1))
    g[999] = 1000.0  # an outlier
    comp = TernGrad(clip_sigma=2.5, seed=0)
    item = Item("w", torch.zeros(1000), g.clone())
    _exchange(comp, [item])
    bound = float(2.5 * g.std())
    values = set(torch.unique(item.grad).tolist())
    assert values <= {-bound, 0.0, bound}
    assert item.grad[999].item() == pytest.approx(bound)


def test_terngrad_zero_gradient_and_scalar():
    comp = TernGrad(seed=0)
    zero = Item("z", torch.zeros(10), torch.zeros(10))
    scalar = Item("s", torch.zeros(1), torch.tensor([0.7]))
    _exchange(comp, [zero, scalar])
    assert torch.equal(zero.grad, torch.zeros(10))
    assert torch.equal(scalar.grad, torch.tensor([0.7]))  # |g| = s: sent with probability 1


# -- PowerSGD -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,rank", [((6, 4), 4), ((6, 4), 10), ((3, 2, 2), 3)])
def test_powersgd_full_rank_is_exact(shape, rank):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    comp = PowerSGD(rank=rank)
    item = Item("w", torch.zeros(shape), g.clone())
    _exchange(comp, [item])
    torch.testing.assert_close(item.grad, g)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_powersgd_low_rank_gradient_is_recovered_exactly(rank):
    # a gradient of rank r is in the span of P = M Q: rank-r PowerSGD reproduces it (low-rank path)
    gen = torch.Generator().manual_seed(rank)
    n, m = 30, 20
    g = torch.randn(n, rank, generator=gen) @ torch.randn(rank, m, generator=gen)
    comp = PowerSGD(rank=rank)
    assert comp._low_rank(Item("w", torch.zeros(n, m), g))
    item = Item("w", torch.zeros(n, m), g.clone())
    phases = Phases()
    comm = Comm()
    comp.bind(comm)
    comp.exchange([item], comm, phases)
    torch.testing.assert_close(item.grad, g, rtol=1e-4, atol=1e-4)
    assert phases.counters["values_sent"] == rank * (n + m)
    torch.testing.assert_close(comp.state["w"]["error"], torch.zeros(n * m), rtol=0, atol=1e-4)


def test_powersgd_error_feedback_accumulates_the_residual():
    gen = torch.Generator().manual_seed(0)
    n, m, rank, steps = 16, 12, 2, 6
    grads = [torch.randn(n, m, generator=gen) for _ in range(steps)]
    bias = torch.randn(n, generator=gen)
    comp = PowerSGD(rank=rank, seed=5)
    comm = Comm()
    comp.bind(comm)
    sent_sum = torch.zeros(n, m)
    q = None
    error = torch.zeros(n, m)
    for t, g in enumerate(grads):
        item = Item("w", torch.zeros(n, m), g.clone())
        b = Item("b", torch.zeros(n), bias.clone())
        comp.exchange([item, b], comm, Phases())
        # reference: M = g + e; P = M Q; P orthonormalized; Q = M^T P; update P Q^T; e = M - P Q^T
        matrix = g + error
        if q is None:
            q = comp._initial_q("w", m, rank, g)
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.t() @ p
        approx = p @ q.t()
        error = matrix - approx
        torch.testing.assert_close(item.grad, approx, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comp.state["w"]["error"].view(n, m), error, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comp.state["w"]["q"], q, rtol=1e-4, atol=1e-5)
        assert torch.linalg.matrix_rank(item.grad) <= rank
        assert torch.equal(b.grad, bias)  # a vector is sent dense
        sent_sum += item.grad
        # nothing is lost: everything not yet sent is in the error buffer
        torch.testing.assert_close(
            sent_sum + comp.state["w"]["error"].view(n, m), sum(grads[: t + 1]), rtol=1e-4, atol=1e-4
        )
    assert comp.state["w"]["error"].abs().max() > 1e-2  # a rank-2 view of 16x12 noise leaves a residual


def test_powersgd_without_error_feedback_keeps_no_error():
    g = torch.randn(16, 12, generator=torch.Generator().manual_seed(0))
    comp = PowerSGD(rank=1, error_feedback=False)
    item = Item("w", torch.zeros(16, 12), g.clone())
    _exchange(comp, [item])
    assert "error" not in comp.state["w"]
    assert torch.linalg.matrix_rank(item.grad) == 1


# -- dense compressors ----------------------------------------------------------------------------


def test_dense_compressors_single_process():
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    for name, expect in (("none", g), ("fp16", g.half().float())):
        comp = build_compressor(name)
        item = Item("w", torch.zeros(5, 7), g.clone())
        _exchange(comp, [item])
        assert torch.equal(item.grad, expect), name


def test_topk_sends_top_k_of_residual_over_steps():
    # a coordinate that is never large enough alone is sent once its residual has grown
    comp = TopK(density=0.25)
    comm = Comm()
    comp.bind(comm)
    g = torch.tensor([1.0, 0.3, 0.2, 0.1])
    sends = []
    for _ in range(4):
        item = Item("w", torch.zeros(4), g.clone())
        _step(comp, [item], comm)
        sends.append(item.grad.clone())
    assert torch.equal(sends[0], torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(sends[1], torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(sends[2], torch.tensor([1.0, 0, 0, 0]))
    # residual of entry 1 is now 1.2 > 1.0
    assert torch.allclose(sends[3], torch.tensor([0, 1.2, 0, 0]))


@pytest.mark.parametrize("name", ["powersgd", "qsgd"])
def test_parts_taken_in_turn_keep_their_layouts_and_give_what_layouts_made_anew_give(name):
    """The overlapped hook calls a compressor once per DDP bucket: what it derives from a part's tensors (PowerSGD's
    plan, QSGD's bucket ids) is kept per part, and gives bit for bit what making it again for every call gives."""
    shapes = [(16, 8, 3, 3), (16,), (10, 16), (8, 36), (3, 2)]
    comps = [build_compressor(name, seed=3) for _ in range(2)]
    comm = Comm()
    for comp in comps:
        comp.bind(comm)
    parts = [["a", "b"], ["c", "d", "e"]]  # two DDP buckets, in turn, every step
    params = {n: torch.zeros(s) for n, s in zip("abcde", shapes)}
    kept_layouts = []
    for step in range(4):
        grads = dict(zip("abcde", _grads(step, shapes)))
        results = []
        for i, comp in enumerate(comps):
            out = {}
            for part in parts:
                if i == 1:  # made anew for every call: what a single kept layout did when parts alternated
                    comp.__dict__.get("_plans", {}).clear()
                    comp.__dict__.get("_bucket_ids", {}).clear()
                items = [Item(n, params[n], grads[n].clone()) for n in part]
                _step(comp, items, comm)
                out.update({it.name: it.grad for it in items})
            results.append(out)
        for n in "abcde":
            assert torch.equal(results[0][n], results[1][n]), (step, n)
        kept = comps[0]._plans if name == "powersgd" else comps[0]._bucket_ids
        kept_layouts.append({k: id(v) for k, v in kept.items()})
    assert len(kept_layouts[-1]) == 2 and kept_layouts[1] == kept_layouts[-1]  # one per part, made once
    assert comps[0].state.keys() == comps[1].state.keys()
    for n, slot in comps[0].state.items():
        other = comps[1].state[n]
        assert slot.keys() == other.keys() and all(torch.equal(t, other[k]) for k, t in slot.items())
