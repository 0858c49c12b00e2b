"""Tiny data sets on disk, in the layout each task's loader reads: what ``make gpu-check`` and the tests train on
when no real data is at hand (a few dozen examples each; labels learnable, nothing else meaningful).

* :func:`write_fmnist`: Fashion-MNIST IDX files (gzip), the layout of Debian's dataset-fashion-mnist;
* :func:`write_cifar10`: CIFAR-10 python batches in ``<root>/cifar-10-batches-py/``;
* :func:`write_imagefolder`: an ImageNet-style ``train/<class>/*.png`` and ``val/<class>/*.png`` tree;
* :func:`write_ptb`: the PTB text files (``ptb.{train,valid,test}.txt``);
* :func:`write_librispeech`, :func:`write_an4`: utterances of tones with their transcripts, in LibriSpeech's and
  AN4's (Sphinx) layouts.

The image pixels are random, but each class has its own mean brightness.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    """An unsigned-byte IDX file: 0x0000, type 0x08, the number of dimensions, big-endian sizes, the data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    return header + array.tobytes()


def _images(rng: np.random.Generator, labels: np.ndarray, shape: tuple[int, ...], classes: int) -> np.ndarray:
    base = (labels.astype(np.float64) + 0.5) * (200.0 / classes)
    noise = rng.integers(0, 56, size=(len(labels), *shape))
    return (base.reshape(-1, *([1] * len(shape))) + noise).clip(0, 255).astype(np.uint8)


def write_fmnist(root: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = _images(rng, labels, (28, 28), 10)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    return root


def write_cifar10(root: Path, per_batch: int = 16, n_test: int = 32, seed: int = 0) -> Path:
    """Five training batches of ``per_batch`` images each and a test batch (channels-first rows of 3072 bytes)."""
    root = Path(root)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        labels = rng.integers(0, 10, size=n)
        data = _images(rng, labels, (3 * 32 * 32,), 10)
        batch = {"batch_label": name, "labels": labels.tolist(), "data": data, "filenames": []}
        with open(base / name, "wb") as f:
            pickle.dump(batch, f)
    meta = {"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": per_batch}
    with open(base / "batches.meta", "wb") as f:
        pickle.dump(meta, f)
    return root


def write_imagefolder(
    root: Path, classes: int = 3, per_class_train: int = 8, per_class_val: int = 4, size: int = 40, seed: int = 0
) -> Path:
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, per in (("train", per_class_train), ("val", per_class_val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            labels = np.full(per, c)
            images = _images(rng, labels, (size, size, 3), classes)
            for i, img in enumerate(images):
                Image.fromarray(img, mode="RGB").save(folder / f"img{i}.png")
    return root


SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the dog sat on the cat",
    "we like the park",
    "a cat ran on the mat",
]


def write_ptb(root: Path, repeat: int = 8) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    train = [s for _ in range(repeat) for s in SENTENCES]
    (root / "ptb.train.txt").write_text("".join(f" {s} \n" for s in train))
    (root / "ptb.valid.txt").write_text(" the cat ran in the park \n we like the mat \n")
    (root / "ptb.test.txt").write_text(" a dog sat on the mat \n the cat ran \n")
    return root


#: the speech writers' sample rate and transcripts
SR = 16_000
TEXTS = ["yes", "no way", "go left now", "stop", "it's here", "one two three", "red and blue", "up"]


def tone(rng: np.random.Generator, k: int) -> np.ndarray:
    n = int(SR * (0.3 + 0.05 * (k % 6)))
    t = np.arange(n) / SR
    x = 0.3 * np.sin(2 * np.pi * (200 + 90 * k) * t) + 0.02 * rng.standard_normal(n)
    return x.astype(np.float32)


def write_librispeech(root: Path, splits: dict[str, int], ext: str = "flac", seed: int = 0) -> Path:
    """``<root>/<split>/<speaker>/<chapter>/<spk>-<chap>-<utt>.<ext>`` + ``<spk>-<chap>.trans.txt``."""
    import soundfile as sf  # the speech extra

    rng = np.random.default_rng(seed)
    for s, (split, n) in enumerate(splits.items()):
        for spk in (19 + s, 26 + s):
            folder = root / split / str(spk) / "198"
            folder.mkdir(parents=True, exist_ok=True)
            lines = []
            for u in range(n // 2):
                k = (spk + u) % len(TEXTS)
                uid = f"{spk}-198-{u:04d}"
                sf.write(folder / f"{uid}.{ext}", tone(rng, k), SR, subtype="PCM_16")
                lines.append(f"{uid} {TEXTS[k].upper()}")
            (folder / f"{spk}-198.trans.txt").write_text("\n".join(lines) + "\n")
    return root


def write_an4(root: Path, n_train: int = 6, n_test: int = 4, seed: int = 0) -> Path:
    """Sphinx layout: etc/an4_{split}.fileids/.transcription, wav/<fileid>.raw (16-bit big-endian)."""
    rng = np.random.default_rng(seed)
    (root / "etc").mkdir(parents=True, exist_ok=True)
    for split, n, top in (("train", n_train, "an4_clstk"), ("test", n_test, "an4test_clstk")):
        ids, trans = [], []
        for u in range(n):
            k = u % len(TEXTS)
            uid = f"an{300 + u}-fash-b"
            fid = f"{top}/fash/{uid}"
            (root / "wav" / top / "fash").mkdir(parents=True, exist_ok=True)
            pcm = (tone(rng, k) * 32767).astype(">i2")
            (root / "wav" / f"{fid}.raw").write_bytes(pcm.tobytes())
            ids.append(fid)
            trans.append(f"<s> {TEXTS[k].upper()} </s> ({uid})")
        (root / "etc" / f"an4_{split}.fileids").write_text("\n".join(ids) + "\n")
        (root / "etc" / f"an4_{split}.transcription").write_text("\n".join(trans) + "\n")
    return root
