"""Image tasks on tiny data written by the tests: readers, models, and one optimizer step of every task."""

from __future__ import annotations

import gzip
import json
import pickle
import struct

import numpy as np
import pytest
import torch
import yaml
from dgc.conf import options
from dgc.tasks import build_task
from dgc.tasks.image_data import DataError, cifar10, fmnist, imagefolder, read_idx
from dgc.tasks.models import build_model
from dgc.tasks.tiny_data import write_cifar10, write_fmnist, write_imagefolder
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dgc.train  # noqa: F401  (registers the schema the configs start from)
from dgc.distributed import init_distributed
from dgc.repro.trainer import Trainer


def compose_config(*overrides: str):
    with initialize_config_module("dgc.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {
        "fmnist": write_fmnist(root / "fmnist", n_train=32, n_test=16),
        "cifar10": write_cifar10(root / "cifar10", per_batch=8, n_test=16),
        "imagefolder": write_imagefolder(root / "imagenet", classes=3, per_class_train=4, per_class_val=2, size=40),
    }


# -- readers -------------------------------------------------------------------------------


def _idx(magic_dims: int, dims: list[int], body: bytes) -> bytes:
    return bytes([0, 0, 0x08, magic_dims]) + b"".join(struct.pack(">I", d) for d in dims) + body


def test_read_idx(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = _idx(3, [2, 3, 4], images.tobytes())
    assert raw[:4] == b"\x00\x00\x08\x03"
    (tmp_path / "img").write_bytes(raw)
    (tmp_path / "img.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "lab.gz").write_bytes(gzip.compress(_idx(1, [3], bytes([7, 0, 9]))))
    for name in ("img", "img.gz"):
        out = read_idx(tmp_path / name)
        assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
        np.testing.assert_array_equal(out, images)
    np.testing.assert_array_equal(read_idx(tmp_path / "lab.gz"), [7, 0, 9])
    (tmp_path / "short").write_bytes(_idx(3, [2, 3, 4], images.tobytes()[:-1]))
    with pytest.raises(DataError, match="header says"):
        read_idx(tmp_path / "short")
    (tmp_path / "float").write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 1) + b"\0\0\0\0")
    with pytest.raises(DataError, match="not an unsigned-byte IDX"):
        read_idx(tmp_path / "float")


def test_fmnist_reader(data):
    ds = fmnist(str(data["fmnist"]), train=True, augment=False)
    assert len(ds) == 32
    x, y = ds[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and 0 <= int(y) < 10
    raw = read_idx(data["fmnist"] / "train-images-idx3-ubyte.gz")
    expected = (torch.from_numpy(raw[0].astype(np.float32)) / 255 - 0.2860) / 0.3530
    torch.testing.assert_close(x[0], expected)
    assert len(fmnist(str(data["fmnist"]), train=False, augment=False)) == 16
    with pytest.raises(DataError, match="does not exist"):
        fmnist(str(data["fmnist"] / "missing"), train=True, augment=False)


def test_cifar10_reader(data):
    train = cifar10(str(data["cifar10"]), train=True, augment=True)
    assert len(train) == 5 * 8
    x, y = train[3]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert train.classes[0] == "class0"
    assert len(cifar10(str(data["cifar10"]), train=False, augment=False)) == 16
    (data["cifar10"] / "cifar-10-batches-py" / "data_batch_5").rename(data["cifar10"] / "away")
    try:
        with pytest.raises(DataError, match="incomplete"):
            cifar10(str(data["cifar10"]), train=True, augment=False)
    finally:
        (data["cifar10"] / "away").rename(data["cifar10"] / "cifar-10-batches-py" / "data_batch_5")


def test_a_cifar_batch_that_carries_code_is_refused_without_running_it(tmp_path):
    """A planted data_batch_1 whose pickle calls os.system: one DataError naming the file, and nothing ran."""
    import os

    root = write_cifar10(tmp_path / "cifar10", per_batch=4, n_test=4)
    ran = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    (root / "cifar-10-batches-py" / "data_batch_1").write_bytes(pickle.dumps({"data": Planted(), "labels": []}))
    with pytest.raises(DataError) as info:
        cifar10(str(root), train=True, augment=False)
    assert str(info.value).startswith(f"{root / 'cifar-10-batches-py' / 'data_batch_1'} is not a CIFAR-10 batch")
    assert "which is code, not data" in str(info.value) and "\n" not in str(info.value)
    assert not ran.exists()
    assert len(cifar10(str(root), train=False, augment=False)) == 4  # the untouched test batch still reads


def test_imagefolder_reader(data):
    train = imagefolder(str(data["imagefolder"]), train=True, augment=True, image_size=32)
    assert len(train) == 12 and len(train.classes) == 3
    assert train[0][0].shape == (3, 32, 32)
    val = imagefolder(str(data["imagefolder"]), train=False, augment=False, image_size=63)
    assert len(val) == 6 and val[5][0].shape == (3, 63, 63) and val[5][1] == 2


# -- models --------------------------------------------------------------------------------


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_cifar_resnet_sizes():
    # He et al. 2016, Table 6: ResNet-20 0.27M, ResNet-56 0.85M, ResNet-110 1.7M (option A shortcuts)
    assert _count(build_model("resnet_cifar", depth=20, num_classes=10, in_channels=3)) == 269_722
    assert _count(build_model("resnet_cifar", depth=56)) == 853_018
    assert _count(build_model("resnet_cifar", depth=110)) == 1_727_962
    model = build_model("resnet_cifar", depth=20, num_classes=10, in_channels=1)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="6n\\+2"):
        build_model("resnet_cifar", depth=21)
    with pytest.raises(ValueError, match="no argument"):
        build_model("resnet_cifar", width=3)


