"""dgc.amp.unscale_: fp16 loss scaling with DGC on 2 real gloo ranks (GradScaler works on the CPU)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import dgc
import dgc.amp
from tests.multiproc import run
from tests.test_sync_dist import batch, make_model, params

STEPS, OVERFLOW_AT = 20, 5


def _train(rank: int, world: int, mode: str) -> dict:
    """mode: plain (no scaler), scaled (fixed scale 1024), overflow (and an inf on rank 1 at one step),
    naive (overflow, but GradScaler's own unscale_)."""
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05), clip_norm=5.0)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3 if mode != "scaled" else 10**6)
    out: dict = {"scales": [], "skipped": []}
    for step in range(STEPS):
        sync.set_epoch(step / 4)
        x, y = batch(rank, step)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if mode == "plain":
            loss.backward()
            sync.step()
            opt.step()
            continue
        scaler.scale(loss).backward()
        if step == OVERFLOW_AT and rank == 1 and mode in ("overflow", "naive"):
            next(model.parameters()).grad.view(-1)[3] = float("inf")
        if step == OVERFLOW_AT:
            out["before"] = (params(model), copy.deepcopy(sync.compressor.state))
        if mode == "naive":
            scaler.unscale_(opt)
        else:
            dgc.amp.unscale_(scaler, opt, sync)
        stats = sync.step()
        scaler.step(opt)
        scaler.update()
        if step == OVERFLOW_AT:
            out["after"] = (params(model), copy.deepcopy(sync.compressor.state))
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(stats.skipped)
    out["params"], out["state"] = params(model), copy.deepcopy(sync.compressor.state)
    return out


def run_all(mode: str) -> list[dict]:
    return run(_train, 2, mode)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_at_a_fixed_scale_dgc_sees_the_unscaled_gradients() -> None:
    plain, scaled = run_all("plain"), run_all("scaled")
    for p, s in zip(plain, scaled):
        assert s["scales"] == [1024.0] * STEPS and not any(s["skipped"])
        assert all(close(a, b) for a, b in zip(p["params"], s["params"], strict=True))
        for name, slot in p["state"].items():  # DGC's momenta and residuals
            for key, tensor in slot.items():
                assert close(tensor, s["state"][name][key]), (name, key)


def test_an_overflow_on_one_rank_is_skipped_and_backed_off_on_every_rank() -> None:
    ranks = run_all("overflow")
    assert ranks[0]["scales"] == ranks[1]["scales"]
    assert ranks[0]["scales"][OVERFLOW_AT] == ranks[0]["scales"][OVERFLOW_AT - 1] / 2  # backed off together
    assert max(ranks[0]["scales"]) > 1024.0  # and it grows again (growth_interval 3)
    for out in ranks:
        assert out["skipped"] == [i == OVERFLOW_AT for i in range(STEPS)]
        (model_before, state_before), (model_after, state_after) = out["before"], out["after"]
        assert all(torch.equal(a, b) for a, b in zip(model_before, model_after, strict=True))
        for name, slot in state_before.items():
            for key, tensor in slot.items():
                assert torch.equal(tensor, state_after[name][key]) and bool(tensor.isfinite().all())
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))


def test_without_it_the_ranks_scales_part() -> None:
    """GradScaler's own unscale_ (the reason for dgc.amp.unscale_): rank 0 keeps its scale, rank 1 halves it."""
    ranks = run_all("naive")
    assert ranks[0]["scales"][OVERFLOW_AT] != ranks[1]["scales"][OVERFLOW_AT]
