"""CUDA checks: the same code on CUDA tensors gives the CPU's numbers (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dgc
from tests.test_sync_dist import batch, make_model

pytestmark = pytest.mark.gpu


def _train(device: str, name: str, kwargs: dict) -> list[torch.Tensor]:
    model = make_model().to(device)
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), clip_norm=2.0)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    for step in range(8):
        x, y = batch(0, step)
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        sync.step()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize(
    "name,kwargs",
    [("dgc", {"density": 0.05}), ("topk", {"density": 0.05}), ("powersgd", {"rank": 2}), ("fp16", {})],
)
def test_cuda_matches_cpu(name: str, kwargs: dict) -> None:
    cpu = _train("cpu", name, copy.deepcopy(kwargs))
    gpu = _train("cuda", name, copy.deepcopy(kwargs))
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cuda_sampled_selection_is_on_device() -> None:
    from dgc.select import sampled_select

    x = torch.randn(1_000_000, device="cuda")
    idx, info = sampled_select(x, 0.001)
    assert idx.is_cuda and info.selected <= info.k
    assert x.abs()[idx].min() >= x.abs().sort(descending=True).values[info.selected - 1] - 1e-6
