"""dgc.stepping: one optimizer step with its exchange, the trainer's one loop shape (EveryStep, Stepped)."""

from __future__ import annotations

import pytest
import torch

import dgc
from dgc.stats import StepStats


def _stats(**kw) -> StepStats:
    base = dict(step=1, epoch=0.0, density=1.0, dense_bytes=40, sent_bytes=40, recv_bytes=40, collectives=1)
    return StepStats(**{**base, **kw})


def _model_and_sgd():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    return model, sync, torch.optim.SGD(model.parameters(), lr=0.5)


def test_every_step_exchanges_then_updates_and_a_non_finite_step_updates_nothing():
    model, sync, opt = _model_and_sgd()
    stepper = dgc.EveryStep(sync, opt)
    calls = []
    model(torch.ones(3, 4)).sum().backward()
    before = model.weight.detach().clone()
    stepped = stepper.step(before_update=lambda: calls.append(model.weight.grad.clone()))
    assert not stepped.skipped and stepped.outer is None and len(calls) == 1
    assert torch.equal(model.weight, before - 0.5 * calls[0])  # the update ran after the exchange, on its result
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    model.bias.grad[0] = float("nan")
    after = [p.detach().clone() for p in model.parameters()]
    stepped = stepper.step(before_update=lambda: calls.append(None))
    assert stepped.skipped and len(calls) == 1  # neither the clipping nor the update
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))


def test_hooked_reads_the_hooks_exchange_and_says_how_to_register_it_when_none_ran():
    model, sync, opt = _model_and_sgd()
    with pytest.raises(RuntimeError, match=r"net.register_comm_hook\(sync, dgc.ddp_comm_hook\)"):
        dgc.EveryStep(sync, opt, hooked=True).step()
    sync.last = _stats(skipped=True)
    assert dgc.EveryStep(sync, opt, hooked=True).step().stats is sync.last


def test_stepped_adds_the_outer_exchange_to_the_steps():
    inner = _stats(sent_bytes=0, compress_s=1.0, requests=("checkpoint",))
    outer = _stats(sent_bytes=64, compress_s=0.5, communicate_s=2.0, decompress_s=0.25, requests=("stop",),
                   skipped=True)  # fmt: skip
    both = dgc.Stepped(inner, outer)
    assert both.sent_bytes == 64 and both.communicate_s == 2.0 and both.exchange_s == 3.75
    assert both.requests == ("checkpoint", "stop") and not both.skipped and both.outer_skipped
    alone = dgc.Stepped(inner)
    assert alone.sent_bytes == 0 and alone.requests == ("checkpoint",) and not alone.outer_skipped
