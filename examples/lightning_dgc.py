"""DGC in a PyTorch Lightning job: the DGC callback, dgc.SGD in configure_optimizers, nothing else changes.

    torchrun --standalone --nproc-per-node 2 examples/lightning_dgc.py             # 2 CPU processes (gloo)
    torchrun --standalone --nproc-per-node 2 examples/lightning_dgc.py --resume    # continue from the last checkpoint

On GPUs: --accelerator gpu. Under Slurm with auto-requeue, Lightning's SIGUSR1 checkpoint holds every rank's
compression state (the callback runs it at a step boundary all ranks agree on).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import dgc
from dgc.distributed import shutdown
from dgc.integrations.lightning import DGC, sync_of


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def train_dataloader(self):  # noqa: ANN201
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 32, generator=g)
        y = (x[:, :10] * 3).argmax(1)  # a learnable rule
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)

    def configure_optimizers(self):  # noqa: ANN201
        # DGC with momentum correction keeps the momenta itself: dgc.SGD bound to the callback's sync
        return dgc.SGD(self.parameters(), sync_of(self), lr=0.1, momentum=0.9, weight_decay=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="runs/examples/lightning")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last.ckpt")
    args = parser.parse_args()
    out = Path(args.out)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[DGC("dgc", density=0.01, warmup_epochs=1), ModelCheckpoint(dirpath=out, save_last=True)],
        logger=CSVLogger(out, name="logs"),  # dgc/wire_ratio, dgc/density, dgc/sent_bytes
        log_every_n_steps=10,
        enable_progress_bar=False,
    )
    trainer.fit(Classifier(), ckpt_path=out / "last.ckpt" if args.resume else None)
    stats = trainer.callback_metrics
    if trainer.is_global_zero:
        print(f"done: epoch {trainer.current_epoch}, loss {float(stats['loss']):.3f}, "
              f"wire ratio {float(stats['dgc/wire_ratio']):.0f}x; logs in {trainer.logger.log_dir}")  # fmt: skip
    shutdown()  # leave the process group before exit (a gloo worker that does not may abort)


if __name__ == "__main__":
    main()
