"""Speech data on a user's disk: LibriSpeech and AN4 layouts, features, CTC text encoding, WER/CER.

Layouts (nothing is downloaded; a missing directory raises :class:`DataError` saying where the data is
expected and how to get it):

* **LibriSpeech** (openslr.org/12): ``<root>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac``
  with one ``<speaker>-<chapter>.trans.txt`` per chapter (lines ``<utt-id> TRANSCRIPT``). ``root`` may also
  be the folder above ``LibriSpeech/``. The offline espeak-ng corpus (:mod:`dgc.tasks.synth_speech`) is
  written in this layout (splits ``train``, ``dev``, ``test``).
* **AN4** (CMU, www.speech.cs.cmu.edu/databases/an4/), the sphinx layout of ``an4_raw.bigendian.tar.gz``
  / ``an4_sphere.tar.gz``: ``<root>/etc/an4_{train,test}.fileids`` (paths such as
  ``an4_clstk/fash/an251-fash-b``), ``<root>/etc/an4_{train,test}.transcription`` (lines
  ``<s> YES </s> (an251-fash-b)``) and the audio at ``<root>/wav/<fileid>`` + ``.raw`` (headerless
  16-bit big-endian 16 kHz mono), ``.sph`` (NIST SPHERE), ``.wav`` or ``.flac``.
* **LibriVox clips** of pocketsphinx-testdata: the same sphinx ``fileids``/``transcription`` files with
  ``<id>.wav`` next to them (five real read-speech recordings, used as an extra test).

Audio is decoded with ``soundfile`` (``torchaudio.load`` needs FFmpeg/torchcodec) and resampled to
16 kHz with ``torchaudio.functional.resample`` when needed.

Features (``deepspeech.pytorch``'s): magnitude STFT with a 20 ms Hamming window and a 10 ms hop
(161 bins at 16 kHz), ``log1p``, normalized per utterance to zero mean and unit variance; or the
same on a mel filter bank (``kind: mel``, ``n_mels`` bins), which is cheaper for small CPU models.

Text: lower-case letters, apostrophe and space; CTC class 0 is the blank (29 classes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dgc.extras import require

require("speech", "the speech tasks")

import numpy as np
import soundfile as sf
import torch
import torchaudio
from dgc.tasks.base import DataError
from torch.utils.data import Dataset

SAMPLE_RATE = 16_000
#: CTC classes: blank, apostrophe, a-z, space
ALPHABET = "_'abcdefghijklmnopqrstuvwxyz "
BLANK = 0
_INDEX = {c: i for i, c in enumerate(ALPHABET)}

LIBRIVOX_DIR = Path("/usr/share/pocketsphinx/test/data/librivox")
LIBRISPEECH_HINT = (
    "download LibriSpeech from openslr.org/12 and extract it so that <root>/<split>/<speaker>/<chapter>/ exists"
)
SYNTH_HINT = "build the offline espeak-ng corpus with `make data` (or python -m dgc.tasks.synth_speech --root <root>)"


def librispeech_hint(root: str | os.PathLike) -> str:
    """How to get the data a LibriSpeech-layout root should hold (the offline corpus is built, not downloaded)."""
    return SYNTH_HINT if Path(root).name == "synth_speech" else LIBRISPEECH_HINT


AN4_HINT = (
    "download an4_raw.bigendian.tar.gz (or an4_sphere.tar.gz) from www.speech.cs.cmu.edu/databases/an4/, "
    "extract it and pass data.root=<dir>/an4 (holding etc/ and wav/)"
)


# -- text --------------------------------------------------------------------------------------


def normalize_text(text: str) -> str:
    """Lower case; keep letters, apostrophes and single spaces (hyphens become spaces)."""
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z' ]+", "", text)
    return " ".join(text.split())


def encode(text: str) -> list[int]:
    """CTC targets of a normalized transcript (characters outside the alphabet are dropped)."""
    return [_INDEX[c] for c in normalize_text(text)]


def decode_ids(ids: list[int]) -> str:
    return "".join(ALPHABET[i] for i in ids)


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Best path: argmax per frame, merge repeats, drop blanks. ``log_probs`` is ``(T, B, C)``."""
    best = log_probs.argmax(-1).t().cpu().tolist()  # (B, T)
    out = []
    for row, n in zip(best, lengths.cpu().tolist()):
        ids, prev = [], None
        for k in row[:n]:
            if k != prev and k != BLANK:
                ids.append(k)
            prev = k
        out.append(" ".join(decode_ids(ids).split()))
    return out


