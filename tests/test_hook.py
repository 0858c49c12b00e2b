"""The DDP communication hook computes exactly what the library path computes."""

from __future__ import annotations

import torch

import dgc
from tests.multiproc import run
from tests.test_sync_dist import make_model, params, train_loop


def _train(rank: int, world: int, use_ddp: bool, name: str, kwargs: dict, steps: int) -> tuple[list, list, int]:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), clip_norm=2.0)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    # tiny buckets: several per step, so the hook's wait-for-the-last-bucket path is exercised
    losses, _ = train_loop(rank, model, sync, opt, steps, 0.0005 if use_ddp else None)
    return params(model), losses, sync.steps


def _compare(rank: int, world: int) -> dict:
    out = {}
    for name, kwargs in {"dgc": {"density": 0.05, "warmup_epochs": 1}, "topk": {"density": 0.1}}.items():
        out[name] = (_train(rank, world, True, name, kwargs, 16), _train(rank, world, False, name, kwargs, 16))
    return out


def test_ddp_hook_matches_library_path() -> None:
    for out in run(_compare, 2):
        for name, ((hook_params, hook_losses, hook_steps), (lib_params, _, _)) in out.items():
            assert hook_steps == 16, f"{name}: the hook ran {hook_steps} exchanges for 16 steps"
            for a, b in zip(hook_params, lib_params, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
            assert sum(hook_losses[-4:]) < sum(hook_losses[:4]), f"{name}: loss did not fall"


# -- any optimizer: DGC without momentum correction (sampled top-k with error feedback) and AdamW ---------


def _adamw(rank: int, world: int, use_ddp: bool, name: str, kwargs: dict, steps: int) -> tuple[list, list, int]:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), clip_norm=2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-2)
    losses, _ = train_loop(rank, model, sync, opt, steps, 0.0005 if use_ddp else None)
    return params(model), losses, sync.steps


def _compare_adamw(rank: int, world: int) -> dict:
    out = {}
    for name, kwargs in {"dgc": {"density": 0.05, "warmup_epochs": 1, "momentum_correction": False},
                         "topk": {"density": 0.1}}.items():  # fmt: skip
        out[name] = (_adamw(rank, world, True, name, kwargs, 24), _adamw(rank, world, False, name, kwargs, 24))
    return out


def test_adamw_through_the_hook_matches_the_library_path_and_trains() -> None:
    for out in run(_compare_adamw, 2):
        for name, ((hook_params, hook_losses, hook_steps), (lib_params, _, _)) in out.items():
            assert hook_steps == 24
            for a, b in zip(hook_params, lib_params, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            assert sum(hook_losses[-4:]) < 0.8 * sum(hook_losses[:4]), f"{name}: loss did not fall {hook_losses}"


def test_momentum_correction_needs_dgc_sgd_and_says_so() -> None:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05))
    torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    try:
        sync.step()
    except RuntimeError as exc:
        assert "dgc.SGD" in str(exc) and "momentum_correction=false" in str(exc)
    else:
        raise AssertionError("DGC with momentum correction ran without dgc.SGD")
