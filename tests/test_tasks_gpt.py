"""Causal language modelling: the GPT model, token files, windows per worker, evaluation, AdamW in the trainer.

Runs use tiny token folders written by the tests (nanoGPT's layout: uint16 ``train.bin`` / ``val.bin``) and a GPT of
1 layer, 16 wide; one test builds the real KJV character corpus (Debian ``bible-kjv``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dgc.tasks.base import DataError
from dgc.tasks.causal_lm import CausalLM
from dgc.tasks.gpt import GPT
from dgc.tasks.token_files import build_kjv_char, open_tokens

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.repro.config import Config
from dgc.repro.trainer import ConfigError, Trainer, learning_rate
from tests.runs import cli, records
from tests.test_tasks_language import config, info

TINY_GPT = ["model.args.layers=1", "model.args.heads=2", "model.args.width=16", "model.args.block_size=8"]
TEXT = "in the beginning god created the heaven and the earth. and the earth was without form, and void.\n"


def write_tokens(root: Path, train: int = 4000, val: int = 600, test: int | None = 500, vocab: int = 11,
                 meta: bool = True) -> Path:  # fmt: skip
    """A token folder of a learnable sequence: id ``(3 * i) % vocab`` repeated with a little noise."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def stream(n: int) -> np.ndarray:
        ids = (np.arange(n) * 3) % vocab
        noise = rng.random(n) < 0.05
        ids[noise] = rng.integers(0, vocab, int(noise.sum()))
        return ids.astype("<u2")

    (root / "train.bin").write_bytes(stream(train).tobytes())
    (root / "val.bin").write_bytes(stream(val).tobytes())
    if test is not None:
        (root / "test.bin").write_bytes(stream(test).tobytes())
    if meta:
        (root / "meta.json").write_text(json.dumps({"vocab_size": vocab, "unit": "char"}))
    return root


def tiny(root: Path, *overrides: str) -> Config:
    return config("task=kjv_gpt", "data=tokens", f"data.root={root}", *TINY_GPT, "train.batch_size=4",
                  "train.eval_batch_size=8", "train.progress=false", *overrides)  # fmt: skip


# -- the model ---------------------------------------------------------------------------------------


