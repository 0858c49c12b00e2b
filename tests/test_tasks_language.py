"""Word language modelling: PTB files, KJV preprocessing, per-worker streams, carried state, perplexity.

Runs use tiny PTB-layout files written by the tests and a 1-layer LSTM of 16 units; the 2-rank run
uses the real KJV corpus (built once into a temporary folder) with ``data.limit``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dgc.tasks.language_modeling import LanguageModeling, batchify, perplexity
from dgc.tasks.rnn_models import lstm_lm
from dgc.tasks.text_corpora import build_kjv, kjv_splits, kjv_verses, ptb_normalize, read_tokens
from dgc.tasks.tiny_data import write_ptb
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.distributed import DistInfo, init_distributed
from dgc.repro.config import Config
from dgc.repro.trainer import ConfigError, Trainer
from tests.runs import records

CPU = torch.device("cpu")
TINY_MODEL = ["model.args.embed=16", "model.args.hidden=16", "model.args.layers=1"]
needs_bible = pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian bible-kjv")


def config(*overrides: str) -> Config:
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def info(rank: int = 0, world_size: int = 1) -> DistInfo:
    return DistInfo(rank, world_size, rank, CPU, None)


@pytest.fixture
def ptb(tmp_path) -> Path:
    return write_ptb(tmp_path / "ptb")


@pytest.fixture(scope="module")
def kjv_root(tmp_path_factory) -> Path:
    if shutil.which("bible") is None:
        pytest.skip("needs Debian bible-kjv")
    return build_kjv(tmp_path_factory.mktemp("data") / "kjv")


# -- configuration -----------------------------------------------------------------------------


def test_ptb_lstm_config_is_the_papers_setup():
    cfg = config("task=ptb_lstm", "compression=dgc")
    assert cfg.task.kind == "language" and cfg.model.name == "lstm_lm"
    assert cfg.model.args == {
        "embed": 1500,
        "hidden": 1500,
        "layers": 2,
        "dropout": 0.65,
        "tied": True,
        "init_range": 0.1,
    }
    assert cfg.data.args["bptt"] == 35 and cfg.train.batch_size == 20 and cfg.train.epochs == 40
    assert cfg.optim.momentum == 0 and cfg.optim.lr == 20 and cfg.optim.grad_clip == 0.25
    # DGC: 1 warm-up epoch of 40, local clipping at the dense clip
    assert cfg.compression.warmup_epochs == 1 and cfg.sync.clip_norm == 0.25
    assert config("task=ptb_lstm").sync.clip_norm is None
    # the CPU stand-in: the paper's PTB rules, 1 warm-up epoch (of 12), the same local clip as its dense clip
    kjv = config("task=kjv_lstm", "compression=dgc")
    assert kjv.compression.warmup_epochs == 1 and kjv.sync.clip_norm == kjv.optim.grad_clip == 0.25
    assert kjv.train.epochs == 12 and kjv.train.batch_size == 10 and kjv.optim.milestones == [8, 10]


def test_ptb_model_has_the_papers_gradient_size():
    with torch.device("meta"):
        model = lstm_lm(10_000)
    numel = sum(p.numel() for p in model.parameters())  # tied: the embedding counts once
    assert numel == 51_034_000
    assert round(numel * 4 / 2**20, 2) == 194.68  # MB in Table 4
    assert model.decoder.weight is model.encoder.weight


# -- PTB files, streams, carried state ---------------------------------------------------------


def test_ptb_reader_and_worker_streams(ptb):
    tokens = read_tokens(ptb / "ptb.train.txt")
    assert tokens[:7] == ["the", "cat", "sat", "on", "the", "mat", "<eos>"]
    cfg = config("task=ptb_lstm", f"data.root={ptb}", "train.batch_size=3", "data.args.bptt=4", *TINY_MODEL)
    tasks = [LanguageModeling(cfg, info(r, 2)) for r in range(2)]
    for t in tasks:
        t.check()
    stream = tasks[0].corpus.train
    half = len(stream) // 2
    for r, t in enumerate(tasks):
        mine = stream[r * half : (r + 1) * half]
        per = len(mine) // 3
        assert t.streams.shape == (per, 3)
        for j in range(3):  # column j is the j-th contiguous third of this worker's slice
            assert torch.equal(t.streams[:, j], mine[j * per : (j + 1) * per])
        batches = list(t.train_batches(0))
        assert len(batches) == t.batches_per_epoch() == (per - 1) // 4
        for i, (x, y) in enumerate(batches):
            assert x.shape == y.shape == (4, 3)
            assert torch.equal(x, t.streams[4 * i : 4 * i + 4]) and torch.equal(y, t.streams[4 * i + 1 : 4 * i + 5])
        assert torch.equal(list(t.train_batches(0, start=2))[0][0], batches[2][0])
    assert batchify(torch.arange(10), 3).tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


class Recorder(nn.Module):
    """Embedding + LSTM language model that records the hidden state it is given."""

    def __init__(self, vocab: int):
        super().__init__()
        self.lm = lstm_lm(vocab, embed=8, hidden=8, layers=1, dropout=0.0)
        self.seen: list = []

    def forward(self, x, hidden=None):
        self.seen.append(hidden)
        return self.lm(x, hidden)


def test_hidden_state_is_carried_detached_and_reset(ptb):
    cfg = config("task=ptb_lstm", f"data.root={ptb}", "train.batch_size=2", "data.args.bptt=5")
    task = LanguageModeling(cfg, info())
    task.check()
    model = Recorder(task.corpus.vocab_size)
    task.start_epoch(model, 0)
    batches = task.train_batches(0)
    task.loss(model, next(batches)).backward()
    task.loss(model, next(batches)).backward()
    assert model.seen[0] is None
    h, c = model.seen[1]
    assert h.shape == (1, 2, 8) and not h.requires_grad and h.abs().sum() > 0
    saved = task.state_dict()
    task.start_epoch(model, 1)
    task.loss(model, next(task.train_batches(1)))
    assert model.seen[2] is None  # a new epoch starts from zeros
    task.load_state_dict(saved)  # a resumed run continues from the checkpointed state
    task.loss(model, next(task.train_batches(0, start=2)))
    assert saved["hidden"] is not None and torch.equal(model.seen[3][0], saved["hidden"][0])


# -- perplexity ---------------------------------------------------------------------------------


class Constant(nn.Module):
    """Same logits for every position."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x, hidden=None):
        return self.logits.expand(*x.shape, -1), hidden


