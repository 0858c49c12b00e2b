"""DGC in Hugging Face Accelerate: one call after ``accelerator.prepare``.

::

    accelerator = Accelerator()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.001, warmup_epochs=4))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    dgc.integrations.accelerate.attach(accelerator, model, sync)
    for epoch in ...:
        for i, batch in enumerate(loader):
            sync.set_epoch(epoch + i / len(loader))
            ...; accelerator.backward(loss); opt.step(); opt.zero_grad()
            accelerator.log({"dgc/wire_ratio": sync.last.wire_ratio}, step=...)
    accelerator.save_state(dir)   # every rank's compression state included; load_state(dir) gives each its own

:func:`attach` registers :func:`dgc.ddp_comm_hook` on the DDP model ``prepare`` made (Accelerate's own
``comm_hook`` setting takes only PyTorch's hooks) and registers :class:`~dgc.integrations.state.EveryRank` for
checkpointing: ``register_for_checkpointing(sync)`` alone would save rank 0's residuals for every rank.
``save_state`` takes every object's state on every process, so the gather inside it is safe; ``load_state`` on
another number of processes remaps the states (:mod:`dgc.elastic`). Not supported: gradient accumulation
(``gradient_accumulation_steps > 1``), ``save_on_each_node`` (the states are gathered on the main process only),
and DeepSpeed or FSDP (they shard the gradient DGC compresses).
"""

from __future__ import annotations

from typing import Any

import torch

import dgc
from dgc.integrations.state import EveryRank


def attach(accelerator: Any, model: torch.nn.Module, sync: dgc.GradientSync) -> EveryRank:
    """Run ``sync`` as ``model``'s gradient exchange and checkpoint its state with ``accelerator.save_state``.

    ``model`` is what ``accelerator.prepare`` returned. With one process (no DDP) call ``sync.step()`` after
    ``accelerator.backward(loss)`` yourself. Returns the checkpointed :class:`EveryRank`."""
    if getattr(accelerator, "gradient_accumulation_steps", 1) != 1:
        raise ValueError(
            f"attach: gradient_accumulation_steps={accelerator.gradient_accumulation_steps} is not supported: the "
            "sync runs once per optimizer step on the whole gradient; use 1 (a larger batch)"
        )
    config = getattr(accelerator, "project_configuration", None)
    if getattr(config, "save_on_each_node", False):
        raise ValueError(
            "attach: save_on_each_node=True is not supported: every rank's compression state is gathered on the "
            "first process, which the other nodes' copies would lack; save on the main process only"
        )
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "DEEPSPEED" in kind or "FSDP" in kind:
        raise ValueError(f"attach: {kind} shards the gradients DGC compresses; use plain DDP (MULTI_GPU/MULTI_CPU)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(sync, dgc.ddp_comm_hook)
    elif sync.world_size > 1:
        raise ValueError(
            f"attach: {sync.world_size} processes run but the model is a {type(model).__name__}, not the "
            f"DistributedDataParallel model accelerator.prepare makes (Accelerate sees {kind or 'no distribution'}; "
            "without a GPU pass Accelerator(cpu=True)), or attach was given the model from before prepare"
        )
    state = EveryRank(sync)
    accelerator.register_for_checkpointing(state)
    return state


__all__ = ["attach"]
