"""Build the offline speech corpus: short KJV sentences spoken by espeak-ng, in the LibriSpeech layout.

    python -m dgc.tasks.synth_speech --root data/synth_speech      # or: make data

Reproducible (seeded) and cached: when ``<root>/corpus.json`` exists with the same settings nothing
is done. The corpus is written to a temporary folder next to ``root`` and renamed at the end.

* **Sentences**: clauses of KJV verses (:func:`dgc.tasks.text_corpora.kjv_verses`) cut at punctuation,
  normalized to lower-case letters, apostrophes and spaces, 3 to 10 words and at most 60 characters,
  deduplicated. Train sentences come from the KJV training chapters, dev and test sentences from the
  validation and test chapters of :mod:`dgc.tasks.text_corpora` (the same chapter split as ``kjv_lstm``);
  dev/test sentences that also occur in the training pool are dropped, so the test texts are unseen.
* **Voices**: 8 espeak-ng English accents (en-us, en-gb, Scottish, RP, Lancaster, West Midlands,
  Caribbean, New York) x 16 variants (default, m1-m7, f1-f5, klatt, klatt2, klatt3) = 128 "speakers";
  per utterance a random speaker, speed 130-190 words per minute and pitch 25-75.
* **Audio**: espeak-ng's 22.05 kHz output resampled to 16 kHz, scaled by a random gain (0.3-0.9),
  white noise added at a random SNR of 15-40 dB, written as 16-bit FLAC.
* **Layout**: ``<root>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac`` and
  ``<speaker>-<chapter>.trans.txt`` (upper-case transcripts), splits ``train``, ``dev``, ``test``;
  the speaker id is 1000 + the voice index, the chapter is 0 (train), 1 (dev), 2 (test). The
  LibriSpeech loader of :mod:`dgc.tasks.speech_data` reads it.

Defaults: 2000 train, 200 dev, 200 test utterances (about 2.1 s each: 1.2 h of training speech,
115 MB of FLAC, the noise does not compress), built in about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio
from dgc.tasks.base import DataError
from dgc.tasks.speech_data import SAMPLE_RATE, normalize_text
from dgc.tasks.text_corpora import kjv_split_of, kjv_verses

from dgc import atomic

VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc"]
VARIANTS = ["", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "klatt2", "klatt3"]
SPLITS = {"train": 0, "dev": 1, "test": 2}
ESPEAK_HINT = "apt-get install espeak-ng bible-kjv bible-kjv-text (or `make install` as root)"


def kjv_sentences(min_words: int = 3, max_words: int = 10, max_chars: int = 60) -> dict[str, list[str]]:
    """Candidate sentences per split (train / dev / test pools, sorted, unique; dev/test unseen in train)."""
    pools: dict[str, set[str]] = {s: set() for s in SPLITS}
    lm_to_speech = {"train": "train", "valid": "dev", "test": "test"}
    chapter, last = -1, None
    for book, number, text in kjv_verses():
        if (book, number) != last:
            chapter, last = chapter + 1, (book, number)
        split = lm_to_speech[kjv_split_of(chapter)]
        for clause in re.split(r"[,;:.?!()]|--", text):
            words = normalize_text(clause).split()
            sentence = " ".join(words)
            if min_words <= len(words) <= max_words and len(sentence) <= max_chars:
                pools[split].add(sentence)
    pools["dev"] -= pools["train"]
    pools["test"] -= pools["train"] | pools["dev"]
    return {s: sorted(p) for s, p in pools.items()}


def plan(sizes: dict[str, int], seed: int) -> list[dict]:
    """Every utterance to synthesize: split, index, text, voice, speed, pitch, gain, snr (deterministic)."""
    rng = random.Random(seed)
    pools = kjv_sentences()
    out = []
    for split, n in sizes.items():
        pool = list(pools[split])
        if len(pool) < n:
            raise ValueError(f"only {len(pool)} distinct {split} sentences, asked for {n}")
        rng.shuffle(pool)
        for i, text in enumerate(pool[:n]):
            speaker = rng.randrange(len(VOICES) * len(VARIANTS))
            out.append(
                {
                    "split": split,
                    "index": i,
                    "text": text,
                    "speaker": speaker,
                    "speed": rng.randint(130, 190),
                    "pitch": rng.randint(25, 75),
                    "gain": rng.uniform(0.3, 0.9),
                    "snr_db": rng.uniform(15.0, 40.0),
                    "noise_seed": rng.randrange(2**31),
                }
            )
    return out


def synthesize(u: dict) -> np.ndarray:
    voice = VOICES[u["speaker"] // len(VARIANTS)]
    variant = VARIANTS[u["speaker"] % len(VARIANTS)]
    cmd = ["espeak-ng", "-v", voice + (f"+{variant}" if variant else ""), "-s", str(u["speed"]), "-p", str(u["pitch"])]
    wav = subprocess.run([*cmd, "--stdout", u["text"]], capture_output=True, check=True, timeout=60).stdout
    data, sr = sf.read(io.BytesIO(wav), dtype="float32")
    x = torchaudio.functional.resample(torch.from_numpy(data), sr, SAMPLE_RATE).numpy()
    x = x / max(float(np.abs(x).max()), 1e-6) * u["gain"]
    rng = np.random.default_rng(u["noise_seed"])
    power = float(np.mean(x**2)) + 1e-12
    x = x + rng.standard_normal(len(x)).astype(np.float32) * np.sqrt(power / 10 ** (u["snr_db"] / 10))
    return np.clip(x, -1.0, 1.0)


def build(root: str | os.PathLike, sizes: dict[str, int], seed: int = 0, jobs: int | None = None) -> Path:
    root = Path(root)
    settings = {"sizes": sizes, "seed": seed, "voices": VOICES, "variants": VARIANTS, "version": 1}
    marker = root / "corpus.json"
    if marker.is_file():
        if json.loads(marker.read_text()).get("settings") == settings:
            print(f"{root}: corpus present (same settings), nothing to do")
            return root
        raise DataError(f"{root} holds a corpus built with other settings: remove it or pass another --root")
    if root.exists():
        raise DataError(f"{root} exists but holds no finished corpus (no corpus.json): remove it")
    if shutil.which("espeak-ng") is None:
        raise DataError(f"espeak-ng not found: {ESPEAK_HINT}")
    utterances = plan(sizes, seed)
    with atomic.directory(root) as tmp:
        hours = _write_corpus(tmp, utterances, sizes, settings, jobs)
    print(f"{root}: {sizes} utterances, hours {hours}")
    return root


def _write_corpus(tmp: Path, utterances: list[dict], sizes: dict[str, int], settings: dict, jobs: int | None) -> dict:
    def folder(u: dict) -> tuple[Path, str]:
        spk, chap = 1000 + u["speaker"], SPLITS[u["split"]]
        return tmp / u["split"] / str(spk) / str(chap), f"{spk}-{chap}"

    def work(u: dict) -> float:
        x = synthesize(u)
        path, prefix = folder(u)
        path.mkdir(parents=True, exist_ok=True)
        sf.write(path / f"{prefix}-{u['index']:04d}.flac", x, SAMPLE_RATE, subtype="PCM_16")
        return len(x) / SAMPLE_RATE

    torch.set_num_threads(1)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        seconds = list(pool.map(work, utterances))
    transcripts: dict[Path, list[str]] = {}
    for u in utterances:
        path, prefix = folder(u)
        transcripts.setdefault(path / f"{prefix}.trans.txt", []).append(
            f"{prefix}-{u['index']:04d} {u['text'].upper()}"
        )
    for path, lines in transcripts.items():
        path.write_text("\n".join(sorted(lines)) + "\n")
    hours = {s: round(sum(t for u, t in zip(utterances, seconds) if u["split"] == s) / 3600, 3) for s in sizes}
    (tmp / "corpus.json").write_text(json.dumps({"settings": settings, "hours": hours}, indent=1) + "\n")
    return hours


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="build the espeak-ng KJV speech corpus (LibriSpeech layout)")
    parser.add_argument("--root", default="data/synth_speech")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--dev", type=int, default=200)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=None, help="parallel espeak-ng processes (default: CPUs)")
    args = parser.parse_args(argv)
    try:
        build(args.root, {"train": args.train, "dev": args.dev, "test": args.test}, args.seed, args.jobs)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
