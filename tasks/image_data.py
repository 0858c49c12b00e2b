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


class _LocalCIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR-10 reader without the checksum (files present are read as they are)."""

    def _check_integrity(self) -> bool:
        base = Path(self.root) / self.base_folder
        return all((base / name).is_file() for name, _ in self.train_list + self.test_list)

    def _load_meta(self) -> None:  # torchvision's checks the md5 of batches.meta
        path = Path(self.root) / self.base_folder / self.meta["filename"]
        if not path.is_file():
            raise RuntimeError(f"{path.name} not found")
        with open(path, "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


def cifar10(root: str, train: bool, augment: bool) -> Dataset:
    if not (Path(root) / "cifar-10-batches-py").is_dir():
        raise DataError(f"CIFAR-10 not found in {root}: {CIFAR_HINT}")
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    ops = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if train and augment else []
    try:
        return _LocalCIFAR10(root, train=train, download=False, transform=T.Compose([*ops, T.ToTensor(), norm]))
    except RuntimeError as exc:
        raise DataError(f"CIFAR-10 in {root} is incomplete ({exc}): {CIFAR_HINT}") from None


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
