"""DGC_COLLECTIVES_AT_WORLD_1=1: a world of one runs every collective (what the GPU check uses to drive
NCCL's collective paths on one GPU), and trains exactly as the world of one that skips them."""

from __future__ import annotations

import os

import torch.distributed as dist
from dgc.tasks.tiny_data import write_fmnist
from torch.nn.parallel import DistributedDataParallel

import dgc
from dgc.distributed import COLLECTIVES_AT_WORLD_1
from tests.multiproc import run
from tests.runs import TINY, assert_same_training, cli
from tests.test_devices import train
from tests.test_sync_dist import make_model, params

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor", "broadcast")


def _paths(rank: int, world: int, switch: bool) -> dict:
    os.environ[COLLECTIVES_AT_WORLD_1] = "1" if switch else ""
    calls = {name: 0 for name in COLLECTIVES}

    def counting(name: str, collective):  # noqa: ANN001, ANN202
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return collective(*args, **kwargs)

        return counted

    for name in COLLECTIVES:
        setattr(dist, name, counting(name, getattr(dist, name)))
    out = {}
    for name, exchange in [("dgc", "flat"), ("dgc", "sparse_allreduce"), ("powersgd", "flat"), ("none", "flat"),
                           ("terngrad", "flat")]:  # fmt: skip
        model = make_model()
        kwargs = {"rank": 2} if name == "powersgd" else {"density": 0.05} if name == "dgc" else {}
        sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), exchange=exchange)
        train(model, sync, rank, 3)
        out[f"{name}-{exchange}"] = params(model)
    model = make_model()  # the DDP hook
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(sync, dgc.ddp_comm_hook)
    train(model, sync, rank, 4, net=ddp)
    out["ddp_hook"] = params(model)
    return {"params": out, "calls": calls}


def test_the_switch_runs_every_collective_and_changes_nothing() -> None:
    (off,), (on,) = run(_paths, 1, False), run(_paths, 1, True)
    assert sum(off["calls"].values()) <= 1  # DDP's own broadcast of the model at construction
    assert on["calls"]["all_reduce"] > 0 and on["calls"]["all_gather_into_tensor"] > 0
    assert on["calls"]["all_to_all_single"] > 0  # sparse_allreduce
    for key, values in off["params"].items():
        assert all(a.equal(b) for a, b in zip(values, on["params"][key], strict=True)), key


def test_the_trainer_with_the_switch_trains_like_without(tmp_path) -> None:
    fmnist = write_fmnist(tmp_path / "fmnist", n_train=48, n_test=16)
    common = [*TINY, f"data.root={fmnist}", "compression=dgc", "compression.density=0.05", "data.limit=48",
              "data.eval_limit=16", "train.checkpoint_every=2", "sync.ddp_hook=true"]  # fmt: skip
    dirs = {}
    for switch in ("", "1"):
        run_dir = dirs[switch] = tmp_path / f"run{switch or 0}"
        env = {COLLECTIVES_AT_WORLD_1: switch}
        out = cli([*common, "train.max_steps=4", f"run_dir={run_dir}"], tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        out = cli([*common, "train.max_steps=6", f"run_dir={run_dir}", "resume=true"], tmp_path, env=env)
        assert out.returncode == 0 and "at step 4" in out.stdout, out.stderr[-2000:]
    assert_same_training(dirs[""], dirs["1"])
