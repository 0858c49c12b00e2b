"""DGC in PyTorch Lightning: one callback.

::

    from dgc.integrations.lightning import DGC, sync_of

    class Model(lightning.LightningModule):
        ...
        def configure_optimizers(self):
            return dgc.SGD(self.parameters(), sync_of(self), lr=0.1, momentum=0.9)

    trainer = lightning.Trainer(strategy="ddp", callbacks=[DGC("dgc", density=0.001, warmup_epochs=4)])

The callback

* builds the :class:`~dgc.GradientSync` in ``setup`` (after the process group exists) over the module's parameters;
* registers :func:`dgc.ddp_comm_hook` on the DDP model Lightning made (Lightning's own ``ddp_comm_hook`` argument
  registers a hook on CUDA only); without DDP (one process) it runs ``sync.step()`` before each optimizer step;
* calls ``sync.set_epoch(epoch + batch / batches)`` before every batch (the density warm-up);
* saves every rank's compression state in Lightning's checkpoint (``checkpoint["dgc"]``, gathered from all ranks
  by :class:`~dgc.integrations.state.EveryRank`) and gives each rank its own back on resume, remapped when the
  number of ranks changed;
* logs ``dgc/wire_ratio``, ``dgc/density`` and ``dgc/sent_bytes`` to Lightning's loggers every step;
* makes Lightning's Slurm auto-requeue safe: its SIGUSR1 handler saves the checkpoint, a collective, from inside
  the signal handler wherever each rank happens to be; the callback defers it to the next step boundary all ranks
  agree on (the request rides on the sync's per-step agreement), where it runs on every rank at the same step.

DGC with momentum correction needs :class:`dgc.SGD` bound to the callback's sync (:func:`sync_of`); a wrong
optimizer is one clear error at the start of ``fit``. Not supported (refused at ``fit``): gradient accumulation
(``accumulate_grad_batches > 1``) and sharded strategies (FSDP, DeepSpeed): the sync needs the whole gradient of
every parameter on every rank once per optimizer step.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

import dgc
from dgc.integrations.state import EveryRank
from dgc.stats import StepStats


class DGC(pl.Callback):
    """Deep Gradient Compression for a Lightning ``Trainer`` (see the module docstring).

    Args:
        compressor: a registered name (``dgc``, ``topk``, ...: :data:`dgc.COMPRESSORS`) or a built compressor.
        clip_norm: local gradient clipping (the paper's; None: off), as :class:`dgc.GradientSync`.
        sync_kwargs: further :class:`dgc.GradientSync` arguments (``policy``, ``exchange``, ``accumulate``, ...).
        **compressor_kwargs: the compressor's settings when it is given by name (``density``, ``warmup_epochs``).
    """

    def __init__(
        self,
        compressor: str | Any = "dgc",
        *,
        clip_norm: float | None = None,
        sync_kwargs: dict[str, Any] | None = None,
        **compressor_kwargs: Any,
    ) -> None:
        if not isinstance(compressor, str) and compressor_kwargs:
            raise ValueError("DGC: give compressor settings only with a compressor name, not with a built one")
        self._compressor = compressor
        self._compressor_kwargs = compressor_kwargs
        self._clip_norm = clip_norm
        self._sync_kwargs = dict(sync_kwargs or {})
        self.sync: dgc.GradientSync | None = None
        self._hooked = False
        self._deferred: Callable[..., Any] | None = None  # Lightning's SIGUSR1 handler, run at a step boundary

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.sync is not None:
            return
        compressor = (
            dgc.build_compressor(self._compressor, **self._compressor_kwargs)
            if isinstance(self._compressor, str)
            else self._compressor
        )
        self.sync = dgc.GradientSync(pl_module, compressor, clip_norm=self._clip_norm, **self._sync_kwargs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync = self._need_sync()
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"DGC: accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported: the sync runs "
                "once per optimizer step on the whole gradient; use accumulate_grad_batches=1 (a larger batch)"
            )
        if sync.compressor.owns_momentum:
            for opt in trainer.optimizers:
                if not (isinstance(opt, dgc.SGD) and opt.sync is sync):
                    raise ValueError(
                        f"DGC: the compressor keeps each compressed tensor's momentum (momentum correction), so the "
                        f"optimizer must be dgc.SGD bound to the callback's sync, got {type(opt).__name__}: in "
                        "configure_optimizers return dgc.SGD(self.parameters(), dgc.integrations.lightning."
                        "sync_of(self), lr=..., momentum=...)"
                    )
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if not self._hooked:
                model.register_comm_hook(sync, dgc.ddp_comm_hook)
                self._hooked = True
        elif sync.world_size > 1:
            raise ValueError(
                f"DGC: strategy {type(trainer.strategy).__name__} does not give every rank the whole gradient "
                "through DDP; use strategy='ddp' (FSDP and DeepSpeed shard the gradients DGC compresses)"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its Slurm SIGUSR1 handler just before training; hold it until all ranks agree
        current = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
        if callable(current) and self._deferred is None:
            self._deferred = current
            signal.signal(signal.SIGUSR1, self._on_sigusr1)

    def _on_sigusr1(self, signum: int, frame: Any) -> None:
        self._need_sync().request("checkpoint")

    # -- every step ----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:  # fmt: skip
        batches = trainer.num_training_batches
        epoch = trainer.current_epoch + (batch_idx / batches if batches and math.isfinite(batches) else 0.0)
        self._need_sync().set_epoch(epoch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._hooked:
            self._need_sync().step()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        stats: StepStats | None = self._need_sync().last
        if stats is None:
            return
        pl_module.log_dict(
            {"dgc/wire_ratio": float(stats.wire_ratio), "dgc/density": float(stats.density),
             "dgc/sent_bytes": float(stats.sent_bytes)},
            on_step=True, on_epoch=False, sync_dist=False,
        )  # fmt: skip
        if "checkpoint" in stats.requests and self._deferred is not None:
            self._deferred(signal.SIGUSR1, None)  # every rank, the same step: Lightning saves and requeues

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred is not None and signal.getsignal(signal.SIGUSR1) == self._on_sigusr1:
            signal.signal(signal.SIGUSR1, self._deferred)
        self._deferred = None

    # -- checkpoints ---------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:  # fmt: skip
        checkpoint["dgc"] = EveryRank(self._need_sync()).state_dict()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:  # fmt: skip
        if "dgc" not in checkpoint:
            raise ValueError("DGC: the checkpoint holds no DGC state (saved without the DGC callback?)")
        EveryRank(self._need_sync()).load_state_dict(checkpoint["dgc"])

    def _need_sync(self) -> dgc.GradientSync:
        if self.sync is None:
            raise RuntimeError("DGC: the callback's sync is built in setup('fit'); pass the callback to the Trainer")
        return self.sync


def sync_of(module: pl.LightningModule) -> dgc.GradientSync:
    """The :class:`dgc.GradientSync` of the :class:`DGC` callback of ``module``'s trainer (for ``dgc.SGD`` in
    ``configure_optimizers``)."""
    callbacks = [c for c in module.trainer.callbacks if isinstance(c, DGC)]
    if len(callbacks) != 1:
        raise ValueError(f"sync_of: the trainer has {len(callbacks)} DGC callbacks, needs exactly one")
    return callbacks[0]._need_sync()


__all__ = ["DGC", "sync_of"]
