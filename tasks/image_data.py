"""Image data sets on a user's disk: Fashion-MNIST (IDX), CIFAR-10 (python batches), ImageFolder.

Each loader checks its files first and raises :class:`DataError` with one line saying
where the data is expected and how to get it. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from dgc.tasks.base import DataError
from torch.utils.data import Dataset, TensorDataset
from torchvision import transforms as T

# -- Fashion-MNIST -------------------------------------------------------------------------

FMNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FMNIST_HINT = (
    "apt-get install dataset-fashion-mnist (or `make install` as root) puts it in /usr/share/datasets/fashion-mnist; "
    "or put the four IDX files in $DGC_DATA/fashion-mnist, or pass data.root=DIR"
)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): big-endian header, unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, OSError, zlib.error) as exc:  # a truncated or corrupt .gz (gzip.BadGzipFile is an OSError)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path} is damaged ({detail}): replace it; {FMNIST_HINT}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but holds {body.size} bytes")
    return body.reshape(dims)


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise DataError(f"Fashion-MNIST file {stem}[.gz] not found in {root}: {FMNIST_HINT}")


class IdxImages(Dataset):
    """28x28 grey images and labels from IDX files, as float tensors in [0, 1] (1 channel)."""

    def __init__(self, root: str | os.PathLike, train: bool, transform=None):
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"data root {root} does not exist: {FMNIST_HINT}")
        images, labels = (read_idx(_find(root, s)) for s in FMNIST_FILES[train])
        if len(images) != len(labels):
            raise DataError(f"{root}: {len(images)} images but {len(labels)} labels")
        self.images = torch.from_numpy(images.copy()).unsqueeze(1)
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].float().div_(255)
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[i]


def fmnist(root: str, train: bool, augment: bool) -> Dataset:
    ops = [T.RandomCrop(28, padding=2), T.RandomHorizontalFlip()] if train and augment else []
    return IdxImages(root, train, T.Compose([*ops, T.Normalize((0.2860,), (0.3530,))]))


# -- CIFAR-10 ------------------------------------------------------------------------------

CIFAR_HINT = (
    "download cifar-10-python.tar.gz from the CIFAR-10 page and extract it there "
    "(expected: <root>/cifar-10-batches-py/data_batch_1..5, test_batch)"
)


CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]


class _ArraysOnly(pickle.Unpickler):
    """Unpickles data, never code: containers, numbers, strings and numpy arrays, nothing else (a batch file is
    a pickle, and a pickle can name any callable to run; torchvision's md5 check is not done here, so that any
    copy of the data set is read)."""

    ALLOWED = frozenset(
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy")
        for name in ("_reconstruct", "ndarray", "dtype", "scalar")
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is code, not data")


def read_cifar_batch(path: Path, keys: tuple[str, ...] = ("data", "labels")) -> dict:
    """One CIFAR-10 python batch (a dict with ``data``, a uint8 array of rows of 3072 bytes, and ``labels``;
    ``batches.meta``: ``label_names``); a DataError naming the file when it is anything else."""
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or planted file raises: one line
        raise DataError(f"{path} is not a CIFAR-10 batch ({exc}); refused: {CIFAR_HINT}") from None
    if not isinstance(batch, dict) or any(k not in batch for k in keys):
        raise DataError(f"{path} is not a CIFAR-10 batch (no {' and '.join(keys)}): {CIFAR_HINT}")
    return batch


class CIFAR10Batches(Dataset):
    """CIFAR-10's python batches as (transformed PIL image, label) pairs, read with :class:`_ArraysOnly`."""

    def __init__(self, root: str, train: bool, transform: Any) -> None:
        base, names = Path(root) / "cifar-10-batches-py", CIFAR_TRAIN if train else CIFAR_TEST
        missing = [n for n in [*names, "batches.meta"] if not (base / n).is_file()]
        if missing:
            raise DataError(f"CIFAR-10 in {root} is incomplete ({', '.join(missing)} not found): {CIFAR_HINT}")
        batches = [read_cifar_batch(base / n) for n in names]
        self.classes = [str(c) for c in read_cifar_batch(base / "batches.meta", ("label_names",))["label_names"]]
        try:
            self.data = np.vstack([b["data"] for b in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            self.targets = [int(label) for b in batches for label in b["labels"]]
        except (ValueError, TypeError) as exc:
            raise DataError(f"CIFAR-10 in {root} holds batches of the wrong shape ({exc}): {CIFAR_HINT}") from None
        if len(self.targets) != len(self.data):
            raise DataError(f"CIFAR-10 in {root}: {len(self.data)} images but {len(self.targets)} labels")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def cifar10(root: str, train: bool, augment: bool) -> Dataset:
    if not (Path(root) / "cifar-10-batches-py").is_dir():
        raise DataError(f"CIFAR-10 not found in {root}: {CIFAR_HINT}")
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    ops = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if train and augment else []
    return CIFAR10Batches(root, train, T.Compose([*ops, T.ToTensor(), norm]))


# -- ImageFolder (ImageNet layout) ---------------------------------------------------------

IMAGENET_HINT = "expected <root>/train/<class>/*.JPEG and <root>/val/<class>/*.JPEG (the ImageNet layout)"


def imagefolder(root: str, train: bool, augment: bool, image_size: int = 224) -> Dataset:
    split = Path(root) / ("train" if train else "val")
    if not split.is_dir():
        raise DataError(f"image folder {split} not found: {IMAGENET_HINT}")
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    if train and augment:
        ops = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        ops = [T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size)]
    return torchvision.datasets.ImageFolder(str(split), transform=T.Compose([*ops, T.ToTensor(), norm]))


IMAGE_DATA = {"fmnist": fmnist, "cifar10": cifar10, "imagefolder": imagefolder}

__all__ = ["IMAGE_DATA", "DataError", "IdxImages", "TensorDataset", "read_idx"]
