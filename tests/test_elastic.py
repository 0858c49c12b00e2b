"""Resuming on another number of workers (dgc.elastic): the mean over workers of every residual and momentum kept,
shared state copied, per-rank state made again; a real 4 -> 2 -> 4 run through the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dgc.tasks.tiny_data import write_fmnist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc import elastic
from dgc.distributed import init_distributed
from dgc.repro.trainer import ConfigError, Trainer
from tests.runs import TINY, cli, load


def fake_states(world: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(4, generator=gen)
    return [
        {
            "compressor": {
                "name": "dgc",
                "epoch": 1.5,
                "tensors": {
                    "w": {"u": torch.randn(6, generator=gen), "v": torch.randn(6, generator=gen)},
                    "b": {"q": shared.clone()},
                },
                "extra": {"thresholds": {"w": [0.1]}, "generator": torch.tensor([rank]), "other": 3},
            },
            "steps": 7,
            "world_size": world,
            "rank": rank,
            "format": 1,
        }
        for rank in range(world)
    ]


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (3, 2), (2, 3), (1, 3), (4, 1), (3, 3)])
def test_remap_keeps_the_mean_over_workers_of_every_buffer(old, new):
    states = fake_states(old)
    mapped = elastic.remap(states, new)
    assert [(s["rank"], s["world_size"], s["steps"]) for s in mapped] == [(j, new, 7) for j in range(new)]
    before, after = elastic.mean_over_ranks(states), elastic.mean_over_ranks(mapped)
    for name in before:
        for key in before[name]:
            torch.testing.assert_close(after[name][key], before[name][key], rtol=0, atol=1e-6)
    for s in mapped:  # shared state copied; the per-rank extras made again, the others kept
        assert torch.equal(s["compressor"]["tensors"]["b"]["q"], states[0]["compressor"]["tensors"]["b"]["q"])
        assert s["compressor"]["extra"] == {"other": 3} and s["compressor"]["epoch"] == 1.5
    assert sum(f for takes in elastic.weights(old, new) for _, f in takes) == pytest.approx(new)


def test_fewer_workers_take_the_mean_of_their_group_and_more_workers_copy():
    states = fake_states(4)
    u = [s["compressor"]["tensors"]["w"]["u"] for s in states]
    two = elastic.remap(states, 2)
    torch.testing.assert_close(two[0]["compressor"]["tensors"]["w"]["u"], (u[0] + u[2]) / 2)
    torch.testing.assert_close(two[1]["compressor"]["tensors"]["w"]["u"], (u[1] + u[3]) / 2)
    back = elastic.remap(two, 4)
    for j in range(4):
        assert torch.equal(back[j]["compressor"]["tensors"]["w"]["u"], two[j % 2]["compressor"]["tensors"]["w"]["u"])
    with pytest.raises(ValueError, match="one state per rank of one run, in rank order"):
        elastic.remap([states[1], states[0]], 2)


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return write_fmnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=64, n_test=16)


def test_a_run_of_four_workers_continues_on_two_and_back_on_four(fmnist, tmp_path):
    """4 workers (4 steps per epoch) killed after step 3, resumed on 2 (8 steps per epoch) from the checkpoint of step
    2 = step 4 of 2 workers, killed again after step 7, resumed on 4 from step 6 = step 3 of 4, to the end; every
    remap keeps the mean residual and momentum per parameter of the checkpoint it starts from."""
    run_dir = tmp_path / "r"
    args = [*TINY, f"data.root={fmnist}", "compression=dgc", "compression.density=0.05", "train.epochs=2"]
    args += ["train.checkpoint_every=2", "train.log_every=1", f"run_dir={run_dir}"]
    elsewhere = ["resume=true", "resume_allow=[world_size]"]
    out = cli(args, tmp_path, nproc=4, env={"DGC_FAULTS": "kill@3"})
    assert out.returncode != 0 and load(run_dir)["counters"]["step"] == 2
    out = cli([*args, "resume=true"], tmp_path, nproc=2)
    assert out.returncode == 2 and "resume_allow=[world_size]" in out.stderr
    for new, kill, step, now in ((2, "kill@7", 6, "step 4 of 2"), (4, "", None, "step 3 of 4")):
        saved = load(run_dir)
        states = [r["compression"] for r in saved["ranks"]]
        before = elastic.mean_over_ranks(states)
        after = elastic.mean_over_ranks(elastic.remap(states, new))
        for name in before:
            for key in before[name]:
                torch.testing.assert_close(after[name][key], before[name][key], rtol=1e-6, atol=1e-7)
        assert any(before[n]["v"].abs().sum() > 0 for n in before)  # residuals to keep
        out = cli([*args, *elsewhere], tmp_path, nproc=new, env={"DGC_FAULTS": kill} if kill else None)
        assert f"resuming on {new} workers a checkpoint of {len(states)}" in out.stdout and now in out.stdout
        if kill:
            assert out.returncode != 0 and load(run_dir)["counters"]["step"] == step
        else:
            assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 8 and summary["metrics"]["top1"] >= 0


def test_what_cannot_move_to_another_number_of_workers_is_refused(fmnist, tmp_path):
    def trainer(*extra: str) -> Trainer:
        with initialize_config_module("dgc.conf", version_base="1.3"):
            cfg = OmegaConf.to_object(compose("config", overrides=[*TINY, f"data.root={fmnist}",
                                                                   f"run_dir={tmp_path / 'r'}", *extra]))  # fmt: skip
        return Trainer(cfg, init_distributed("cpu"))

    state = {"world_size": 2, "ranks": [{"task": {}}, {"task": {}}]}
    with pytest.raises(ConfigError, match="local steps resumes on the same number of workers only"):
        trainer("compression=diloco")._restore_elsewhere(state)
    state = {"world_size": 2, "ranks": [{"task": {"position": 3}}, {"task": {"position": 5}}]}
    with pytest.raises(ConfigError, match="keeps its data position per worker"):
        trainer()._restore_elsewhere(state)
