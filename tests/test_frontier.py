"""The frontier tables (dgc.repro.frontier): every arm on one setup, the grid on the validation split only."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.repro import frontier
from dgc.repro.tables import get_table


def _configs(table: str) -> dict:
    with initialize_config_module("dgc.conf", version_base="1.3"):
        return {r.key: OmegaConf.to_object(compose("config", overrides=r.train_overrides()))
                for r in get_table(table).rows}  # fmt: skip


def test_the_grid_gives_every_arm_three_rates_and_never_reads_the_test_split():
    cfg = _configs("cpu-frontier-grid")
    assert len(cfg) == 3 * len(frontier.ARMS) + len(frontier.EXTENDED) == 37
    for arm in frontier.ARMS:
        rates = []
        grid = frontier.grid_of(arm)
        # the extension is one doubling past an end of the grid, nothing else
        assert set(grid) - set(frontier.GRID) <= {frontier.GRID[0] / 2, frontier.GRID[-1] * 2}
        assert len(grid) == 3 + (arm.key in frontier.EXTENDED)
        for m in grid:
            run = cfg[f"{arm.key}-x{m:g}"]
            assert run.train.epochs == 4 and run.data.validation == 5000 and run.train.test_eval == "never"
            assert run.train.batch_size == 32 and run.seed == 0
            rates.append(run.local_steps.outer_lr if arm.lr_key.startswith("local_steps") else run.optim.lr)
        assert rates == [arm.lr * m for m in grid], arm.key
    assert cfg["diloco-h256-x1"].local_steps.every == 256 and cfg["diloco-h16-x1"].local_steps.outer_nesterov
    assert cfg["sparseloco-x1"].local_steps.every == 16 and cfg["sparseloco-x1"].local_steps.outer_momentum == 0
    assert cfg["demo-x1"].optim.momentum == 0 and not cfg["demo-x1"].optim.scale_lr
    # DGC as make demo runs it; the other arms without its warm-up
    assert cfg["dgc-x1"].compression.warmup_epochs == 1 and cfg["dgc-x1"].compression.wire_values == "fp16"
    assert cfg["dgc-chunk-x1"].compression.selection == "chunk"


def test_the_table_runs_every_arm_with_two_seeds_and_reads_the_test_split_once():
    cfg = _configs("cpu-frontier")
    assert len(cfg) == 2 * len(frontier.ARMS)
    for key, run in cfg.items():
        assert run.train.test_eval == "end" and run.data.validation == 5000 and run.seed == int(key[-1])


def test_the_language_model_frontier_gives_diloco_at_dgcs_bytes_thirty_outer_steps():
    from dgc.repro import lm_frontier

    grid = _configs("cpu-lm-frontier-grid")
    assert len(grid) == 3 * len(lm_frontier.ARMS)
    keys = list(grid)
    assert keys[: len(lm_frontier.ARMS)] == [f"{arm.key}-x1" for arm in lm_frontier.ARMS]  # every arm's x1 first
    for key, run in grid.items():
        assert run.task.name == "kjv_gpt" and run.train.epochs == 3.2 and run.train.test_eval == "never", key
        assert run.seed == 0 and run.train.batch_size == 6
    # the two DGCs beside AdamW: as published (momentum SGD), and sparse with error feedback feeding AdamW
    a, b = grid["dgc-sgd-x1"], grid["dgc-adamw-x1"]
    assert a.optim.name == "sgd" and a.compression.momentum_correction and a.sync.clip_norm == 1.0
    assert b.optim.name == "adamw" and not b.compression.momentum_correction and not b.compression.momentum_masking
    assert grid["dgc-chunk-x1"].compression.selection == "chunk" and grid["dgc-chunk-x1"].optim.name == "adamw"
    assert grid["demo-x1"].optim.name == "sgd" and grid["sparseloco-x1"].optim.name == "adamw"
    matched = grid["diloco-h256-x1"]
    assert matched.compression.name == "bf16" and matched.local_steps.every == 256
    # 3.2 epochs of 4 workers x 6 windows: at least 30 outer steps at H = 256 (the floor)
    steps = (((3_731_727 - 1) // 64 - 1) // 4) // 6
    assert int(3.2 * steps) + 1 >= 30 * 256
    final = _configs("cpu-lm-frontier")
    assert len(final) == 2 * len(lm_frontier.ARMS)
    assert all(run.train.test_eval == "end" and run.seed == int(key[-1]) for key, run in final.items())


def test_sparseloco_compresses_every_tensor_and_demo_divides_by_the_senders():
    """Two decisions against the methods' own papers and code (issue 53, item 4): SparseLoCo compresses the whole
    pseudo-gradient, biases and normalisation weights included (the paper's); DeMo divides a coefficient's sum by the
    workers that sent it (the authors' code). The image frontier, run before, keeps what it ran with."""
    import torch

    import dgc

    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=["task=fmnist_resnet20", "compression=sparseloco"]))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    sync = dgc.GradientSync.from_config(cfg.sync, model, dgc.build_compressor(cfg.compression))
    assert all(sync.is_compressed(p) for p in model.parameters())
    assert dgc.build_compressor("demo").config.mean == "senders"
    image = _configs("cpu-frontier")
    assert image["sparseloco-s0"].sync.policy.min_ndim == 2 and image["demo-s0"].compression.mean == "workers"
    lm = _configs("cpu-lm-frontier")
    assert lm["sparseloco-s0"].sync.policy.min_ndim == 0 and lm["demo-s0"].compression.mean == "senders"