# -- data order and augmentation -----------------------------------------------------------


def test_batches_from_the_middle_of_an_epoch_match(data):
    """What a resumed run sees from micro-batch 2 on equals the tail of an uninterrupted epoch,
    whatever the global RNG holds and with any number of loader workers."""
    info = init_distributed("cpu")

    def batches(workers: int, start: int) -> list[torch.Tensor]:
        cfg = compose_config(
            "task=fmnist_resnet20",
            f"data.root={data['fmnist']}",
            "train.batch_size=4",
            f"data.loader_workers={workers}",
        )
        task = build_task(cfg, info)
        task.check()
        torch.manual_seed(1234 + start)
        return [x for x, _ in task.train_batches(epoch=1, start=start)]

    full = batches(0, 0)
    assert len(full) == 8
    for got in (batches(0, 2), batches(1, 2)):
        assert len(got) == 6
        for a, b in zip(got, full[2:]):
            assert torch.equal(a, b)
    # and the augmentation is random: another epoch crops and flips differently
    cfg = compose_config("task=fmnist_resnet20", f"data.root={data['fmnist']}", "train.batch_size=4")
    task = build_task(cfg, info)
    task.check()
    other = torch.cat([x for x, _ in task.train_batches(epoch=2)])
    assert not torch.equal(other.sum(0), torch.cat(full).sum(0))


def test_a_validation_split_is_held_out_of_the_training_images(data):
    """data.validation=N: the same N training images on every run, evaluated without augmentation, never trained on."""
    info = init_distributed("cpu")

    def task_of(*extra: str):
        cfg = compose_config("task=fmnist_resnet20", f"data.root={data['fmnist']}", "train.batch_size=4", *extra)
        task = build_task(cfg, info)
        task.check()
        return task

    plain = task_of()
    model = plain.build_model()
    assert not plain.has_validation and set(plain.evaluate(model)) == {"loss", "top1", "top5"}
    a, b = task_of("data.validation=8"), task_of("data.validation=8", "seed=3")
    assert a.has_validation and len(a.train_set) == 24 and len(a.val_set) == 8
    assert a.val_set.indices == b.val_set.indices and a.train_set.indices == b.train_set.indices
    assert not set(a.val_set.indices) & set(a.train_set.indices)
    assert a.batches_per_epoch() == 6
    x, _ = a.val_set[0]
    x2, _ = a.val_set[0]
    assert torch.equal(x, x2)  # no augmentation
    assert set(a.evaluate(model, test=False)) == {"val_loss", "val_top1", "val_top5"}
    assert set(a.evaluate(model)) == {"loss", "top1", "top5", "val_loss", "val_top1", "val_top5"}
    with pytest.raises(ValueError, match="data.validation=32 holds out every one of the 32 training images"):
        task_of("data.validation=32")
    with pytest.raises(ValueError, match="has no validation split"):
        plain.evaluate(model, test=False)