def edit_distance(ref, hyp) -> int:
    """Levenshtein distance between two sequences (substitutions, insertions, deletions cost 1)."""
    return int(torchaudio.functional.edit_distance(ref, hyp))


def error_counts(refs: list[str], hyps: list[str]) -> tuple[int, int, int, int]:
    """(word errors, reference words, character errors, reference characters), summed over utterances.

    Characters include the spaces between words (CER over the normalized transcript).
    """
    we = wn = ce = cn = 0
    for ref, hyp in zip(refs, hyps):
        rw, hw = ref.split(), hyp.split()
        we += edit_distance(rw, hw)
        wn += len(rw)
        ce += edit_distance(ref, hyp)
        cn += len(ref)
    return we, wn, ce, cn


def wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus word error rate in percent: total word edits / total reference words."""
    we, wn, _, _ = error_counts(refs, hyps)
    return 100.0 * we / max(wn, 1)


def cer(refs: list[str], hyps: list[str]) -> float:
    """Corpus character error rate in percent."""
    _, _, ce, cn = error_counts(refs, hyps)
    return 100.0 * ce / max(cn, 1)


# -- audio files -------------------------------------------------------------------------------


def read_audio(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at ``sample_rate``; ``.raw`` is AN4's headerless 16-bit big-endian 16 kHz."""
    path = str(path)
    if path.endswith(".raw"):
        data, sr = sf.read(
            path, format="RAW", samplerate=16_000, channels=1, subtype="PCM_16", endian="BIG", dtype="float32"
        )
    else:
        data, sr = sf.read(path, dtype="float32", always_2d=False)
    if data.ndim > 1:
        data = data.mean(axis=1)
    if sr != sample_rate:
        data = torchaudio.functional.resample(torch.from_numpy(np.ascontiguousarray(data)), sr, sample_rate).numpy()
    return np.ascontiguousarray(data, dtype=np.float32)


def audio_seconds(path: str | os.PathLike) -> float:
    path = str(path)
    if path.endswith(".raw"):
        return os.path.getsize(path) / 2 / 16_000
    info = sf.info(path)
    return info.frames / info.samplerate


@dataclass(frozen=True)
class Utterance:
    path: str
    text: str  # normalized transcript
    seconds: float


def _utterance(path: Path, text: str) -> Utterance:
    return Utterance(str(path), normalize_text(text), audio_seconds(path))


def librispeech_split(root: str | os.PathLike, split: str) -> list[Utterance]:
    """Utterances of one LibriSpeech split, sorted by id."""
    root = Path(root).expanduser()
    base = root / split
    if not base.is_dir() and (root / "LibriSpeech" / split).is_dir():
        base = root / "LibriSpeech" / split
    if not base.is_dir():
        raise DataError(f"LibriSpeech split {split!r} not found under {root}: {librispeech_hint(root)}")
    items = []
    for trans in sorted(base.glob("*/*/*.trans.txt")):
        for line in trans.read_text().splitlines():
            if not line.strip():
                continue
            uid, _, text = line.strip().partition(" ")
            for ext in (".flac", ".wav"):
                audio = trans.parent / (uid + ext)
                if audio.is_file():
                    items.append(_utterance(audio, text))
                    break
            else:
                raise DataError(f"{trans}: no audio {uid}.flac or {uid}.wav next to it")
    if not items:
        raise DataError(f"LibriSpeech split {base} holds no <speaker>/<chapter>/*.trans.txt: {librispeech_hint(root)}")
    return items


