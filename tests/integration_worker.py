"""One rank of the integration tests (run by torchrun): the same small training through the library's DDP path,
Lightning (dgc.integrations.lightning) or Accelerate (dgc.integrations.accelerate), with a checkpoint and a
resume in the middle; it writes the final weights to OUT/<mode>-rank<r>.pt.

    torchrun --nproc-per-node 2 tests/integration_worker.py MODE OUT
    MODE: library | lightning | accelerate
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import dgc

BATCHES, BATCH, EPOCHS, HALF = 4, 8, 2, 4  # 8 steps, the checkpoint after step 4 (the end of epoch 0)
COMPRESSOR = {"density": 0.05, "warmup_epochs": 1}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def loader(rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(BATCHES * BATCH, 16, generator=g), torch.randint(0, 4, (BATCHES * BATCH,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def optimizer(params, sync: dgc.GradientSync) -> dgc.SGD:  # noqa: ANN001
    return dgc.SGD(params, sync, lr=0.1, momentum=0.9, weight_decay=1e-4)


def library(out: Path) -> None:
    """The library's DDP path straight through; and again with the compression state lost at the half (a resume
    without it: the frameworks' runs must not end there)."""
    from dgc.distributed import init_distributed, shutdown

    info = init_distributed("cpu")
    for tag in ("library", "lost"):
        net = model()
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        sync = dgc.GradientSync(net, dgc.build_compressor("dgc", **COMPRESSOR))
        ddp.register_comm_hook(sync, dgc.ddp_comm_hook)
        opt = optimizer(net.parameters(), sync)
        for epoch in range(EPOCHS):
            for i, (x, y) in enumerate(loader(info.rank)):
                sync.set_epoch(epoch + i / BATCHES)
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                if epoch * BATCHES + i + 1 == HALF:
                    torch.save(net.state_dict(), out / f"{tag}-half-rank{info.rank}.pt")
                    if tag == "lost":
                        fresh = dgc.GradientSync(net, dgc.build_compressor("dgc", **COMPRESSOR))
                        sync.load_state_dict(fresh.state_dict())
        torch.save(net.state_dict(), out / f"{tag}-rank{info.rank}.pt")
    shutdown()


def lightning_module(signal_at: int | None = None) -> type:
    """The LightningModule of the tests: ``model()`` on ``loader(rank)``; with ``signal_at``, rank 1 sends itself
    SIGUSR1 in the middle of that step."""
    import signal

    import lightning.pytorch as pl

    from dgc.integrations.lightning import sync_of

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            if self.global_rank == 1 and self.global_step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def train_dataloader(self):  # noqa: ANN201
            return loader(self.global_rank)

        def configure_optimizers(self):  # noqa: ANN201
            return optimizer(self.parameters(), sync_of(self))

    return Module


def lightning(out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from dgc.integrations.lightning import DGC

    Module = lightning_module()  # noqa: N806

    def trainer(epochs: int) -> pl.Trainer:
        # Lightning's own checkpointing, at the end of each epoch (its resume restarts a plain DataLoader at the
        # next epoch's start; a checkpoint taken mid-epoch would resume with another data order)
        saver = ModelCheckpoint(dirpath=out, filename="lightning-{epoch}", save_top_k=-1, every_n_epochs=1)
        return pl.Trainer(
            accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_epochs=epochs,
            callbacks=[DGC("dgc", **COMPRESSOR), saver], logger=CSVLogger(out, name="lightning"),
            log_every_n_steps=1, use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    first = trainer(HALF // BATCHES)
    module = Module()
    first.fit(module)
    torch.save(module.net.state_dict(), out / f"lightning-half-rank{first.global_rank}.pt")
    resumed = Module()  # a fresh process's view: new module, new callback, state only from the checkpoint
    second = trainer(EPOCHS)
    second.fit(resumed, ckpt_path=out / "lightning-epoch=0.ckpt")
    torch.save(resumed.net.state_dict(), out / f"lightning-rank{second.global_rank}.pt")


def lightning_signal(out: Path) -> None:
    """Slurm's SIGUSR1 reaching one rank in the middle of a step: the handler Lightning installs for auto-requeue
    (a stand-in here: it saves the checkpoint as Lightning's does, a collective) runs on every rank at one step."""
    import signal

    import lightning.pytorch as pl

    from dgc.integrations.lightning import DGC

    Module = lightning_module(signal_at=2)  # noqa: N806
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_epochs=EPOCHS,
        callbacks=[DGC("dgc", **COMPRESSOR)], logger=False, use_distributed_sampler=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip

    def requeue(signum, frame) -> None:  # noqa: ANN001
        trainer.save_checkpoint(out / "hpc.ckpt")
        with (out / f"signal-rank{trainer.global_rank}.txt").open("a") as f:
            f.write(f"{trainer.global_step}\n")

    signal.signal(signal.SIGUSR1, requeue)
    trainer.fit(Module())


def accelerate(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    from dgc.integrations.accelerate import attach

    class JsonTracker(GeneralTracker):
        """Accelerate's tracker interface, writing JSON lines (what a user's wandb or tensorboard would get)."""

        name, requires_logging_directory, main_process_only = "json", False, True

        def __init__(self, path: Path) -> None:
            super().__init__()
            self.path = path

        @property
        def tracker(self) -> Path:
            return self.path

        def store_init_configuration(self, values: dict) -> None:
            pass

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:  # noqa: ANN003
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")

    def run(first: bool) -> None:
        """The first half, then save_state; or load_state and the second half (a fresh Accelerator and model)."""
        acc = Accelerator(cpu=True, log_with=[JsonTracker(out / "accelerate-log.jsonl")] if first else None)
        net = model()
        sync = dgc.GradientSync(net, dgc.build_compressor("dgc", **COMPRESSOR))
        opt = optimizer(net.parameters(), sync)
        ddp, opt = acc.prepare(net, opt)
        attach(acc, ddp, sync)
        if first:
            acc.init_trackers("dgc")
        else:
            acc.load_state(str(out / "accelerate-state"))
        for epoch in range(0, HALF // BATCHES) if first else range(HALF // BATCHES, EPOCHS):
            for i, (x, y) in enumerate(loader(acc.process_index)):
                sync.set_epoch(epoch + i / BATCHES)
                opt.zero_grad()
                acc.backward(F.cross_entropy(ddp(x), y))
                opt.step()
                acc.log({"dgc/wire_ratio": sync.last.wire_ratio}, step=epoch * BATCHES + i)
        tag = "half-" if first else ""
        torch.save(net.state_dict(), out / f"accelerate-{tag}rank{acc.process_index}.pt")
        if first:
            acc.save_state(str(out / "accelerate-state"))

    run(first=True)
    run(first=False)


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    modes = {"library": library, "lightning": lightning, "lightning-signal": lightning_signal, "accelerate": accelerate}
    modes[mode](out)
    from dgc.distributed import shutdown

    shutdown()  # a gloo worker leaving with its process group alive aborts now and then (see shutdown)
