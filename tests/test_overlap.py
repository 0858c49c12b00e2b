"""The overlapped DDP hook (dgc.overlap): the serial hook's arithmetic bucket by bucket, its non-finite guard over
the whole step, requests, failures reaching the caller; per-tensor clipping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import dgc
from tests.multiproc import run
from tests.test_sync_dist import batch, make_model, params, train_loop

# tiny buckets: one or two tensors each, so every step is several buckets
BUCKET_MB = 0.0005


def _train(rank: int, overlap: bool, name: str, kwargs: dict, steps: int, clip: float | None, scope: str,
           ddp: bool = True) -> tuple[list, list, int, int]:  # fmt: skip
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), clip_norm=clip, overlap=overlap,
                            clip_scope=scope)  # fmt: skip
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses, stats = train_loop(rank, model, sync, opt, steps, BUCKET_MB if ddp else None)
    return params(model), losses, sync.steps, max(s.collectives for s in stats)


def _equal_runs(rank: int, world: int) -> dict:
    dense1 = {"density": 1.0, "warmup_epochs": 0}
    return {
        # the check: DGC at density 1 without clipping, overlapped hook against the serial hook
        "dgc-density-1": (_train(rank, True, "dgc", dense1, 12, None, "auto"),
                          _train(rank, False, "dgc", dense1, 12, None, "auto")),
        # per-tensor clipping that bites (clip 0.05), the same in the overlapped hook and the library path
        "none-clip-tensor": (_train(rank, True, "none", {}, 12, 0.05, "tensor"),
                             _train(rank, False, "none", {}, 12, 0.05, "tensor", ddp=False)),
    }  # fmt: skip


def test_the_overlapped_hook_equals_the_serial_one_and_the_library_path() -> None:
    for out in run(_equal_runs, 2):
        for case, ((p_over, losses, steps, collectives), (p_ref, _, _, ref_collectives)) in out.items():
            assert steps == 12, f"{case}: {steps} exchanges for 12 steps"
            # one agreement and at least one exchange per bucket: the step came in several parts
            assert collectives > ref_collectives, f"{case}: {collectives} collectives, serial {ref_collectives}"
            for a, b in zip(p_over, p_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, c=case: f"{c}: {m}")
            assert sum(losses[-4:]) < sum(losses[:4]), f"{case}: loss did not fall"


def _clip_differs(rank: int, world: int) -> tuple[list, list]:
    # the negative control of the test above: per-step and per-tensor clipping give other weights
    a = _train(rank, False, "none", {}, 4, 0.05, "tensor", ddp=False)[0]
    b = _train(rank, False, "none", {}, 4, 0.05, "step", ddp=False)[0]
    return a, b


def test_per_tensor_clipping_is_not_the_whole_gradient_clip() -> None:
    a, b = run(_clip_differs, 2)[0]
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-4


# -- the non-finite guard over a step in parts ---------------------------------------------------------------


def _nan_in_the_last_bucket(rank: int, world: int, pack: str = "none") -> dict:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1, warmup_epochs=0), clip_norm=1.0,
                            overlap=True, pack=pack)  # fmt: skip
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    net = DDP(model, bucket_cap_mb=BUCKET_MB)
    net.register_comm_hook(sync, dgc.ddp_comm_hook)
    first = model[0].weight  # its gradient is computed last: it is in the step's last bucket
    poison = {"on": False}
    first.register_hook(lambda g: torch.full_like(g, math.nan) if poison["on"] else g)
    out: dict = {}
    for step in range(6):
        x, y = batch(rank, step % 4)
        opt.zero_grad()
        poison["on"] = step == 3 and rank == 1
        if step == 3:
            out["before"] = (params(model), sync.state_dict(), sync.compressor.extra_state())
            if rank == 0:
                sync.request("checkpoint")
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if step == 3:
            out["after"] = (params(model), sync.state_dict(), sync.compressor.extra_state())
            out["stats"] = (sync.last.skipped, sync.last.requests, sync.last.sent_bytes)
        else:
            assert not sync.last.skipped and not sync.last.requests
    out["end"] = params(model)
    return out


@pytest.mark.parametrize("pack", ["none", "all"])  # all: each bucket's flags in its message, read at the end
def test_a_nan_in_one_workers_last_bucket_leaves_every_workers_state_and_model_untouched(pack) -> None:
    outs = run(_nan_in_the_last_bucket, 2, pack)
    for rank, out in enumerate(outs):
        skipped, requests, _ = out["stats"]
        assert skipped, f"rank {rank} did not skip the step with rank 1's NaN"
        assert requests == ("checkpoint",), f"rank {rank} saw {requests}: rank 0's request was lost"
        (p0, s0, e0), (p1, s1, e1) = out["before"], out["after"]
        for a, b in zip(p0, p1, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        tensors0, tensors1 = s0["compressor"]["tensors"], s1["compressor"]["tensors"]
        assert tensors0.keys() == tensors1.keys() and tensors0
        for name in tensors0:
            for key in tensors0[name]:
                where = f"rank {rank}: {name}.{key} changed"
                torch.testing.assert_close(tensors0[name][key], tensors1[name][key], rtol=0, atol=0,
                                           msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip
        assert torch.equal(e0["generator"], e1["generator"]), f"rank {rank}: the sampling stream moved"
        assert e0["thresholds"] == e1["thresholds"]
        assert all(torch.isfinite(p).all() for p in out["end"]), "a NaN reached the model"
    for a, b in zip(outs[0]["end"], outs[1]["end"], strict=True):  # the workers stayed in step
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- failures --------------------------------------------------------------------------------------------------


def _failure_in_the_thread(rank: int, world: int) -> str:
    model = make_model()
    # accumulate="updates" needs dgc.SGD's learning rates: with AdamW the exchange fails in the pipeline's thread
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.1, warmup_epochs=0, momentum_correction=False),
                            overlap=True, accumulate="updates")  # fmt: skip
    torch.optim.AdamW(model.parameters())
    net = DDP(model, bucket_cap_mb=BUCKET_MB)
    net.register_comm_hook(sync, dgc.ddp_comm_hook)
    x, y = batch(rank, 0)
    try:
        F.cross_entropy(net(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_failure_in_the_pipeline_reaches_backward() -> None:
    for message in run(_failure_in_the_thread, 2):
        assert "dgc.SGD" in message, message


def test_overlap_refuses_the_whole_gradient_clip() -> None:
    with pytest.raises(ValueError, match="clip_scope=tensor"):
        dgc.GradientSync(make_model(), dgc.build_compressor("dgc"), clip_norm=1.0, overlap=True, clip_scope="step")
    with pytest.raises(ValueError, match="one of auto, step, tensor"):
        dgc.GradientSync(make_model(), dgc.build_compressor("dgc"), clip_scope="layer")


def test_per_tensor_clip_gives_each_tensor_its_share_of_the_bound() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 1, bias=False))  # 9 + 3
    sync = dgc.GradientSync(model, dgc.build_compressor("none"), clip_norm=2.0, clip_scope="tensor")
    big, small = model[0].weight, model[1].weight
    big.grad, small.grad = torch.full((3, 3), 10.0), torch.full((1, 3), 0.01)
    sync.step()
    # a world of one: the bound is 2.0; the 9-value tensor's share is 2.0 * (9/12)**0.5, the small one is under its own
    assert big.grad.norm().item() == pytest.approx(2.0 * (9 / 12) ** 0.5, rel=1e-5)
    torch.testing.assert_close(small.grad, torch.full((1, 3), 0.01))
