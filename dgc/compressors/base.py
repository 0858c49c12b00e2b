"""The compressor interface shared by every method.

A compressor receives the gradients of the tensors it handles (one :class:`Item`
each, the same tensors in the same order on every worker), issues its
collectives through a :class:`~dgc.comm.Comm` and writes the averaged
(decompressed) gradient back into ``item.grad`` in place. Per-tensor state
(residuals, momenta, error buffers) is keyed by parameter name so that it can be
saved and restored whatever the bucketing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc.comm import Comm
from dgc.timing import Phases


@dataclass
class Item:
    """One tensor to exchange: its gradient is read and overwritten in place."""

    name: str
    param: torch.Tensor
    grad: torch.Tensor
    momentum: float = 0.0
    nesterov: bool = False


class Compressor:
    """Base class. Subclasses set ``name`` and implement :meth:`exchange`."""

    name: ClassVar[str] = ""
    #: True for compressors that apply to every tensor (dense baselines): the
    #: sparse/dense policy does not apply to them.
    handles_all_tensors: ClassVar[bool] = False

    def __init__(self) -> None:
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.epoch = 0.0
        self.rank = 0
        self.world_size = 1

    # -- lifecycle ---------------------------------------------------------------
    def bind(self, comm: Comm) -> None:
        """Called once with the communicator, before the first exchange."""
        self.rank, self.world_size = comm.rank, comm.world_size

    def set_epoch(self, epoch: float) -> None:
        self.epoch = float(epoch)

    @property
    def owns_momentum(self) -> bool:
        """True when the exchanged gradient already includes momentum (DGC's momentum correction)."""
        return False

    def density(self) -> float:
        """Fraction of values selected for sending now (1.0 for dense methods)."""
        return 1.0

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        raise NotImplementedError

    # -- state -------------------------------------------------------------------
    def tensor_state(self, item: Item, *keys: str) -> list[torch.Tensor]:
        """Per-tensor buffers (zeros at first use), created like ``item.grad`` (flat)."""
        slot = self.state.setdefault(item.name, {})
        out = []
        for key in keys:
            buf = slot.get(key)
            if buf is None or buf.numel() != item.grad.numel():
                buf = torch.zeros(item.grad.numel(), dtype=item.grad.dtype, device=item.grad.device)
                slot[key] = buf
            elif buf.device != item.grad.device or buf.dtype != item.grad.dtype:
                buf = slot[key] = buf.to(device=item.grad.device, dtype=item.grad.dtype)
            out.append(buf)
        return out

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "epoch": self.epoch,
            "tensors": {n: {k: t.detach().clone() for k, t in s.items()} for n, s in self.state.items()},
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state is for compressor {state.get('name')!r}, not {self.name!r}")
        self.epoch = float(state["epoch"])
        self.state = {n: {k: t.clone() for k, t in s.items()} for n, s in state["tensors"].items()}
        self.load_extra_state(state.get("extra", {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    return gen


def flat_views(items: list[Item]) -> list[torch.Tensor]:
    return [it.grad.view(-1) for it in items]


def copy_back(items: list[Item], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` into each item's gradient."""
    pos = 0
    for it in items:
        n = it.grad.numel()
        it.grad.view(-1).copy_(flat[pos : pos + n])
        pos += n
