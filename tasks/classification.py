"""Image classification (CIFAR-10, ImageNet, Fashion-MNIST): cross-entropy, top-1/top-5 accuracy.

``data.validation=N`` holds N training images out as a validation split (the same N on every run, whatever its seed:
a permutation of their own), evaluated without augmentation; the run trains on the rest. Settings are chosen on it
(``val_top1``), and ``train.test_eval=end|never`` reads the test split once or not at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from dgc.tasks.base import DataError, Task, shard_indices
from dgc.tasks.image_data import IMAGE_DATA
from dgc.tasks.models import build_model
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from dgc import seeding
from dgc.distributed import all_reduce_sum

#: the seed of the permutation that picks the validation images (fixed: every run holds out the same ones)
VALIDATION_SEED = 20261205


class _Seeded(Dataset):
    """``ds[indices[i]]`` with its random augmentation drawn from a seed of its own: (seed, epoch, example).

    The augmentation of an example depends on nothing else, so a run resumed in the middle of
    an epoch sees exactly the images an uninterrupted one sees, with any number of loader workers.
    """

    def __init__(self, ds: Dataset, indices: list[int], seed: int):
        self.ds, self.indices, self.seed = ds, indices, seed

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        j = self.indices[i]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeding.mix(self.seed, j))
            return self.ds[j]


class ImageClassification(Task):
    metric = "top1"
    higher_is_better = True

    def _dataset(self, train: bool, augment: bool | None = None, part: list[int] | None = None) -> Dataset:
        """The training or test images (``part``: those of the training images; ``augment``: default data.augment)."""
        data = self.cfg.data
        if data.name not in IMAGE_DATA:
            raise ValueError(f"unknown image data {data.name!r}; valid: {', '.join(IMAGE_DATA)}")
        ds = IMAGE_DATA[data.name](data.root, train, data.augment if augment is None else augment, **data.args)
        indices = list(range(len(ds))) if part is None else part
        limit = data.limit if train and augment is None else data.eval_limit
        if limit is not None:
            indices = indices[:limit]
        return ds if part is None and len(indices) == len(ds) else Subset(ds, indices)

    def _validation_split(self) -> tuple[list[int], list[int]] | None:
        """``(training, validation)`` indices of the training images (None: no validation split)."""
        held = self.cfg.data.validation
        if not held:
            return None
        count = len(IMAGE_DATA[self.cfg.data.name](self.cfg.data.root, True, False, **self.cfg.data.args))
        if held >= count:
            raise ValueError(f"data.validation={held} holds out every one of the {count} training images")
        order = torch.randperm(count, generator=torch.Generator().manual_seed(VALIDATION_SEED)).tolist()
        return sorted(order[held:]), sorted(order[:held])

    def check(self) -> None:
        try:
            split = self._validation_split() if self.cfg.data.name in IMAGE_DATA else None
            self.train_set = self._dataset(True, part=None if split is None else split[0])
            self.eval_set = self._dataset(False)
            self.val_set = None if split is None else self._dataset(True, augment=False, part=split[1])
            self.has_validation = split is not None
        except DataError:
            raise
        except TypeError as exc:  # unknown data.args
            raise ValueError(f"data {self.cfg.data.name!r}: {exc}") from None
        need = self.info.world_size * self.cfg.train.batch_size
        if len(self.train_set) < need:
            raise ValueError(
                f"{len(self.train_set)} training examples are fewer than one batch per worker "
                f"({self.info.world_size} x {self.cfg.train.batch_size})"
            )

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model.name, **self.cfg.model.args)

    def batches_per_epoch(self) -> int:
        return len(self.train_set) // (self.info.world_size * self.cfg.train.batch_size)

    def _loader(self, ds: Dataset, indices: torch.Tensor, batch_size: int, epoch: int = -1) -> DataLoader:
        workers = self.cfg.data.loader_workers
        # the loader's own generator: starting an iterator draws a seed, which must not come from
        # the global RNG (a resumed run starts its iterator at another point of that stream)
        gen = seeding.generator(self.cfg.seed, epoch)
        return DataLoader(
            _Seeded(ds, indices.tolist(), seeding.mix(self.cfg.seed, epoch)),
            batch_size=batch_size,
            shuffle=False,
            num_workers=workers,
            pin_memory=self.info.device.type == "cuda",
            persistent_workers=False,
            generator=gen,
        )

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs = self.cfg.train.batch_size
        idx = shard_indices(len(self.train_set), self.info, self.cfg.seed, epoch)
        idx = idx[start * bs : self.batches_per_epoch() * bs]
        for x, y in self._loader(self.train_set, idx, bs, epoch):
            yield x.to(self.info.device, non_blocking=True), y.to(self.info.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, test: bool = True) -> dict[str, float]:
        """Test metrics (``test``) and, with ``data.validation``, the validation split's as ``val_*``."""
        if not test and self.val_set is None:
            raise ValueError(f"{self.cfg.task.name} has no validation split (data.validation=N holds N training "
                             "images out): evaluate(test=True) only")  # fmt: skip
        out = self._metrics(model, self.eval_set) if test else {}
        if self.val_set is not None:
            out.update({f"val_{k}": v for k, v in self._metrics(model, self.val_set).items()})
        return out

    @torch.no_grad()
    def _metrics(self, model: nn.Module, dataset: Dataset) -> dict[str, float]:
        model.eval()
        # every worker evaluates its own shard; the tail goes to the last worker's shard
        n = len(dataset)
        per = n // self.info.world_size
        lo = self.info.rank * per
        hi = n if self.info.rank == self.info.world_size - 1 else lo + per
        loss_sum = top1 = top5 = count = 0.0
        for x, y in self._loader(dataset, torch.arange(lo, hi), self.cfg.train.eval_batch_size):
            x, y = x.to(self.info.device), y.to(self.info.device)
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            k = min(5, logits.shape[1])
            best = logits.topk(k, dim=1).indices
            hit = best == y.unsqueeze(1)
            top1 += float(hit[:, 0].sum())
            top5 += float(hit.any(dim=1).sum())
            count += y.numel()
        model.train()
        loss_sum, top1, top5, count = all_reduce_sum([loss_sum, top1, top5, count], self.info.device)
        count = max(count, 1.0)
        return {"loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count}
