"""The frontier tables: DGC beside today's low-bandwidth methods on one setup, one budget, one byte count.

Every arm trains ``make demo``'s setup (ResNet-20 on Fashion-MNIST, 4 workers, 4 epochs: the same samples and
steps for every arm) on 55,000 training images; 5,000 more are held out as the validation split
(``data.validation``) on which the learning rates are chosen. Two tables:

* ``cpu-frontier-grid``: each arm at three learning rates, x0.5, x1 and x2 of its default (the outer learning rate
  for the local-step methods, whose inner optimizer is the task's; the sign step's for DeMo), seed 0, the test split
  never read (``train.test_eval=never``): the same grid effort for every method. One rule, the same for every arm:
  an arm whose best validation top-1 is at an end of the grid gets one more doubling past that end
  (:data:`EXTENDED`, written down from the first three rates), so that no arm is compared at a rate cut short by
  the grid;
* ``cpu-frontier``: each arm at the multiplier chosen on the grid's validation top-1 (:data:`CHOSEN`, written down
  from ``results/cpu-frontier-grid.md``), seeds 0 and 1, the test split read once, at the end.

DiLoCo runs at H = 16 and 64, and at H = 256, where its wire ratio (H: fp32 pseudo-gradients every H steps) is
closest to DGC's measured 266x (``make demo``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dgc.repro.rows import Row, seeded

#: the setup of every arm: make demo's length, the validation split held out of the training images
SETUP = ("train.epochs=4", "data.validation=5000")
#: DGC's own settings on this setup (make demo's: 1-epoch density warm-up, fp16 values)
_DGC = ("task.compression_warmup_epochs=1", "compression.wire_values=fp16")
#: the grid: multipliers of each arm's default learning rate
GRID = (0.5, 1.0, 2.0)
#: the arms whose best rate of :data:`GRID` was its end (seed 0, validation top-1 of results/cpu-frontier-grid.md,
#: first three rates): one more doubling past that end. Seven arms were best at x2; every DiLoCo arm was best inside
#: the grid (x1), so none is extended
EXTENDED: dict[str, float] = {
    key: 4.0 for key in ("none", "bf16", "powersgd", "dgc", "dgc-chunk", "demo", "sparseloco")
}
GROUP = "ResNet-20 Fashion-MNIST, 4 workers, 4 epochs, 55k training images"


@dataclass(frozen=True)
class Arm:
    key: str
    method: str
    compression: str
    #: the learning rate the grid multiplies (a config key) and its default
    lr_key: str
    lr: float
    overrides: tuple[str, ...] = ()


#: DeMo and SparseLoCo as this table ran them, before their presets followed the authors' code and paper (issue 53):
#: DeMo's tiles cut from the flat bucket and its mean over all workers; SparseLoCo's biases and BatchNorm sent dense
DEMO_AS_RUN = ("compression.mean=workers", "compression.tiles=flat")
SPARSELOCO_AS_RUN = ("sync.policy.min_ndim=2",)

#: the task's learning rate per worker (scaled by the 4 workers)
_TASK_LR = 0.025

ARMS: tuple[Arm, ...] = (
    Arm("none", "dense fp32 allreduce", "none", "optim.lr", _TASK_LR),
    Arm("bf16", "dense bf16 allreduce", "bf16", "optim.lr", _TASK_LR),
    Arm("powersgd", "PowerSGD, rank 4", "powersgd", "optim.lr", _TASK_LR),
    Arm("dgc", "DGC (the paper's settings)", "dgc", "optim.lr", _TASK_LR, _DGC),
    Arm("dgc-chunk", "DGC, chunk selection", "dgc_chunk", "optim.lr", _TASK_LR, _DGC),
    Arm("diloco-h16", "DiLoCo, H = 16", "diloco", "local_steps.outer_lr", 0.7, ("local_steps.every=16",)),
    Arm("diloco-h64", "DiLoCo, H = 64", "diloco", "local_steps.outer_lr", 0.7, ("local_steps.every=64",)),
    Arm("diloco-h256", "DiLoCo, H = 256 (DGC's bytes)", "diloco", "local_steps.outer_lr", 0.7,
        ("local_steps.every=256",)),
    # flat tiles and the mean over all workers, as when this table ran (the preset now cuts tiles from each tensor and
    # divides by the senders, as DeMo's code does)
    Arm("demo", "DeMo", "demo", "optim.lr", 0.001, DEMO_AS_RUN),
    # biases and BatchNorm dense, as when this table ran (the preset now compresses every tensor, as the paper does)
    Arm("sparseloco", "SparseLoCo, H = 16", "sparseloco", "local_steps.outer_lr", 1.0, SPARSELOCO_AS_RUN),
)  # fmt: skip

#: the multiplier of each arm's learning rate chosen on cpu-frontier-grid's validation top-1 (results/
#: cpu-frontier-grid.md, seed 0): the best of its grid. bf16, PowerSGD, DGC, DGC chunk and DeMo were best at the
#: extension x4 (the rule allows one doubling only: their best may lie higher still); SparseLoCo diverged at x4
CHOSEN: dict[str, float | None] = {
    "none": 2.0, "bf16": 4.0, "powersgd": 4.0, "dgc": 4.0, "dgc-chunk": 4.0, "diloco-h16": 1.0, "diloco-h64": 1.0,
    "diloco-h256": 1.0, "demo": 4.0, "sparseloco": 2.0,
}  # fmt: skip


def _lr(arm: Arm, multiplier: float) -> str:
    return f"{arm.lr_key}={arm.lr * multiplier!r}"


@dataclass(frozen=True)
class Setup:
    """One frontier: its task and workers, what every arm runs with, its arms, and the grid's outcome."""

    task: str
    world_size: int
    #: overrides of every run (the budget, the validation split)
    overrides: tuple[str, ...]
    #: the table's group label (the setup in words)
    group: str
    arms: tuple[Arm, ...]
    #: the arms whose best rate was an end of the grid: one more multiplier past that end
    extended: dict[str, float]
    #: the multiplier chosen per arm on the grid's validation metric (None: not chosen yet)
    chosen: dict[str, float | None]
    grid: tuple[float, ...] = GRID