# -- one optimizer step of every image task ------------------------------------------------

#: task -> (overrides, examples evaluated)
TASK_RUNS = {
    "fmnist_resnet20": (["data.root={fmnist}"], 8),
    "cifar10_resnet20": (["data.root={cifar10}"], 8),
    "cifar10_resnet110": (["data.root={cifar10}"], 8),
    "imagenet_resnet50": (["data.root={imagefolder}", "+data.args.image_size=32", "model.args.num_classes=3"], 6),
    # AlexNet's pooling needs 63 pixels at least
    "imagenet_alexnet": (["data.root={imagefolder}", "+data.args.image_size=63", "model.args.num_classes=3"], 6),
}
TINY = [
    "device=cpu",
    "train.max_steps=1",
    "train.batch_size=4",
    "train.eval_batch_size=8",
    "train.progress=false",
    "data.eval_limit=8",
    "data.loader_workers=0",
    # measure the wire ratio from the first step on
    "task.compression_warmup_epochs=0",
]
TRAIN_KEYS = {"train_loss", "skipped", "lr", "density", "sent_bytes", "wire_ratio", "epoch"}
TRAIN_KEYS |= {"compute_s", "compress_s", "communicate_s"}


def test_every_image_task_is_covered():
    image_tasks = {t for t in options("task") if compose_config(f"task={t}").task.kind == "image"}
    assert image_tasks == set(TASK_RUNS)


@pytest.mark.parametrize(
    "task, compression",
    [(t, "dgc") for t in TASK_RUNS] + [("fmnist_resnet20", "none")],
)
def test_one_step(task, compression, data, tmp_path):
    run_dir = tmp_path / "run"
    overrides, n_eval = TASK_RUNS[task]
    overrides = [o.format(**data) for o in overrides]
    cfg = compose_config(f"task={task}", f"compression={compression}", *TINY, *overrides, f"run_dir={run_dir}")
    summary = Trainer(cfg, init_distributed("cpu")).fit()

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("task", "compression", "world_size", "steps", "metrics", "wire_ratio", "bytes_per_step", "wall_s"):
        assert key in on_disk, key
    assert on_disk["task"] == task and on_disk["compression"] == compression
    assert on_disk["world_size"] == 1 and on_disk["steps"] == 1 and on_disk["wall_s"] > 0
    metrics = on_disk["metrics"]
    assert 0 <= metrics["top1"] <= metrics["top5"] <= 100
    for key in ("top1", "top5"):  # percentages of the evaluated images
        hits = metrics[key] * n_eval / 100
        assert abs(hits - round(hits)) < 1e-6
    if compression == "none":
        assert on_disk["wire_ratio"] == 1.0
    else:
        assert on_disk["wire_ratio"] > 20  # density 0.001, with small tensors sent dense
    assert on_disk["bytes_per_step"] > 0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1] and [r["step"] for r in evals] == [1]
    assert TRAIN_KEYS <= set(train[0])
    assert np.isfinite(train[0]["train_loss"]) and train[0]["lr"] > 0
    assert train[0]["density"] == (1.0 if compression == "none" else 0.001)
    assert {"loss", "top1", "top5", "wire_ratio"} <= set(evals[0])
    assert evals[0]["top1"] == metrics["top1"]

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["task"]["name"] == task and saved["compression"]["name"] == compression
    assert saved["train"]["max_steps"] == 1

    # the step changed the model that was initialized from the seed
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False, mmap=True)
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model.name, **cfg.model.args).state_dict()
    changed = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.equal(v, initial[k])]
    assert changed
    assert state["counters"]["step"] == 1
    del state
    (run_dir / "checkpoint.pt").unlink()  # AlexNet's is 0.7 GB
