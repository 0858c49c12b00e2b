"""The compressor interface shared by every method, its configuration, and the registry.

A compressor receives the gradients of the tensors it handles (one :class:`Item` each, the same
tensors in the same order on every worker), encodes them, asks for the collectives it needs by yielding
them from :meth:`Compressor.steps` (:mod:`dgc.collectives`: whoever drives it, an exchange, owns the
communicator) and writes the averaged (decompressed) gradient back into ``item.grad`` in place.
Per-tensor state (residuals, momenta, error buffers) is keyed by parameter name so that it can be saved
and restored whatever the bucketing.

Each compressor owns a :class:`CompressorConfig` subclass: its options, their defaults and their
checks (``__post_init__``) in one place. The same dataclass is the Hydra schema of the
``compression`` config group, so a new compressor is its module (config + class, decorated with
:func:`register`), a ``conf/compression/<name>.yaml`` preset and its tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch

from dgc import seeding
from dgc.collectives import Steps, drive
from dgc.comm import Comm
from dgc.memory import Memory
from dgc.registry import Registry
from dgc.timing import Phases


@dataclass
class CompressorConfig:
    """Base of every compressor's options. ``name`` selects the compressor."""

    name: str = "???"

    def build(self) -> Compressor:
        """The compressor these options describe."""
        return compressor_class(self.name)(self)


def check_number(value: Any, what: str, low: float, high: float, *, low_open: bool = True, high_open: bool = False):
    """``value`` as a float when it is a number in the interval, else a ValueError naming the interval."""
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    message = f"{what} must be a number in {lo}{low:g}, {high:g}{hi}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(message)
    value = float(value)
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        raise ValueError(message)
    return value


def check_int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


@dataclass
class Item:
    """One tensor to exchange: its gradient is read and overwritten in place."""

    name: str
    param: torch.Tensor
    grad: torch.Tensor
    momentum: float = 0.0
    nesterov: bool = False


class Compressor:
    """Base class. Subclasses set ``name`` and ``config_class`` and implement :meth:`steps`.

    ``Compressor(config)`` or ``Compressor(**options)`` (options of ``config_class``).
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[CompressorConfig]] = CompressorConfig
    #: True for compressors that apply to every tensor (dense baselines): the
    #: sparse/dense policy does not apply to them.
    handles_all_tensors: ClassVar[bool] = False
    #: False for compressors that need each tensor whole (PowerSGD's matrices): the hierarchical exchange then
    #: gives each rank of a machine whole tensors instead of a contiguous part of the flattened ones
    shardable: ClassVar[bool] = True

    def __init__(self, config: CompressorConfig | None = None, **options: Any) -> None:
        if config is None:
            config = build_config(self.config_class, self.name, options)
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, not {type(config).__name__}")
        elif options:
            config = replace(config, **options)
        self.config = config
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        #: error feedback (:mod:`dgc.memory`), for the compressors that keep what they did not send
        self.memory: Memory = self.make_memory()
        self.epoch = 0.0
        self.rank = 0
        self.world_size = 1

    def make_memory(self) -> Memory:
        """This compressor's error feedback (the base: a :class:`~dgc.memory.Memory` without buffers, never called)."""
        return Memory()

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

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        """Encode the items' gradients, yield each collective needed (:mod:`dgc.collectives`) and receive its result,
        decode the average into ``item.grad``. The same collectives in the same order on every worker."""
        raise NotImplementedError
        yield  # a generator

    def exchange(self, items: list[Item], comm: Comm, phases: Phases) -> None:
        """:meth:`steps` with each collective run on ``comm`` at once."""
        drive(self.steps(items, phases), comm)

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

    def memory_buffers(self, item: Item) -> dict[str, torch.Tensor]:
        """The item's buffers of this compressor's error feedback (:attr:`memory`'s keys), as :meth:`tensor_state`."""
        keys = self.memory.keys
        return dict(zip(keys, self.tensor_state(item, *keys)))

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
        options = ", ".join(
            f"{f.name}={getattr(self.config, f.name)!r}" for f in fields(self.config) if f.name != "name"
        )
        return f"{type(self).__name__}({options})"


class Stochastic(Compressor):
    """A compressor that draws random numbers: one stream per worker, from ``(config.seed, rank)``, on the
    device of the gradients (no host copies on CUDA), saved with the compressor's state."""

    def __init__(self, config: CompressorConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.generator = seeding.generator(self.config.seed)  # type: ignore[attr-defined]

    def bind(self, comm: Comm) -> None:
        super().bind(comm)
        self.generator = seeding.generator(self.config.seed, comm.rank)  # type: ignore[attr-defined]

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The stream, moved to ``device`` (a new device type starts from the stream's seed there)."""
        if self.generator.device != device:
            state = self.generator.get_state() if self.generator.device.type == device.type else None
            gen = torch.Generator(device=device)
            if state is not None:
                gen.set_state(state)
            else:
                gen.manual_seed(seeding.mix(self.config.seed, self.rank))  # type: ignore[attr-defined]
            self.generator = gen
        return self.generator

    def extra_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        if "generator" in extra:
            self.generator.set_state(extra["generator"])


def flat_views(items: list[Item]) -> list[torch.Tensor]:
    return [it.grad.view(-1) for it in items]


def copy_back(items: list[Item], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` into each item's gradient."""
    pos = 0
    for it in items:
        n = it.grad.numel()
        it.grad.view(-1).copy_(flat[pos : pos + n])
        pos += n


# -- the registry -------------------------------------------------------------------
#: compressor classes by name (filled by :func:`register`; every module of this package is imported)
COMPRESSORS: Registry[type[Compressor]] = Registry("compressor")


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make ``cls`` buildable by its ``name`` (its config's ``name`` must default to it)."""
    default = next(f.default for f in fields(cls.config_class) if f.name == "name")
    if default != cls.name:
        raise TypeError(f"{cls.__name__}.config_class must default name to {cls.name!r}, not {default!r}")
    return COMPRESSORS.register(cls)


def compressor_class(name: str) -> type[Compressor]:
    return COMPRESSORS.pick(name)


def config_class(name: str) -> type[CompressorConfig]:
    return compressor_class(name).config_class


def compressor_options(name: str) -> list[str]:
    """The options compressor ``name`` accepts."""
    return [f.name for f in fields(config_class(name)) if f.name != "name"]


def build_config(cls: type[CompressorConfig], name: str, options: dict[str, Any]) -> CompressorConfig:
    """``cls(**options)``; unknown options raise a ValueError naming the valid ones."""
    valid = [f.name for f in fields(cls) if f.name != "name"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"compressor {name!r} has no option {', '.join(unknown)}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**options)


def make_config(name: str, **options: Any) -> CompressorConfig:
    """The config of compressor ``name`` with ``options`` (checked by the config's ``__post_init__``)."""
    return build_config(config_class(name), name, options)
