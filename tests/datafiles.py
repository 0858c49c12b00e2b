"""Tiny data sets on disk in the formats the image tasks read (tests only).

* :func:`write_fmnist`: Fashion-MNIST IDX files (gzip), the layout of Debian's dataset-fashion-mnist;
* :func:`write_cifar10`: CIFAR-10 python batches in ``<root>/cifar-10-batches-py/``;
* :func:`write_imagefolder`: an ImageNet-style ``train/<class>/*.png`` and ``val/<class>/*.png`` tree.

The pixels are random but the labels are learnable (each class has its own mean brightness).
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
