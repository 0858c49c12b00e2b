"""Word-level corpora for language modelling: Penn Treebank files and the King James Bible.

* ``ptb``: Mikolov's preprocessed Penn Treebank (``simple-examples/data``): ``<root>/ptb.train.txt``,
  ``ptb.valid.txt``, ``ptb.test.txt``; one sentence per line, words separated by spaces, ``<unk>`` for
  rare words. Not available offline: a missing file raises :class:`DataError` saying how to get it.
* ``kjv``: the King James Bible of Debian's ``bible-kjv`` (``bible -f 'Ge1:1-Re22:21'``, 31,102 verses),
  preprocessed like PTB and cached as ``<root>/kjv.{train,valid,test}.txt`` in the same format, built
  on first use or by ``make data`` / ``python -m dgc.tasks.text_corpora --root data/kjv``:

  - one verse per line (the reader appends ``<eos>``), the reference (``Ge1:1``) removed;
  - lower case; ``--`` and all punctuation removed; possessive ``'s`` split off as its own token like
    PTB (``brother's`` -> ``brother 's``), other apostrophes dropped; hyphens inside words kept
    (``god-ward``); numbers -> ``N`` like PTB (the KJV spells numbers out, so this never fires);
  - split by chapter, deterministic: the chapters are numbered 0..1188 in canonical order and chapter
    ``c`` goes to valid if ``c % 20 == 18``, to test if ``c % 20 == 19``, else to train
    (about 90/5/5: whole chapters, so evaluation streams are coherent text);
  - vocabulary: the 9,998 most frequent training words (ties by word) + ``<unk>`` (+ ``<eos>`` added by
    the reader = 10,000, PTB's size); every other word in every split becomes ``<unk>``.

Reading (:func:`load_corpus`): tokens are ``line.split() + ["<eos>"]`` per non-blank line; the
vocabulary is the training tokens in order of first appearance (PyTorch's word_language_model);
evaluation words outside it map to ``<unk>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from dgc.tasks.base import DataError

from dgc import atomic

SPLITS = ("train", "valid", "test")
EOS, UNK = "<eos>", "<unk>"
KJV_RANGE = "Ge1:1-Re22:21"
KJV_VOCAB = 10_000
PTB_HINT = "get Mikolov's PTB (simple-examples.tgz, folder simple-examples/data) and pass data.root=<that folder>"
KJV_HINT = "apt-get install bible-kjv bible-kjv-text (or `make install` as root), then `make data`"


@dataclass
class Corpus:
    itos: list[str]
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def split(self, name: str) -> torch.Tensor:
        return getattr(self, name)


def read_tokens(path: Path) -> list[str]:
    tokens: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words = line.split()
            if words:
                tokens += words + [EOS]
    return tokens


def read_corpus(root: str | os.PathLike, prefix: str, hint: str) -> Corpus:
    """``<root>/<prefix>.{train,valid,test}.txt`` as id tensors over the training vocabulary."""
    root = Path(root).expanduser()
    paths = {s: root / f"{prefix}.{s}.txt" for s in SPLITS}
    for p in paths.values():
        if not p.is_file():
            raise DataError(f"{p} not found: {hint}")
    tokens = {s: read_tokens(p) for s, p in paths.items()}
    stoi: dict[str, int] = {}
    for w in tokens["train"]:
        stoi.setdefault(w, len(stoi))
    unk = stoi.get(UNK)
    ids = {}
    for s in SPLITS:
        if unk is None:
            missing = next((w for w in tokens[s] if w not in stoi), None)
            if missing is not None:
                raise DataError(f"{paths[s]}: word {missing!r} is not in the training vocabulary and there is no {UNK}")
        ids[s] = torch.tensor([stoi.get(w, unk) for w in tokens[s]], dtype=torch.long)
        if len(ids[s]) < 2:
            raise DataError(f"{paths[s]} holds fewer than 2 tokens")
    return Corpus(list(stoi), ids["train"], ids["valid"], ids["test"])


# -- King James Bible ----------------------------------------------------------------------------

_REF = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*)$")


def kjv_verses() -> list[tuple[str, int, str]]:
    """``(book, chapter, text)`` of every verse, in canonical order, from the ``bible`` program."""
    try:
        out = subprocess.run(["bible", "-f", KJV_RANGE], capture_output=True, text=True, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise DataError(f"cannot run `bible -f {KJV_RANGE}` ({exc.__class__.__name__}): {KJV_HINT}") from None
    verses = []
    for line in out.stdout.splitlines():
        m = _REF.match(line.strip())
        if m:
            verses.append((m.group(1), int(m.group(2)), m.group(4)))
    if len(verses) < 30_000:
        raise DataError(f"`bible -f {KJV_RANGE}` printed {len(verses)} verses, expected 31,102: {KJV_HINT}")
    return verses


def ptb_normalize(text: str) -> list[str]:
    """PTB-style words of one verse (see the module docstring)."""
    text = text.lower().replace("--", " ")
    text = re.sub(r"(\w)'s\b", r"\1 's", text)
    text = re.sub(r"\d[\d,.]*", " N ", text)
    text = re.sub(r"[^a-z0-9N'\- ]+", " ", text)
    words = []
    for w in text.split():
        if w != "'s":
            w = w.replace("'", "").strip("-")
        if w:
            words.append(w)
    return words


def kjv_split_of(chapter_index: int) -> str:
    r = chapter_index % 20
    return "valid" if r == 18 else "test" if r == 19 else "train"


def kjv_splits(verses: list[tuple[str, int, str]], vocab: int = KJV_VOCAB) -> dict[str, list[list[str]]]:
    """Verses (as word lists, rare words -> ``<unk>``) of each split."""
    out: dict[str, list[list[str]]] = {s: [] for s in SPLITS}
    chapter, last = -1, None
    for book, number, text in verses:
        if (book, number) != last:
            chapter, last = chapter + 1, (book, number)
        words = ptb_normalize(text)
        if words:
            out[kjv_split_of(chapter)].append(words)
    counts = Counter(w for verse in out["train"] for w in verse)
    keep = {w for w, _ in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[: vocab - 2]}
    return {s: [[w if w in keep else UNK for w in verse] for verse in vs] for s, vs in out.items()}


def build_kjv(root: str | os.PathLike, force: bool = False) -> Path:
    """Write ``<root>/kjv.{train,valid,test}.txt`` (and ``kjv.json``) unless present; atomic, so
    several workers may build at once."""
    root = Path(root).expanduser()
    if not force and all((root / f"kjv.{s}.txt").is_file() for s in SPLITS):
        return root
    splits = kjv_splits(kjv_verses())
    root.mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        atomic.write_text(root / f"kjv.{s}.txt", "".join(" ".join(v) + "\n" for v in splits[s]))
    meta = {
        "source": f"bible -f '{KJV_RANGE}' (Debian bible-kjv, bible-kjv-text)",
        "split": "chapter index c (0-based, canonical order): c % 20 == 18 -> valid, == 19 -> test, else train",
        "vocab": KJV_VOCAB,
        "verses": {s: len(splits[s]) for s in SPLITS},
        "tokens_with_eos": {s: sum(len(v) + 1 for v in splits[s]) for s in SPLITS},
    }
    atomic.write_text(root / "kjv.json", json.dumps(meta, indent=1) + "\n")
    return root


def load_corpus(name: str, root: str | os.PathLike) -> Corpus:
    if name == "ptb":
        return read_corpus(root, "ptb", PTB_HINT)
    if name == "kjv":
        if shutil.which("bible") is None and not all((Path(root) / f"kjv.{s}.txt").is_file() for s in SPLITS):
            raise DataError(f"KJV cache {root}/kjv.*.txt not found and the `bible` program is missing: {KJV_HINT}")
        return read_corpus(build_kjv(root), "kjv", KJV_HINT)
    raise ValueError(f"unknown text data {name!r}; valid: {', '.join(TEXT_DATA)}")


TEXT_DATA = ("ptb", "kjv")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="build the KJV language-modelling corpus (PTB format)")
    parser.add_argument("--root", default="data/kjv")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    root = Path(args.root)
    present = all((root / f"kjv.{s}.txt").is_file() for s in SPLITS)
    if present and not args.force:
        print(f"{root}: KJV corpus present (use --force to rebuild)")
        return
    build_kjv(root, force=True)
    print(f"{root}: " + json.loads((root / "kjv.json").read_text())["tokens_with_eos"].__repr__() + " tokens")


if __name__ == "__main__":
    main()