def test_perplexity_on_hand_examples(ptb):
    assert perplexity(0.0, 10) == 1.0
    assert perplexity(10 * math.log(4), 10) == pytest.approx(4.0)
    cfg = config("task=ptb_lstm", f"data.root={ptb}", "train.batch_size=2", "train.eval_batch_size=1")
    task = LanguageModeling(cfg, info())
    task.check()
    vocab = task.corpus.vocab_size
    # a uniform model has perplexity = vocabulary size
    out = task.evaluate(Constant(torch.zeros(vocab)))
    assert out["ppl"] == pytest.approx(vocab) and out["val_ppl"] == pytest.approx(vocab)
    assert out["loss"] == pytest.approx(math.log(vocab))
    # word 0 ("the") three times as likely as any other: p0 = 3 / (V + 2), others 1 / (V + 2)
    logits = torch.zeros(vocab)
    logits[0] = math.log(3)
    targets = task.corpus.test[1:]  # one stream: every token but the first is predicted
    n0, n = int((targets == 0).sum()), len(targets)
    assert n0 >= 1
    expected = math.exp(-(n0 * math.log(3 / (vocab + 2)) + (n - n0) * math.log(1 / (vocab + 2))) / n)
    assert task.evaluate(Constant(logits))["ppl"] == pytest.approx(expected, rel=1e-5)


# -- end to end ----------------------------------------------------------------------------------


def test_ptb_lstm_trains_two_steps(ptb, tmp_path):
    cfg = config(
        "task=ptb_lstm",
        f"data.root={ptb}",
        f"run_dir={tmp_path / 'run'}",
        "device=cpu",
        "train.batch_size=2",
        "data.args.bptt=6",
        "train.max_steps=2",
        "train.progress=false",
        *TINY_MODEL,
    )
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    assert summary["steps"] == 2 and summary["task"] == "ptb_lstm"
    m = summary["metrics"]
    assert math.isfinite(m["ppl"]) and 1 < m["ppl"] < 10 * 17  # vocabulary of 16 words + <eos>
    assert m["ppl"] == pytest.approx(math.exp(m["loss"]))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"]["ppl"] == m["ppl"]


def test_test_eval_end_reads_the_test_split_once(ptb, tmp_path):
    """train.test_eval=end: the evaluations after each epoch read the validation split only, the last one both,
    with the same numbers a run evaluating everything every epoch gets."""
    common = ["task=ptb_lstm", f"data.root={ptb}", "device=cpu", "train.batch_size=2", "data.args.bptt=6",
              "train.epochs=3", "train.progress=false", *TINY_MODEL]  # fmt: skip
    every = Trainer(config(*common, f"run_dir={tmp_path / 'every'}"), info()).fit()
    once = Trainer(config(*common, "train.test_eval=end", f"run_dir={tmp_path / 'once'}"), info()).fit()
    assert once["metrics"] == every["metrics"] and "ppl" in once["metrics"]
    evals = records(tmp_path / "once", "eval")
    assert len(evals) == 3 and all("ppl" not in e and "loss" not in e for e in evals[:-1])
    assert [e["val_ppl"] for e in evals] == [e["val_ppl"] for e in records(tmp_path / "every", "eval")]
    assert "ppl" in evals[-1]


