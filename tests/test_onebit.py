"""The 1-bit exchange of the tensors a sparse compressor leaves dense (``Policy(dense_values="1bit")``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dgc
from dgc.compressors.onebit import OneBit, pack_signs, unpack_signs
from tests.multiproc import run


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.BatchNorm1d(10), torch.nn.ReLU(), torch.nn.Linear(10, 3)
    )  # fmt: skip


def small(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.dim() < 2]


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """What one worker sends for tensor ``x`` (no residual yet): mean |x| times the signs."""
    return x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)


def train(model: torch.nn.Module, sync: dgc.GradientSync, opt: dgc.SGD, rank: int, steps: range) -> None:
    for step in steps:
        backward(model, rank, step)
        sync.step()
        opt.step()


def build(model: torch.nn.Module) -> tuple[dgc.GradientSync, dgc.SGD]:
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1), policy=dgc.Policy(dense_values="1bit"))
    return sync, dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_signs_pack_eight_per_byte_and_unpack(n: int) -> None:
    x = torch.randn(n)
    x[0] = 0.0  # zero counts as positive
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert torch.equal(unpack_signs(packed, n), torch.where(x >= 0, 1.0, -1.0))
    # batched rows (one message per worker)
    assert torch.equal(unpack_signs(torch.stack([packed, packed]), n)[1], torch.where(x >= 0, 1.0, -1.0))


def test_error_feedback_loses_nothing_single_process() -> None:
    """What was sent over the steps plus what is left in the residual is the sum of the gradients."""
    model = make_model()
    sync, _ = build(model)
    total = {n: torch.zeros_like(p) for n, p in small(model)}
    sent = {n: torch.zeros_like(p) for n, p in small(model)}
    for step in range(6):
        backward(model, 0, step)
        for n, p in small(model):
            total[n] += p.grad
        stats = sync.step()
        for n, p in small(model):
            sent[n] += p.grad
            # one scale per tensor: every value sent is +-scale
            assert torch.unique(p.grad.abs()).numel() == 1
    assert sync.dense_compressor is not None
    for n, p in small(model):
        residual = sync.dense_compressor.state[n]["residual"].view_as(p)
        torch.testing.assert_close(sent[n] + residual, total[n], rtol=0, atol=1e-5)
    numels = [p.numel() for _, p in small(model)]
    assert OneBit.message_bytes(numels) == 4 * 4 + (10 + 10 + 10 + 3 + 7) // 8
    # the 1-bit message is part of what the step counts as sent (with the sparse message)
    assert stats.dense_sent_bytes == OneBit.message_bytes(numels) < stats.sent_bytes
    # with the default policy the same tensors go by an fp32 allreduce
    plain = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    dgc.SGD(model.parameters(), plain, lr=0.1, momentum=0.9)
    backward(model, 0, 0)
    assert plain.step().dense_sent_bytes == 4 * sum(numels)


def _average(rank: int, world: int) -> dict:
    model = make_model()
    sync, _ = build(model)
    backward(model, rank, 0)
    local = {n: p.grad.detach().clone() for n, p in small(model)}
    sync.step()
    got = {n: p.grad.detach().clone() for n, p in small(model)}
    residual = {n: sync.dense_compressor.state[n]["residual"].clone() for n, _ in small(model)}
    return {"local": local, "got": got, "residual": residual, "sent": sync.last.sent_bytes}


@pytest.mark.parametrize("world", [2, 4])
def test_workers_average_the_scaled_signs(world: int) -> None:
    outs = run(_average, world)
    for name in outs[0]["local"]:
        expected = torch.stack([scaled_sign(o["local"][name]) for o in outs]).mean(0)
        for o in outs:
            torch.testing.assert_close(o["got"][name], expected, rtol=1e-6, atol=1e-7)
            # the residual is what this worker did not send
            mine = scaled_sign(o["local"][name])
            torch.testing.assert_close(o["residual"][name].view_as(mine), o["local"][name] - mine)


def _resume(rank: int, world: int) -> dict:
    straight = make_model()
    train(straight, *build(straight), rank, range(5))
    resumed = make_model()
    sync, opt = build(resumed)
    train(resumed, sync, opt, rank, range(3))
    state, opt_state, weights = sync.state_dict(), opt.state_dict(), resumed.state_dict()
    again = make_model(seed=1)
    again.load_state_dict(weights)
    sync2, opt2 = build(again)
    sync2.load_state_dict(state)
    opt2.load_state_dict(opt_state)
    train(again, sync2, opt2, rank, range(3, 5))
    return {"straight": list(straight.state_dict().values()), "resumed": list(again.state_dict().values())}


def test_residuals_are_saved_and_resumed() -> None:
    for out in run(_resume, 2):
        for a, b in zip(out["straight"], out["resumed"], strict=True):
            assert torch.equal(a, b)


def test_state_without_residuals_is_refused() -> None:
    model = make_model()
    plain = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1))
    sync, _ = build(model)
    with pytest.raises(ValueError, match="1-bit residuals"):
        sync.load_state_dict(plain.state_dict())


def test_policy_names_the_valid_dense_values() -> None:
    with pytest.raises(ValueError, match=r"'fp32', 'fp16', 'bf16', '1bit'"):
        dgc.Policy(dense_values="2bit")
    # dense compressors send everything their way: no 1-bit path
    dense = dgc.GradientSync(make_model(), dgc.build_compressor("none"), policy=dgc.Policy(dense_values="1bit"))
    assert dense.dense_compressor is None
