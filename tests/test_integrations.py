"""dgc.integrations: Lightning and Accelerate train, checkpoint and resume to the library path's weights (2 gloo
processes under torchrun), log the wire ratio to their own loggers, and refuse what they cannot do; EveryRank
keeps every rank's state and remaps it onto another number of ranks."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dgc
from dgc import elastic
from dgc.integrations import EveryRank
from tests.multiproc import kill_tree

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "integration_worker.py"


def torchrun(mode: str, out: Path, timeout: float = 240) -> None:
    """``torchrun --standalone`` 2 CPU processes of the worker; torchrun and its workers are killed on a timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           mode, str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its workers (in sessions of their own)
        log, _ = proc.communicate()
        raise AssertionError(f"{mode}: no result in {timeout} s:\n{log[-3000:]}") from None
    assert proc.returncode == 0, f"{mode} failed:\n{log[-3000:]}"


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrations")
    torchrun("library", out)
    return out


def weights(out: Path, tag: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{tag}-rank{rank}.pt")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)


def test_losing_the_compression_state_changes_the_result(library):
    """The comparisons below can fail: a resume without the residuals and momenta ends elsewhere."""
    for rank in (0, 1):
        assert_same(weights(library, "library-half", rank), weights(library, "lost-half", rank))
        diff = max((weights(library, "library", rank)[k] - weights(library, "lost", rank)[k]).abs().max().item()
                   for k in weights(library, "library", rank))  # fmt: skip
        assert diff > 1e-3


def test_lightning_resumes_to_the_library_path(library):
    torchrun("lightning", library)
    for rank in (0, 1):
        assert_same(weights(library, "library-half", rank), weights(library, "lightning-half", rank))
        assert_same(weights(library, "library", rank), weights(library, "lightning", rank))
    checkpoint = torch.load(library / "lightning-epoch=0.ckpt", weights_only=False)
    assert [s["rank"] for s in checkpoint["dgc"]["ranks"]] == [0, 1]  # every rank's state, not rank 0's only
    logs = sorted((library / "lightning").glob("version_*/metrics.csv"))
    rows = [r for path in logs for r in csv.DictReader(path.open())]
    ratios = [float(r["dgc/wire_ratio"]) for r in rows if r.get("dgc/wire_ratio")]
    assert len(ratios) == 8 and min(ratios[4:]) > 5  # every step logged; density 0.05 after the warm-up


def test_accelerate_resumes_to_the_library_path(library):
    torchrun("accelerate", library)
    for rank in (0, 1):
        assert_same(weights(library, "library-half", rank), weights(library, "accelerate-half", rank))
        assert_same(weights(library, "library", rank), weights(library, "accelerate", rank))
    saved = torch.load(library / "accelerate-state" / "custom_checkpoint_0.pkl", weights_only=False)
    assert [s["rank"] for s in saved["ranks"]] == [0, 1]
    logged = [json.loads(line) for line in (library / "accelerate-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3] and logged[-1]["dgc/wire_ratio"] > 5


def small_sync() -> dgc.GradientSync:
    """A sync of one process after one step (its residuals and momenta exist)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 2))
    sync = dgc.GradientSync(net, dgc.build_compressor("dgc", density=0.1))
    dgc.SGD(net.parameters(), sync, lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    sync.set_epoch(0.0)
    sync.step()
    return sync


def test_every_rank_state_remaps_onto_another_number_of_ranks():
    """Four ranks' residuals and momenta loaded on one process: the mean over ranks is kept."""
    states = []
    for rank in range(4):
        state = small_sync().state_dict()
        state["rank"], state["world_size"] = rank, 4
        for bufs in state["compressor"]["tensors"].values():
            for t in bufs.values():
                t.copy_(torch.randn_like(t) + rank)
        states.append(state)
    assert states[0]["compressor"]["tensors"]
    sync = small_sync()
    EveryRank(sync).load_state_dict({"format": "dgc-every-rank/1", "world_size": 4, "ranks": states})
    mine = sync.state_dict()["compressor"]["tensors"]
    for name, bufs in elastic.mean_over_ranks(states).items():
        for key, mean in bufs.items():
            torch.testing.assert_close(mine[name][key].to(torch.float64), mean, rtol=1e-6, atol=1e-6)
    # one process's own state round-trips unchanged
    again = small_sync()
    EveryRank(again).load_state_dict(EveryRank(sync).state_dict())
    assert_same(again.state_dict()["compressor"]["tensors"]["0.weight"], mine["0.weight"])


def test_a_state_that_is_not_every_ranks_is_refused():
    with pytest.raises(ValueError, match="not a DGC every-rank state"):
        EveryRank(small_sync()).load_state_dict(small_sync().state_dict())


def test_slurm_requeue_signal_on_one_rank_checkpoints_every_rank_at_one_step(tmp_path):
    torchrun("lightning-signal", tmp_path, timeout=120)  # a collective out of step would hang the ranks
    steps = [(tmp_path / f"signal-rank{r}.txt").read_text().split() for r in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 1  # once, at the same step on both ranks
    checkpoint = torch.load(tmp_path / "hpc.ckpt", weights_only=False)
    assert [s["rank"] for s in checkpoint["dgc"]["ranks"]] == [0, 1]
    assert checkpoint["global_step"] == int(steps[0][0])


def lightning_fit(tmp_path: Path, optimizer: str, accumulate: int = 1, compressor: str = "dgc") -> dgc.GradientSync:
    """A one-process Lightning fit of 4 steps with the DGC callback (no DDP: the callback runs sync.step())."""
    import lightning.pytorch as pl

    from dgc.integrations.lightning import DGC, sync_of

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def train_dataloader(self):  # noqa: ANN201
            data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
            return torch.utils.data.DataLoader(data, batch_size=8)

        def configure_optimizers(self):  # noqa: ANN201
            if optimizer == "dgc":
                return dgc.SGD(self.parameters(), sync_of(self), lr=0.1, momentum=0.9)
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    callback = DGC(compressor, density=0.1, warmup_epochs=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Module())
    return callback.sync


def test_lightning_in_one_process_runs_the_sync_itself(tmp_path):
    sync = lightning_fit(tmp_path, "dgc")
    assert sync.steps == 4 and sync.last.density == pytest.approx(0.1) and sync.last.wire_ratio > 1


@pytest.mark.parametrize(
    ("optimizer", "accumulate", "compressor", "message"),
    [
        ("torch", 1, "dgc", "the optimizer must be dgc.SGD bound to the callback's sync, got SGD"),
        ("dgc", 2, "dgc", "accumulate_grad_batches=2 is not supported"),
    ],
)
def test_lightning_refuses_what_it_cannot_train(tmp_path, optimizer, accumulate, compressor, message):
    with pytest.raises(ValueError, match=message):
        lightning_fit(tmp_path, optimizer, accumulate, compressor)


def test_torch_optimizers_work_where_the_compressor_keeps_no_momentum(tmp_path):
    sync = lightning_fit(tmp_path, "torch", compressor="topk")
    assert sync.steps == 4