def test_language_resume_continues_the_hidden_state_exactly(ptb, tmp_path):
    common = [
        "task=ptb_lstm",
        f"data.root={ptb}",
        "device=cpu",
        "train.batch_size=2",
        "data.args.bptt=5",
        "train.progress=false",
        "model.args.dropout=0.3",
        *TINY_MODEL,
    ]
    whole = Trainer(config(*common, "train.max_steps=4", f"run_dir={tmp_path / 'a'}"), info()).fit()
    Trainer(config(*common, "train.max_steps=2", f"run_dir={tmp_path / 'b'}"), info()).fit()
    resumed = Trainer(config(*common, "train.max_steps=4", f"run_dir={tmp_path / 'b'}", "resume=true"), info()).fit()
    assert resumed["metrics"] == whole["metrics"]
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert torch.equal(a["ranks"][0]["task"]["hidden"][0], b["ranks"][0]["task"]["hidden"][0])


def test_missing_ptb_is_a_one_line_error(tmp_path):
    cfg = config("task=ptb_lstm", f"data.root={tmp_path / 'nowhere'}", f"run_dir={tmp_path / 'run'}", *TINY_MODEL)
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, info())
    message = str(err.value)
    assert "ptb.train.txt not found" in message and "data.root" in message and "\n" not in message
    assert not (tmp_path / "run").exists()


# -- KJV ------------------------------------------------------------------------------------------


def test_ptb_style_normalization():
    assert ptb_normalize("In the beginning God created the heaven and the earth.") == (
        "in the beginning god created the heaven and the earth".split()
    )
    assert ptb_normalize("Am I my brother's keeper?") == ["am", "i", "my", "brother", "'s", "keeper"]
    assert ptb_normalize("blot me, I pray thee--; the brethren' God-ward 12,000 (men)") == (
        "blot me i pray thee the brethren god-ward N men".split()
    )


@needs_bible
def test_kjv_corpus_is_deterministic_and_ptb_like(kjv_root):
    files = {s: (kjv_root / f"kjv.{s}.txt").read_text() for s in ("train", "valid", "test")}
    again = kjv_splits(kjv_verses())  # built a second time, in memory
    for s, text in files.items():
        assert text == "".join(" ".join(v) + "\n" for v in again[s])
    assert read_tokens(kjv_root / "kjv.train.txt")[:11] == (
        "in the beginning god created the heaven and the earth <eos>".split()
    )
    words = set(" ".join(files.values()).split())
    assert len(words) == 9_999 and "<unk>" in words  # + <eos> = 10,000
    assert not any(c.isupper() or c.isdigit() or c in ".,;:?!" for w in words - {"<unk>"} for c in w)
    meta = json.loads((kjv_root / "kjv.json").read_text())
    assert meta["verses"]["train"] + meta["verses"]["valid"] + meta["verses"]["test"] == 31_102
    # chapter 18 (0-based: Genesis 19) is validation, chapter 19 (Genesis 20) test
    assert files["valid"].startswith("and there came two angels to sodom at even")
    assert files["test"].startswith("and abraham journeyed from thence toward the south country")
    assert 0.85 < meta["tokens_with_eos"]["train"] / sum(meta["tokens_with_eos"].values()) < 0.95


@needs_bible
def test_kjv_lstm_two_ranks_dgc_with_local_clipping(kjv_root, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dgc.train"]
    args = [
        "task=kjv_lstm",
        "compression=dgc",
        f"data.root={kjv_root}",
        "data.limit=3000",
        "data.eval_limit=400",
        "train.batch_size=4",
        "train.max_steps=3",
        "train.progress=false",
        "task.compression_warmup_epochs=0",
        f"run_dir={run_dir}",
        *TINY_MODEL,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["compression"] == "dgc" and summary["steps"] == 3
    assert math.isfinite(summary["metrics"]["ppl"]) and summary["metrics"]["ppl"] > 1
    assert summary["wire_ratio"] > 50  # density 0.001 after (no) warm-up
    resolved = (run_dir / "config.yaml").read_text()
    assert "clip_norm: 0.25" in resolved