def read_sphinx_transcription(path: Path) -> dict[str, str]:
    """``<s> TEXT </s> (utt-id)`` lines -> {utt-id: text}."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(.*)\(([^()]+)\)\s*$", line.strip())
        if not m:
            continue
        words = [w for w in m.group(1).split() if w.lower() not in ("<s>", "</s>", "<sil>")]
        out[m.group(2).strip()] = " ".join(words)
    return out


def _sphinx_items(fileids: Path, transcription: Path, audio_root: Path, hint: str) -> list[Utterance]:
    for f in (fileids, transcription):
        if not f.is_file():
            raise DataError(f"{f} not found: {hint}")
    texts = read_sphinx_transcription(transcription)
    items = []
    for fid in fileids.read_text().split():
        uid = fid.rsplit("/", 1)[-1]
        if uid not in texts:
            raise DataError(f"{transcription} has no transcript for {uid}")
        for ext in (".wav", ".flac", ".sph", ".raw"):
            audio = audio_root / (fid + ext)
            if audio.is_file():
                items.append(_utterance(audio, texts[uid]))
                break
        else:
            raise DataError(f"no audio for {fid} under {audio_root} (.wav, .flac, .sph or .raw): {hint}")
    return items


def an4_split(root: str | os.PathLike, split: str) -> list[Utterance]:
    if split not in ("train", "test"):
        raise DataError(f"AN4 splits are train and test, got {split!r}")
    root = Path(root).expanduser()
    if not (root / "etc").is_dir() and (root / "an4" / "etc").is_dir():
        root = root / "an4"
    etc = root / "etc"
    return _sphinx_items(etc / f"an4_{split}.fileids", etc / f"an4_{split}.transcription", root / "wav", AN4_HINT)


def librivox_clips(folder: str | os.PathLike = LIBRIVOX_DIR) -> list[Utterance]:
    folder = Path(folder)
    hint = "apt-get install pocketsphinx-testdata (or `make install` as root)"
    return _sphinx_items(folder / "fileids", folder / "transcription", folder, hint)


#: data.name -> function(root, split) listing the utterances of a split
SPEECH_DATA = {"librispeech": librispeech_split, "an4": an4_split}


# -- features ----------------------------------------------------------------------------------


class Features:
    """Log magnitude spectrogram (or mel spectrogram), normalized per utterance: ``(n_feats, frames)``."""

    def __init__(self, kind: str = "spectrogram", window_s: float = 0.02, hop_s: float = 0.01, n_mels: int = 40):
        if kind not in ("spectrogram", "mel"):
            raise ValueError(f"features kind must be spectrogram or mel, got {kind!r}")
        n_fft = int(round(SAMPLE_RATE * window_s))
        hop = int(round(SAMPLE_RATE * hop_s))
        if n_fft < 2 or hop < 1:
            raise ValueError("features window_s and hop_s are too small")
        if kind == "spectrogram":
            self.transform = torchaudio.transforms.Spectrogram(
                n_fft=n_fft, hop_length=hop, window_fn=torch.hamming_window, power=1
            )
            self.n_feats = n_fft // 2 + 1
        else:
            self.transform = torchaudio.transforms.MelSpectrogram(
                sample_rate=SAMPLE_RATE,
                n_fft=n_fft,
                hop_length=hop,
                n_mels=n_mels,
                window_fn=torch.hamming_window,
                power=1,
            )
            self.n_feats = n_mels

    def __call__(self, samples: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            x = torch.log1p(self.transform(torch.from_numpy(samples)))
            return (x - x.mean()) / (x.std() + 1e-5)


class SpeechDataset(Dataset):
    """(features, target ids, transcript) per utterance; ``cache`` keeps computed features in memory."""

    def __init__(self, items: list[Utterance], features: Features, cache: bool = False):
        self.items, self.features, self.cache = items, features, cache
        self._cached: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        feats = self._cached.get(i)
        if feats is None:
            feats = self.features(read_audio(self.items[i].path))
            if self.cache:
                self._cached[i] = feats
        text = self.items[i].text
        return feats, torch.tensor(encode(text), dtype=torch.long), text


def collate(batch):
    """Pad features to the longest: ``(B, F, T)``, lengths, concatenated targets, target lengths, texts."""
    feats, targets, texts = zip(*batch)
    lengths = torch.tensor([f.shape[1] for f in feats], dtype=torch.long)
    x = torch.zeros(len(feats), feats[0].shape[0], int(lengths.max()))
    for k, f in enumerate(feats):
        x[k, :, : f.shape[1]] = f
    target_lengths = torch.tensor([len(t) for t in targets], dtype=torch.long)
    return x, lengths, torch.cat(targets), target_lengths, list(texts)
