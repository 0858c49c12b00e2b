"""The language-model frontier: DGC beside DiLoCo, DeMo and SparseLoCo on a GPT, at equal tokens.

Every arm trains ``kjv_gpt`` (nanoGPT's CPU character model on the King James Bible, AdamW) on 4 workers for 3.2
epochs: 7,773 steps of 24 windows of 64 characters (11.9M characters) for every arm. The budget is set by DiLoCo at
DGC's bytes: DGC at density 0.001 with fp32 values and int32 indices sends about 1/590 of the dense gradient
(measured: 588x); DiLoCo with bf16 pseudo-gradients every H = 256 steps sends 1/512 of it (1.15x DGC's bytes), and
7,773 steps give it 30 outer steps (and one more, forced, at the run's end). Settings are chosen on the validation
split (``val.bin``: chapters apart from the training and test chapters); the test split is read once.

Arms (the task's optimizer, AdamW, unless named):

* dense fp32 and bf16 allreduce, PowerSGD (rank 4), AdamW on the average;
* DGC (a), as published: momentum SGD with momentum correction, momentum masking, local clipping and warm-up;
* DGC (b): DGC's sparsification with error feedback (no momentum correction or masking, local clipping and warm-up
  kept), AdamW on the averaged sparse gradient: what ports of DGC to adaptive optimizers do;
* DGC (b) with chunk selection (a fixed-size message, no threshold);
* DiLoCo at H = 16 and 64 (fp32 pseudo-gradients) and at H = 256 with bf16 pseudo-gradients (DGC's bytes); inner
  AdamW, outer Nesterov SGD;
* DeMo (its sign step through SGD, whatever the task's optimizer), SparseLoCo at H = 16 (inner AdamW).

Two tables, as for the image frontier (:mod:`dgc.repro.frontier`): ``cpu-lm-frontier-grid`` runs each arm at x0.5,
x1 and x2 of its default rate (the outer rate for the local-step arms, whose inner AdamW keeps the task's 1e-3),
seed 0, validation only; ``cpu-lm-frontier`` runs each arm at the multiplier chosen on the grid's validation loss
(:data:`CHOSEN`, written down from ``results/cpu-lm-frontier-grid.md``), seeds 0 and 1, the test split read once.
DGC (a)'s default rate, 0.25, is the middle of a probe on the validation split (momentum SGD at 0.1 and 0.5 were
alike after 300 steps; 2.0 diverged).
"""

from __future__ import annotations

from dgc.repro.frontier import Arm, Setup

#: every arm's budget: 3.2 epochs of kjv_gpt on 4 workers (7,773 steps)
SETUP = ("train.epochs=3.2",)
GROUP = "GPT (4 layers, 128 wide) on KJV characters, 4 workers, 7,773 steps of 1,536 characters"
_ADAMW_LR = 1e-3
#: DGC (b): the sparsification with error feedback, no momentum correction or masking (AdamW keeps the momentum)
_SPARSE_EF = ("compression.momentum_correction=false", "compression.momentum_masking=false")

ARMS: tuple[Arm, ...] = (
    Arm("none", "dense fp32 allreduce, AdamW", "none", "optim.lr", _ADAMW_LR),
    Arm("bf16", "dense bf16 allreduce, AdamW", "bf16", "optim.lr", _ADAMW_LR),
    Arm("powersgd", "PowerSGD rank 4, AdamW", "powersgd", "optim.lr", _ADAMW_LR),
    Arm("dgc-sgd", "DGC (a) as published, momentum SGD", "dgc", "optim.lr", 0.25, ("optim=sgd_char",)),
    Arm("dgc-adamw", "DGC (b) sparse + error feedback, AdamW", "dgc", "optim.lr", _ADAMW_LR, _SPARSE_EF),
    Arm("dgc-chunk", "DGC (b), chunk selection, AdamW", "dgc_chunk", "optim.lr", _ADAMW_LR, _SPARSE_EF),
    Arm("diloco-h16", "DiLoCo, H = 16", "diloco", "local_steps.outer_lr", 0.7, ("local_steps.every=16",)),
    Arm("diloco-h64", "DiLoCo, H = 64", "diloco", "local_steps.outer_lr", 0.7, ("local_steps.every=64",)),
    Arm("diloco-h256", "DiLoCo, H = 256, bf16 (DGC's bytes)", "diloco_bf16", "local_steps.outer_lr", 0.7,
        ("local_steps.every=256",)),
    Arm("demo", "DeMo", "demo", "optim.lr", 0.001),
    Arm("sparseloco", "SparseLoCo, H = 16", "sparseloco", "local_steps.outer_lr", 1.0),
)  # fmt: skip

#: the arms whose best grid rate was an end of it: one more doubling past that end (none yet: the grid has not run)
EXTENDED: dict[str, float] = {}
#: the multiplier chosen per arm on cpu-lm-frontier-grid's validation loss (None: not chosen yet)
CHOSEN: dict[str, float | None] = {arm.key: None for arm in ARMS}

KJV_GPT = Setup("kjv_gpt", 4, SETUP, GROUP, ARMS, EXTENDED, CHOSEN)

__all__ = ["ARMS", "CHOSEN", "EXTENDED", "KJV_GPT", "SETUP"]