def test_gpt_is_causal_and_ties_its_output_to_the_embedding():
    torch.manual_seed(0)
    model = GPT(vocab_size=13, block_size=8, layers=2, heads=2, width=16).eval()
    assert model.head.weight is model.tok.weight
    x = torch.randint(0, 13, (2, 8))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % 13  # change the future of position 4
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 8, 13)
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    with pytest.raises(ValueError, match="longer than model.args.block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt2_small_has_gpt2s_parameter_count():
    cfg = config("task=gpt2_124m")
    with torch.device("meta"):
        model = GPT(**cfg.model.args)
    total = sum(p.numel() for p in model.parameters())
    assert total == 124_439_808
    assert total - model.pos.weight.numel() == 123_653_376  # nanoGPT's count (position embeddings left out)
    # GPT-2's init: the projections into the residual stream at 0.02 / sqrt(2 * layers)
    small = GPT(vocab_size=50, block_size=8, layers=8, heads=2, width=64)
    assert small.blocks[0].proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert small.blocks[0].fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize(("args", "message"), [
    ({"width": 10, "heads": 4}, "model.args.width (10) must be a multiple of model.args.heads (4)"),
    ({"layers": 0}, "model.args.layers must be an integer >= 1, got 0"),
    ({"dropout": 1.0}, "model.args.dropout must be in [0, 1), got 1.0"),
])  # fmt: skip
def test_gpt_arguments_are_checked(args, message):
    with pytest.raises(ValueError) as err:
        GPT(vocab_size=5, **args)
    assert str(err.value) == message


# -- token files -------------------------------------------------------------------------------------


def test_token_folder_without_test_bin_splits_val_in_two(tmp_path):
    files = open_tokens(write_tokens(tmp_path / "t", val=601, test=None, meta=False))
    val = np.fromfile(tmp_path / "t" / "val.bin", dtype="<u2")
    assert files.test_source == "second half of val.bin" and files.vocab_size is None and files.unit == "token"
    assert np.array_equal(files.split("valid"), val[:300]) and np.array_equal(files.split("test"), val[300:])
    with_test = open_tokens(write_tokens(tmp_path / "u"))
    assert with_test.test_source == "test.bin" and len(with_test.split("valid")) == 600
    assert with_test.vocab_size == 11 and with_test.unit == "char"


@pytest.mark.parametrize(("damage", "message"), [
    (lambda r: (r / "val.bin").unlink(), "val.bin not found: need a folder with train.bin and val.bin"),
    (lambda r: (r / "train.bin").write_bytes(b"abc"), "train.bin has an odd number of bytes"),
    (lambda r: (r / "meta.json").write_text("[1, 2]"), "meta.json is not a JSON object with an integer vocab_size"),
    (lambda r: (r / "test.bin").write_bytes(b"ab"), "the test split holds 1 tokens"),
])  # fmt: skip
def test_bad_token_folders_are_one_line_errors(tmp_path, damage, message):
    root = write_tokens(tmp_path / "t")
    damage(root)
    with pytest.raises(DataError) as err:
        open_tokens(root)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian bible-kjv")
def test_kjv_char_corpus_is_the_verses_split_by_chapter(tmp_path):
    root = build_kjv_char(tmp_path / "kjv_char")
    meta = json.loads((root / "meta.json").read_text())
    files = open_tokens(root)
    itos = meta["itos"]
    assert meta["unit"] == "char" and files.vocab_size == len(itos) == 63
    start = "".join(itos[i] for i in files.split("train")[:55])
    assert start == "In the beginning God created the heaven and the earth.\n"
    sizes = {s: len(files.split(s)) for s in ("train", "valid", "test")}
    assert sizes == meta["tokens"] and sizes["train"] > 3_500_000 and 150_000 < sizes["test"] < 250_000


# -- the task ----------------------------------------------------------------------------------------


def test_windows_are_shared_out_and_resume_where_they_stopped(tmp_path):
    cfg = tiny(write_tokens(tmp_path / "t"))
    tasks = [CausalLM(cfg, info(r, 2)) for r in range(2)]
    for task in tasks:
        task.check()
    starts = [set(t.epoch_starts(0).tolist()) for t in tasks]
    assert not starts[0] & starts[1]  # each window read by one worker only
    assert len(starts[0]) == len(starts[1]) == ((4000 - 1) // 8 - 1) // 2
    assert {s % 8 for s in starts[0] | starts[1]} == {tasks[0].epoch_starts(0)[0].item() % 8}  # one offset
    batches = list(tasks[0].train_batches(0))
    assert len(batches) == tasks[0].batches_per_epoch() == len(starts[0]) // 4
    x, y = batches[0]
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    resumed = list(tasks[0].train_batches(0, start=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches[3:], resumed))
    assert not torch.equal(next(tasks[0].train_batches(1))[0], batches[0][0])  # another order next epoch


class Uniform(torch.nn.Module):
    """Equal logits for every token: a loss of exactly ln(vocab) per predicted token."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape, self.vocab)


@pytest.mark.parametrize("world", [1, 3])
def test_evaluation_predicts_every_token_once(tmp_path, world):
    cfg = tiny(write_tokens(tmp_path / "t", val=203, test=101))
    counts = {"valid": 0, "test": 0}
    for rank in range(world):
        task = CausalLM(cfg, info(rank, world))
        task.check()
        for split in counts:
            nll, n = task.split_nll(Uniform(11), split)
            assert nll == pytest.approx(n * math.log(11))
            counts[split] += n
    assert counts == {"valid": 202, "test": 100}


def test_kjv_gpt_trains_with_adamw_and_reports_bits_per_character(tmp_path):
    cfg = tiny(write_tokens(tmp_path / "t"), "train.max_steps=30", f"run_dir={tmp_path / 'run'}")
    assert cfg.optim.name == "adamw" and cfg.task.kind == "causal_lm"
    trainer = Trainer(cfg, info())
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    decayed, not_decayed = trainer.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    assert all(p.dim() <= 1 for p in not_decayed["params"])
    summary = trainer.fit()
    m = summary["metrics"]
    assert set(m) == {"loss", "ppl", "bpc", "val_loss", "val_ppl", "val_bpc"}
    assert m["bpc"] == pytest.approx(m["loss"] / math.log(2)) and m["ppl"] == pytest.approx(math.exp(m["loss"]))
    assert m["val_loss"] < math.log(11) - 0.3  # learned something of the sequence
    losses = [r["train_loss"] for r in records(tmp_path / "run", "train")]
    assert losses[-1] < losses[0]


def test_cosine_decays_to_the_final_ratio():
    cfg = config("task=kjv_gpt")
    assert cfg.optim.final_lr_ratio == 0.1
    epochs = cfg.train.epochs
    assert learning_rate(cfg, 1.0, epochs) == pytest.approx(0.1)
    assert learning_rate(cfg, 1.0, cfg.optim.warmup_epochs) == pytest.approx(1.0)
    middle = cfg.optim.warmup_epochs + (epochs - cfg.optim.warmup_epochs) / 2
    assert learning_rate(cfg, 1.0, middle) == pytest.approx(0.55)


def test_dgc_beside_adamw_one_line_for_what_cannot_combine(tmp_path):
    root = write_tokens(tmp_path / "t")
    with pytest.raises(ConfigError) as err:
        Trainer(tiny(root, "compression=dgc", f"run_dir={tmp_path / 'a'}"), info())
    assert str(err.value).startswith("compression=dgc keeps the optimizer's momentum (momentum correction), which "
                                     "optim.name=adamw cannot take: use optim.name=sgd")  # fmt: skip
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="sync.accumulate=updates scales each gradient by its SGD learning rate"):
        Trainer(tiny(root, "sync.accumulate=updates", f"run_dir={tmp_path / 'b'}"), info())
    with pytest.raises(ConfigError, match="optim.name must be one of sgd, adamw, got 'adam'"):
        Trainer(tiny(root, "optim.name=adam", f"run_dir={tmp_path / 'c'}"), info())
    # (b): sparse gradients with error feedback, AdamW on their average; (a): DGC as published, momentum SGD
    b = Trainer(tiny(root, "compression=dgc", "compression.momentum_correction=false",
                     "compression.momentum_masking=false", f"run_dir={tmp_path / 'd'}"), info())  # fmt: skip
    assert isinstance(b.optimizer, torch.optim.AdamW)
    a = Trainer(tiny(root, "compression=dgc", "optim=sgd_char", f"run_dir={tmp_path / 'e'}"), info())
    assert isinstance(a.optimizer, dgc.SGD) and a.sync.compressor.owns_momentum


def test_gpt2_124m_config_is_nanogpts_recipe(tmp_path):
    cfg = config("task=gpt2_124m")
    assert (cfg.train.batch_size, cfg.train.accumulate, cfg.model.args["block_size"]) == (12, 5, 1024)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay) == ("adamw", 6e-4, [0.9, 0.95], 0.1)
    assert cfg.train.bf16 and cfg.data.name == "tokens"
    root = write_tokens(tmp_path / "t", test=None, meta=False, vocab=300)
    small = ["task=gpt2_124m", "data.root=" + str(root), *TINY_GPT, "model.args.vocab_size=300", "train.batch_size=4",
             "train.accumulate=2", "train.progress=false"]  # fmt: skip
    with pytest.raises(ConfigError, match="train.bf16=true needs CUDA"):
        Trainer(config(*small, f"run_dir={tmp_path / 'a'}"), info())
    summary = Trainer(config(*small, "train.bf16=false", "train.max_steps=2", f"run_dir={tmp_path / 'b'}"),
                      info()).fit()  # fmt: skip
    assert set(summary["metrics"]) == {"loss", "ppl", "bpt", "val_loss", "val_ppl", "val_bpt"}


def test_kjv_gpt_two_ranks_dgc_feeding_adamw(tmp_path):
    root = write_tokens(tmp_path / "t")
    args = ["task=kjv_gpt", "data=tokens", f"data.root={root}", *TINY_GPT, "train.batch_size=4", "train.max_steps=6",
            "compression=dgc", "compression.momentum_correction=false", "compression.momentum_masking=false",
            "task.compression_warmup_epochs=0", "train.progress=false", "run_dir=run"]  # fmt: skip
    out = cli(args, tmp_path, nproc=2, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["wire_ratio"] > 50
    assert math.isfinite(summary["metrics"]["val_bpc"])


def test_lm_gpt2_table_runs_nanogpts_recipe_on_8_workers_for_every_arm():
    from dgc.repro.tables import get_table

    table = get_table("lm-gpt2")
    assert table.full_scale and {r.world_size for r in table.rows} == {8}
    runs = {r.key: config(*r.train_overrides()) for r in table.rows}
    assert all(run.task.name == "gpt2_124m" and run.train.bf16 for run in runs.values())
    assert runs["dgc-adamw"].optim.name == "adamw" and not runs["dgc-adamw"].compression.momentum_correction
    assert runs["diloco-h64"].optim.name == "adamw" and runs["diloco-h64"].local_steps.every == 64
    assert runs["demo"].optim.name == "sgd" and runs["demo"].optim.momentum == 0
