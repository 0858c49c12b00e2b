"""The wrong wirings a user of the raw library makes (inside Lightning or Accelerate, or by hand), each in a
real 2-process gloo run: refused in one line at the first step where it can be seen, or (a resume that lost
the compression state, a warm-up never driven) said once, loudly."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dgc
from tests.multiproc import run
from tests.test_sync_dist import local_backward, make_model

BUILT_TOO_EARLY = """
import torch, torch.distributed as dist, torch.nn.functional as F
import dgc
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.5))  # before the process group
opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)
dist.init_process_group("gloo")
F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2)).backward()
sync.step()
opt.step()
dist.destroy_process_group()
"""


def test_a_sync_built_before_the_process_group_is_refused(tmp_path) -> None:
    script = tmp_path / "early.py"
    script.write_text(BUILT_TOO_EARLY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    line = ("RuntimeError: GradientSync was built before the process group existed (a world of one), but this job "
            "has 2 workers: build it after init_process_group (Lightning: in setup() or configure_optimizers(); "
            "Accelerate: after Accelerator())")  # fmt: skip
    assert out.stderr.count(line) == 2, out.stderr[-3000:]  # each worker, at its first step


def _no_hook(rank: int, world: int) -> str:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05))
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
    ddp = DistributedDataParallel(model)  # the hook never registered: DDP averages densely
    x, y = torch.randn(8, 2, 6, 6), torch.randint(0, 5, (8,))
    F.cross_entropy(ddp(x), y).backward()
    with pytest.raises(RuntimeError) as err:
        opt.step()
    return str(err.value)


def test_dgc_sgd_without_the_sync_is_refused() -> None:
    for message in run(_no_hook, 2):
        assert message.startswith("dgc.SGD.step: the gradient sync did not run for this step: call sync.step() ")
        assert "ddp.register_comm_hook(sync, dgc.ddp_comm_hook)" in message


def _train(model, sync, opt, rank: int, steps: range) -> None:  # noqa: ANN001
    for step in steps:
        sync.set_epoch(step / 4)
        local_backward(model, rank, step)
        sync.step()
        opt.step()


def build() -> tuple:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05))
    return model, sync, dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)


def _other_ranks_state(rank: int, world: int) -> str | None:
    model, sync, opt = build()
    _train(model, sync, opt, rank, range(2))
    box = [sync.state_dict() if rank == 0 else None]  # rank 0's state only, as register_for_checkpointing saves
    dist.broadcast_object_list(box, src=0)
    try:
        sync.load_state_dict(box[0])
    except ValueError as exc:
        return str(exc)
    return None


def test_a_state_saved_by_another_rank_is_refused() -> None:
    own, other = run(_other_ranks_state, 2)
    assert own is None
    assert other == ("GradientSync.load_state_dict: state saved by rank 0 of 2 loaded on rank 1 of 2: save every "
                     "rank's sync.state_dict() and load each its own")  # fmt: skip


def _resume(rank: int, world: int) -> dict:
    model, sync, opt = build()
    _train(model, sync, opt, rank, range(3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sync.state_dict()))
    out = {}
    for with_sync in (False, True):
        model, sync, opt = build()
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        if with_sync:
            sync.load_state_dict(saved[2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, sync, opt, rank, range(3, 6))
        out[with_sync] = [str(w.message) for w in caught]
    return out


def test_a_resume_without_the_compression_state_says_so_once() -> None:
    for out in run(_resume, 2):
        assert out[True] == []
        assert out[False] == [
            "dgc.SGD: the optimizer's state was loaded (a resumed run), but the gradient sync's was not: its "
            "residuals and momenta start again from zero; save every rank's sync.state_dict() with the checkpoint "
            "and load it with sync.load_state_dict()"
        ]


def _no_set_epoch(rank: int, world: int) -> list[str]:
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05, warmup_epochs=1))
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            local_backward(model, rank, step)
            sync.step()
            opt.step()
    return [str(w.message) for w in caught]


def test_a_warm_up_never_driven_names_the_call() -> None:
    for messages in run(_no_set_epoch, 2):
        assert len(messages) == 1  # once, at the first step
        assert "GradientSync.set_epoch() was never called" in messages[0]
        assert "call sync.set_epoch(epoch + i / steps_per_epoch) every step" in messages[0]
