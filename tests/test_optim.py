"""dgc.SGD: learning rate only where the sync keeps the momentum, torch.optim.SGD elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dgc
from dgc.sync.step import hypers_of


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))


def _backward(model, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 2, generator=gen)
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def _run(model, opt, steps, sync=None):
    out = []
    for step in range(steps):
        _backward(model, step)
        if sync is not None:
            sync.step()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


HYPERS = [
    dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0),
    dict(lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.0),
    dict(lr=0.05, momentum=0.5, nesterov=False, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=1e-1),
]


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("none", {}),
        ("topk", {"density": 1.0}),
        ("dgc", {"density": 1.0, "momentum_correction": False}),
    ],
)
def test_matches_torch_sgd_when_sync_keeps_no_momentum(hyper, name, kwargs):
    model = _model()
    ref = copy.deepcopy(model)
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs))
    opt = dgc.SGD(model.parameters(), sync, **hyper)
    assert not any(sync.owns_momentum(p) for p in model.parameters())
    got = _run(model, opt, 8, sync)
    want = _run(ref, torch.optim.SGD(ref.parameters(), **hyper), 8)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
    assert not torch.equal(got[-1][0], got[0][0])


def test_matches_torch_sgd_with_param_groups():
    model = _model()
    ref = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": [m[0].weight, m[0].bias], "momentum": 0.9, "nesterov": True},
            {"params": [m[2].weight, m[2].bias], "lr": 0.01, "weight_decay": 0.1},
        ]

    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    opt = dgc.SGD(groups(model), sync, lr=0.1, momentum=0.5)
    hypers = hypers_of(opt.param_groups)  # what a step reads from the groups
    assert hypers[id(model[0].weight)] == (0.9, True, 0.0, 0.1)
    assert hypers[id(model[2].bias)] == (0.5, False, 0.1, 0.01)
    got = _run(model, opt, 6, sync)
    want = _run(ref, torch.optim.SGD(groups(ref), lr=0.1, momentum=0.5), 6)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("nesterov", [False, True])
def test_only_the_learning_rate_where_the_sync_keeps_the_momentum(nesterov):
    model = _model()
    ref = copy.deepcopy(model)
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    lr, m, wd = 0.1, 0.9, 0.05
    opt = dgc.SGD(model.parameters(), sync, lr=lr, momentum=m, nesterov=nesterov, weight_decay=wd)
    ref_opt = torch.optim.SGD([ref[0].bias, ref[2].bias], lr=lr, momentum=m, nesterov=nesterov, weight_decay=wd)
    owned = [model[0].weight, model[2].weight]
    assert all(sync.owns_momentum(p) for p in owned)
    assert not sync.owns_momentum(model[0].bias)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        before = [p.detach().clone() for p in owned]
        # gradients set by hand (as if already exchanged): the optimizer alone is under test; the sync runs
        # first only because dgc.SGD refuses a step it did not see
        sync.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        for p, b in zip(owned, before):
            # no momentum, no weight decay: those were applied inside the sync
            assert torch.equal(p.detach(), torch.add(b, p.grad, alpha=-lr))
        for p, q in ((model[0].bias, ref[0].bias), (model[2].bias, ref[2].bias)):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    # no momentum buffer is kept for the owned tensors
    assert all("momentum_buffer" not in opt.state[p] for p in owned)
    assert all("momentum_buffer" in opt.state[p] for p in (model[0].bias, model[2].bias))


def test_dgc_without_dgc_sgd_raises():
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # not bound to the sync
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=r"dgc\.SGD"):
        sync.step()


def test_dgc_without_momentum_correction_needs_no_dgc_sgd():
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1, momentum_correction=False))
    _backward(model, 0)
    sync.step()  # the optimizer applies momentum: nothing to pass to the compressor
    assert sync.last is not None and sync.last.step == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -0.1}, "lr"),
        ({"lr": 0.1, "momentum": -0.9}, "momentum"),
        ({"lr": 0.1, "weight_decay": -1e-4}, "weight_decay"),
        ({"lr": 0.1, "nesterov": True}, "nesterov"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    with pytest.raises(ValueError, match=match):
        dgc.SGD(model.parameters(), sync, **kwargs)


def test_closure_and_missing_grads():
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step() is None  # no grads at all: nothing moves
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loss = opt.step(lambda: (_backward(model, 0), sync.step())[0])  # the sync runs inside the closure
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(before[0], model[0].weight)


def test_binds_itself_to_the_sync():
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, weight_decay=1e-3)
    assert sync.optimizer is opt
    assert step_hyper(sync, model[0].weight) == (0.9, False, 1e-3, 0.1)


def test_the_step_reads_the_live_param_groups():
    model = _model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)
    state = opt.state_dict()
    state["param_groups"][0]["momentum"] = 0.5
    opt.load_state_dict(state)
    assert opt.param_groups[0]["momentum"] == 0.5
    opt.param_groups[0]["weight_decay"] = 1e-3  # e.g. a scheduler writing to the live groups
    assert step_hyper(sync, model[0].weight) == (0.5, False, 1e-3, 0.1)
    extra = torch.nn.Parameter(torch.zeros(3, 3))
    opt.add_param_group({"params": [extra], "momentum": 0.7})
    assert step_hyper(sync, extra) == (0.7, False, 0.0, 0.1)


def step_hyper(sync, param):
    """The hyperparameters a step of ``sync`` runs ``param`` with: read from the bound optimizer's live groups when
    the step begins."""
    return tuple(sync.begin(parts=False).hypers[id(param)])
