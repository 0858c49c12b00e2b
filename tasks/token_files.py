"""Token files: a corpus as flat arrays of uint16 token ids, the layout nanoGPT's ``prepare.py`` writes.

A folder holds ``train.bin`` and ``val.bin`` (little-endian uint16, no header: OpenWebText or FineWeb tokenized
with GPT-2's BPE, as nanoGPT prepares them), optionally ``test.bin``, and optionally ``meta.json``:
``{"vocab_size": V, "unit": "char" | "token", "itos": [...]}``. Without ``test.bin`` the validation file is
split in two halves: the first is the validation split, the second the test split (so the test split is
never the data settings were chosen on).

``kjv_char`` is such a folder built here from the King James Bible (Debian ``bible-kjv``): the verses'
text, references removed, one verse per line, split by chapter exactly like the word-level ``kjv`` corpus
(:func:`dgc.tasks.text_corpora.kjv_split_of`: about 90/5/5, whole chapters), characters as tokens
(vocabulary: the characters of the training split, sorted; the other splits hold no others). Built on
first use or by ``make data`` / ``python -m dgc.tasks.token_files --root data/kjv_char``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from dgc.tasks.base import DataError
from dgc.tasks.text_corpora import KJV_HINT, SPLITS, kjv_split_of, kjv_verses

from dgc import atomic

#: the split files of a token folder (``test.bin`` optional)
FILES = {"train": "train.bin", "valid": "val.bin", "test": "test.bin"}
TOKENS_HINT = ("a folder with train.bin and val.bin of uint16 token ids (nanoGPT's data/openwebtext/prepare.py "
               "writes them), given as data.root=<folder>")  # fmt: skip


@dataclass
class TokenFiles:
    """The splits of a token folder as read-only memory maps, and what its ``meta.json`` says."""

    root: Path
    splits: dict[str, np.ndarray]
    vocab_size: int | None
    unit: str
    #: how the test split was made: "test.bin" or "second half of val.bin"
    test_source: str

    def split(self, name: str) -> np.ndarray:
        return self.splits[name]


def open_tokens(root: str | os.PathLike) -> TokenFiles:
    """The token folder ``root`` (see the module docstring); :class:`DataError` with one line when it is not one."""
    root = Path(root).expanduser()
    for name in ("train", "valid"):
        if not (root / FILES[name]).is_file():
            raise DataError(f"{root / FILES[name]} not found: need {TOKENS_HINT}")
    vocab_size, unit = None, "token"
    meta_path = root / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            vocab_size = None if meta.get("vocab_size") is None else int(meta["vocab_size"])
            unit = str(meta.get("unit", "token"))
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise DataError(f"{meta_path} is not a JSON object with an integer vocab_size "
                            f"({exc.__class__.__name__}): rewrite it or remove it") from None  # fmt: skip
    splits = {}
    for name, file in FILES.items():
        path = root / file
        if not path.is_file():
            continue
        if path.stat().st_size % 2:
            raise DataError(f"{path} has an odd number of bytes: not a file of uint16 token ids")
        splits[name] = np.memmap(path, dtype="<u2", mode="r") if path.stat().st_size else np.zeros(0, "<u2")
    test_source = "test.bin"
    if "test" not in splits:
        val = splits["valid"]
        half = len(val) // 2
        splits["valid"], splits["test"] = val[:half], val[half:]
        test_source = "second half of val.bin"
    for name, tokens in splits.items():
        if len(tokens) < 2:
            raise DataError(f"{root}: the {name} split holds {len(tokens)} tokens, too few to predict one")
    return TokenFiles(root, splits, vocab_size, unit, test_source)


# -- the King James Bible by character ------------------------------------------------------------


def kjv_char_texts(verses: list[tuple[str, int, str]]) -> dict[str, str]:
    """The text of each split: its verses, one per line, in canonical order."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    chapter, last = -1, None
    for book, number, text in verses:
        if (book, number) != last:
            chapter, last = chapter + 1, (book, number)
        out[kjv_split_of(chapter)].append(text.strip() + "\n")
    return {s: "".join(lines) for s, lines in out.items()}


def build_kjv_char(root: str | os.PathLike, force: bool = False) -> Path:
    """Write ``<root>/{train,val,test}.bin`` and ``meta.json`` (see the module docstring) unless present; atomic,
    so several workers may build at once."""
    root = Path(root).expanduser()
    if not force and all((root / f).is_file() for f in (*FILES.values(), "meta.json")):
        return root
    texts = kjv_char_texts(kjv_verses())
    itos = sorted(set(texts["train"]))
    stoi = {c: i for i, c in enumerate(itos)}
    root.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, text in texts.items():
        unknown = sorted(set(text) - set(stoi))
        if unknown:  # the KJV's test and validation chapters use no character the training chapters lack
            raise DataError(f"the KJV {split} split has characters the training split lacks: {unknown!r}")
        ids = np.fromiter((stoi[c] for c in text), dtype="<u2", count=len(text))
        atomic.write_bytes(root / FILES[split], ids.tobytes())
        counts[split] = len(ids)
    meta = {
        "vocab_size": len(itos),
        "unit": "char",
        "itos": itos,
        "source": "bible -f 'Ge1:1-Re22:21' (Debian bible-kjv), verse text without references, one verse per line",
        "split": "chapter index c (0-based, canonical order): c % 20 == 18 -> valid, == 19 -> test, else train",
        "tokens": counts,
    }
    atomic.write_text(root / "meta.json", json.dumps(meta, indent=1) + "\n")
    return root


def load_tokens(name: str, root: str | os.PathLike) -> TokenFiles:
    """The token folder of ``data.name``: ``kjv_char`` (built when missing) or ``tokens`` (a user's folder)."""
    if name == "kjv_char":
        missing = not all((Path(root).expanduser() / f).is_file() for f in (*FILES.values(), "meta.json"))
        if missing:
            try:
                build_kjv_char(root)
            except DataError as exc:
                raise DataError(f"KJV character corpus {root} not found and cannot be built ({exc}); {KJV_HINT}"
                                ) from None  # fmt: skip
        return open_tokens(root)
    if name == "tokens":
        return open_tokens(root)
    raise ValueError(f"unknown token data {name!r}; valid: {', '.join(TOKEN_DATA)}")


TOKEN_DATA = ("kjv_char", "tokens")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="build the KJV character-level corpus (uint16 token files)")
    parser.add_argument("--root", default="data/kjv_char")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if all((root / f).is_file() for f in (*FILES.values(), "meta.json")) and not args.force:
        print(f"{root}: KJV character corpus present (use --force to rebuild)")
        return
    build_kjv_char(root, force=True)
    meta = json.loads((root / "meta.json").read_text())
    print(f"{root}: {meta['vocab_size']} characters, tokens {meta['tokens']}")


if __name__ == "__main__":
    main()
