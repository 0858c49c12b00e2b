"""Speech recognition: text encoding, greedy CTC decoding, WER/CER, AN4 and LibriSpeech layouts, DeepSpeech.

The audio is sine tones and noise written by the tests (0.3-0.6 s, 16 kHz); the models are one
recurrent layer of 16 units.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from dgc.tasks.rnn_models import deepspeech
from dgc.tasks.speech_data import (
    ALPHABET,
    LIBRIVOX_DIR,
    Features,
    an4_split,
    cer,
    collate,
    encode,
    error_counts,
    greedy_decode,
    librispeech_split,
    librivox_clips,
    normalize_text,
    read_audio,
    read_sphinx_transcription,
    wer,
)
from dgc.tasks.speech_data import edit_distance as ed
from dgc.tasks.tiny_data import SR, TEXTS, tone, write_an4, write_librispeech
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.distributed import init_distributed
from dgc.repro.config import Config
from dgc.repro.tables import SPEECH_CHOSEN, get_table
from dgc.repro.trainer import ConfigError, Trainer

TINY_MODEL = ["model.args.hidden=16", "model.args.layers=1", "model.args.conv_channels=4"]
RUN = ["device=cpu", "train.batch_size=2", "train.eval_batch_size=4", "train.max_steps=2", "train.progress=false"]


def config(*overrides: str) -> Config:
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


# -- text, decoding, error rates -------------------------------------------------------------------


def test_text_encoding():
    assert len(ALPHABET) == 29 and ALPHABET[0] == "_"
    assert normalize_text("  Don't STOP-now!  42 ") == "don't stop now"
    assert encode("ab c'") == [2, 3, 28, 4, 1]


def test_edit_distance_hand_examples():
    assert ed("kitten", "sitting") == 3
    assert ed("", "abc") == ed("abc", "") == 3
    assert ed("flaw", "lawn") == 2
    assert ed("the cat sat".split(), "the cat sat".split()) == 0
    assert ed("the cat sat on the mat".split(), "the bat sat on mat".split()) == 2  # 1 sub + 1 del


def test_wer_cer_hand_examples():
    refs = ["the cat sat", "a b c d"]
    hyps = ["the cat sat", "a x c"]  # 0 errors; 1 substitution + 1 deletion
    assert wer(refs, hyps) == pytest.approx(100 * 2 / 7)
    assert wer(["hello world"], ["hello big world"]) == 50.0  # one insertion over 2 words
    assert wer(["a"], ["b c d"]) == 300.0  # WER can exceed 100%
    assert cer(["abcd"], ["abd"]) == 25.0
    assert cer(["ab cd"], ["abcd"]) == 20.0  # the space counts as a character
    assert error_counts(["go now"], ["no"]) == (2, 2, 4, 6)


def test_greedy_ctc_decoding():
    # frames: _ a a _ a b b ' ' ' ' c _  ->  "aab c" (repeats merged, blanks split them)
    ids = [0, 2, 2, 0, 2, 3, 3, 28, 28, 4, 0, 4]
    lp = torch.full((len(ids), 2, 29), -10.0)
    for t, k in enumerate(ids):
        lp[t, 0, k] = 0.0
        lp[t, 1, 0 if t % 2 else 5] = 0.0
    assert greedy_decode(lp, torch.tensor([len(ids), 5])) == ["aab cc", "ddd"]
    assert greedy_decode(lp, torch.tensor([10, 1])) == ["aab c", "d"]  # lengths cut the frames


# -- features, files, model ------------------------------------------------------------------------


def test_audio_files_and_features(tmp_path):
    rng = np.random.default_rng(0)
    x = tone(rng, 3)
    sf.write(tmp_path / "a.wav", x, SR, subtype="FLOAT")
    sf.write(tmp_path / "b.flac", x, 8000, subtype="PCM_16")  # wrong rate: resampled to 16 kHz
    pcm = (x * 32767).astype(">i2")
    (tmp_path / "c.raw").write_bytes(pcm.tobytes())
    assert np.array_equal(read_audio(tmp_path / "a.wav"), x)
    assert len(read_audio(tmp_path / "b.flac")) == 2 * len(x)
    assert np.allclose(read_audio(tmp_path / "c.raw"), x, atol=1e-4)
    spec = Features()(x)
    assert spec.shape == (161, len(x) // 160 + 1)
    assert abs(float(spec.mean())) < 1e-4 and float(spec.std()) == pytest.approx(1.0, abs=1e-3)
    assert Features(kind="mel", n_mels=40)(x).shape[0] == 40
    x_b, lengths, targets, target_lengths, texts = collate(
        [(spec, torch.tensor([2, 3]), "ab"), (spec[:, :5], torch.tensor([4]), "c")]
    )
    assert x_b.shape == (2, 161, spec.shape[1]) and lengths.tolist() == [spec.shape[1], 5]
    assert targets.tolist() == [2, 3, 4] and target_lengths.tolist() == [2, 1] and texts == ["ab", "c"]
    assert torch.equal(x_b[1, :, :5], spec[:, :5]) and not x_b[1, :, 5:].any()


def test_deepspeech_shapes_and_paper_sizes():
    model = deepspeech(40, 29, "gru", hidden=16, layers=2, conv_channels=4)
    x = torch.randn(3, 40, 25)
    lengths = torch.tensor([25, 20, 9])
    x[1, :, 20:] = 0
    x[2, :, 9:] = 0  # zero padding, as collate() writes it
    log_probs, out = model(x, lengths)
    assert out.tolist() == [13, 10, 5] and log_probs.shape == (13, 3, 29)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(13, 3))
    # padding does not change a shorter utterance's output (masked convolutions, packed RNN), in eval mode
    model.eval()
    alone, _ = model(x[2:, :, :9], lengths[2:])
    together, _ = model(x, lengths)
    assert torch.allclose(alone[:5, 0], together[:5, 2], atol=1e-5)
    with torch.device("meta"):
        gru = deepspeech(161, 29, "gru", hidden=1200, layers=7)
        lstm = deepspeech(161, 29, "lstm", hidden=800, layers=5)
    assert sum(p.numel() for p in gru.parameters()) * 4 / 1e6 == pytest.approx(488.08, rel=0.002)  # Table 4
    assert sum(p.numel() for p in lstm.parameters()) == 54_823_168


def test_layouts(tmp_path):
    libri = write_librispeech(tmp_path / "LibriSpeech", {"dev-clean": 4})
    items = librispeech_split(tmp_path, "dev-clean")  # the folder above LibriSpeech/ works too
    assert [Path(u.path).name for u in items][:2] == ["19-198-0000.flac", "19-198-0001.flac"]
    assert items[0].text == TEXTS[19 % len(TEXTS)] and items[0].seconds > 0.29
    assert librispeech_split(libri, "dev-clean") == items
    an4 = write_an4(tmp_path / "an4")
    test = an4_split(an4, "test")
    assert len(test) == 4 and test[1].text == "no way" and test[0].path.endswith("an4test_clstk/fash/an300-fash-b.raw")
    assert read_sphinx_transcription(an4 / "etc" / "an4_test.transcription")["an301-fash-b"] == "NO WAY"


# -- end to end ------------------------------------------------------------------------------------


def test_librispeech_deepspeech_trains_two_steps(tmp_path):
    root = write_librispeech(tmp_path / "libri", {"train-clean-100": 8, "test-clean": 4, "test-other": 4})
    cfg = config(
        "task=librispeech_deepspeech",
        f"data.root={root}",
        "data.args.train_splits=[train-clean-100]",
        "data.loader_workers=0",
        f"run_dir={tmp_path / 'run'}",
        *RUN,
        *TINY_MODEL,
    )
    assert cfg.model.args["rnn_type"] == "gru" and cfg.optim.nesterov and cfg.compression.name == "none"
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    m = summary["metrics"]
    assert summary["steps"] == 2 and set(m) == {"loss", "wer", "cer", "test_other_wer", "test_other_cer"}
    assert math.isfinite(m["loss"]) and m["loss"] > 0 and 0 <= m["cer"] and m["wer"] >= 0


def test_an4_deepspeech_trains_two_steps_with_dgc(tmp_path):
    root = write_an4(tmp_path / "an4")
    cfg = config(
        "task=an4_deepspeech", "compression=dgc", f"data.root={root}", f"run_dir={tmp_path / 'run'}", *RUN, *TINY_MODEL
    )
    assert cfg.model.args["rnn_type"] == "lstm" and cfg.model.args["hidden"] == 16
    assert cfg.compression.warmup_epochs == 1 and cfg.sync.clip_norm == 400
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    assert summary["steps"] == 2 and summary["compression"] == "dgc"
    assert math.isfinite(summary["metrics"]["loss"]) and "wer" in summary["metrics"]


def test_synth_deepspeech_dgc_settings():
    # the CPU stand-in's DGC follows the paper's rules: a 1-epoch warm-up, local clipping at its dense clip of 400;
    # it accumulates updates (the setting chosen on dev), which the table's rows name explicitly either way
    cfg = config("task=synth_deepspeech", "compression=dgc")
    assert cfg.compression.warmup_epochs == 1 and cfg.sync.clip_norm == 400 and cfg.optim.grad_clip == 400
    assert cfg.sync.accumulate == "updates"
    rows = {r.key: r for r in get_table("cpu-speech").rows}
    assert "sync.accumulate=gradients" in rows["dgc-w1-c400-s0"].overrides
    assert "sync.accumulate=updates" in rows[f"{SPEECH_CHOSEN}-s1"].overrides
    # every row, the density-0.01 diagnostic included, runs with seeds 0 and 1; dense and the chosen DGC with 2 too
    seeds = {}
    for k in rows:
        base, seed = k.rsplit("-s", 1)
        seeds.setdefault(base, set()).add(seed)
    five = {"0", "1", "2", "3", "4"}
    assert seeds == {"none": five, SPEECH_CHOSEN: five, "dgc-w1-c400": {"0", "1"}, f"{SPEECH_CHOSEN}-d01": {"0", "1"}}
    assert rows["none-s2"].seed == 2 and rows[f"{SPEECH_CHOSEN}-s2"].overrides == rows[f"{SPEECH_CHOSEN}-s0"].overrides
    assert "compression.density=0.01" in rows[f"{SPEECH_CHOSEN}-d01-s1"].overrides


def test_losses_fall_on_a_tiny_corpus(tmp_path):
    root = write_librispeech(tmp_path / "libri", {"train": 8, "test": 2})
    cfg = config(
        "task=synth_deepspeech",
        f"data.root={root}",
        "data.args.eval_splits=[test]",
        "data.args.librivox=false",
        f"run_dir={tmp_path / 'run'}",
        "train.log_every=1",
        *RUN[:-2],
        "train.max_steps=16",
        "train.progress=false",
        *TINY_MODEL,
    )
    Trainer(cfg, init_distributed("cpu")).fit()
    losses = [
        r["train_loss"]
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert len(losses) == 16 and sum(losses[-4:]) < 0.8 * sum(losses[:4])


def test_test_eval_end_scores_only_the_dev_split_until_the_end(tmp_path):
    root = write_librispeech(tmp_path / "synth", {"train": 4, "dev": 2, "test": 2})
    run = [*RUN[:-2], "train.epochs=2", "train.progress=false", f"run_dir={tmp_path / 'run'}"]
    cfg = config("task=synth_deepspeech", f"data.root={root}", "data.args.librivox=false", "train.test_eval=end",
                 *run, *TINY_MODEL)  # fmt: skip
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]  # fmt: skip
    metrics = {k for k in evals[0] if k not in ("kind", "step", "epoch", "wire_ratio")}
    assert len(evals) == 2 and metrics == {"dev_wer", "dev_cer"}
    assert {"wer", "cer", "dev_wer"} <= set(evals[1]) and summary["metrics"]["wer"] == evals[1]["wer"]


@pytest.mark.skipif(not (LIBRIVOX_DIR / "fileids").is_file(), reason="needs pocketsphinx-testdata")
def test_synth_deepspeech_also_scores_the_librivox_clips(tmp_path):
    clips = librivox_clips()
    assert len(clips) == 5 and clips[1].text == "he was not an ill disposed young man"
    root = write_librispeech(tmp_path / "synth", {"train": 4, "dev": 2, "test": 2})
    cfg = config("task=synth_deepspeech", f"data.root={root}", f"run_dir={tmp_path / 'run'}", *RUN, *TINY_MODEL)
    assert cfg.data.args["features"] == {"kind": "mel", "n_mels": 40}
    summary = Trainer(cfg, init_distributed("cpu")).fit()
    m = summary["metrics"]
    assert {"wer", "cer", "dev_wer", "librivox_wer", "librivox_cer"} <= set(m)
    assert m["librivox_wer"] >= 90  # two steps of training: nothing recognized yet


def test_missing_speech_data_is_a_one_line_error(tmp_path):
    for task, hint in (("an4_deepspeech", "an4"), ("librispeech_deepspeech", "openslr.org/12")):
        cfg = config(f"task={task}", f"data.root={tmp_path / 'nowhere'}", f"run_dir={tmp_path / task}", *TINY_MODEL)
        with pytest.raises(ConfigError) as err:
            Trainer(cfg, init_distributed("cpu"))
        assert hint in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / task).exists()


@pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("bible") is None, reason="needs espeak-ng")
def test_synth_corpus_builder(tmp_path):
    from dgc.tasks.synth_speech import build

    sizes = {"train": 3, "dev": 1, "test": 1}
    a = build(tmp_path / "a", sizes, seed=3, jobs=2)
    train = librispeech_split(a, "train")
    assert len(train) == 3 and all(u.text and 0.3 < u.seconds < 8 for u in train)
    test_texts = {u.text for u in librispeech_split(a, "test")}
    assert not test_texts & {u.text for u in train}
    meta = json.loads((a / "corpus.json").read_text())
    assert meta["settings"]["sizes"] == sizes
    mtime = (a / "corpus.json").stat().st_mtime_ns
    assert build(tmp_path / "a", sizes, seed=3) == a and (a / "corpus.json").stat().st_mtime_ns == mtime  # cached
    b = build(tmp_path / "b", sizes, seed=3, jobs=1)  # reproducible
    for u, v in zip(train, librispeech_split(b, "train")):
        assert u.text == v.text and np.array_equal(read_audio(u.path), read_audio(v.path))