#: make demo's setup (ResNet-20 on Fashion-MNIST)
FMNIST = Setup("fmnist_resnet20", 4, SETUP, GROUP, ARMS, EXTENDED, CHOSEN)


def grid_rows(setup: Setup = FMNIST) -> tuple[Row, ...]:
    """Every arm at every multiplier of its grid: each arm's x1 first (a sweep cut short has them all), then the
    others in increasing order."""
    group = f"{setup.group}: learning-rate grid, validation split"
    return tuple(
        Row(f"{arm.key}-x{m:g}", group, f"{arm.method}, lr x{m:g}", setup.task, arm.compression, setup.world_size,
            (*setup.overrides, *arm.overrides, _lr(arm, m), "train.test_eval=never"),
            baseline=arm.key == "none" and m == 1.0)
        for m in sorted({m for arm in setup.arms for m in grid_of(arm, setup)}, key=lambda m: (m != 1.0, m))
        for arm in setup.arms
        if m in grid_of(arm, setup)
    )  # fmt: skip


def grid_of(arm: Arm, setup: Setup = FMNIST) -> tuple[float, ...]:
    """The multipliers an arm runs at on the grid: the setup's grid, and its extension where it has one."""
    extra = setup.extended.get(arm.key)
    return tuple(sorted((*setup.grid, extra))) if extra is not None else setup.grid


def frontier_rows(setup: Setup = FMNIST, seeds: tuple[int, ...] = (0, 1)) -> tuple[Row, ...]:
    rows = []
    for arm in setup.arms:
        chosen = setup.chosen.get(arm.key)
        label = f"{arm.method}, lr x{chosen:g}" if chosen is not None else f"{arm.method}, lr x1 (not chosen yet)"
        rows.append(Row(arm.key, setup.group, label, setup.task, arm.compression, setup.world_size,
                        (*setup.overrides, *arm.overrides, _lr(arm, chosen or 1.0), "train.test_eval=end"),
                        baseline=arm.key == "none"))  # fmt: skip
    return seeded(tuple(rows), seeds)


__all__ = ["ARMS", "CHOSEN", "EXTENDED", "FMNIST", "GRID", "SETUP", "Arm", "Setup", "frontier_rows", "grid_of",
           "grid_rows"]  # fmt: skip
