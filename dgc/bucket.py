"""Flat buckets: the tensors a compressor handles laid end to end in one buffer per kind of state.

A :class:`Layout` is the order, names, shapes and sizes of the tensors of one exchange (the same on every
worker); a :class:`Bucket` holds, for one layout, flat buffers (the gradient, and whatever per-tensor state a
compressor keeps: DGC's momentum ``u`` and accumulator ``v``) with every tensor's part as a view. Work that
was one operation per tensor becomes one operation per bucket: copying the gradients in is one
``_foreach_copy_``, the momentum update is two operations over the whole bucket, and a selection computed
segment-wise (:mod:`dgc.segselect`) touches the bucket with one comparison.

State stays keyed by parameter name: :meth:`Bucket.adopt` copies existing per-tensor buffers (a checkpoint just
loaded, or the per-tensor path's) into the bucket and replaces them by views of it, so a compressor's
``state[name][key]`` is a view of the bucket while the bucket is in use and a checkpoint saves the same
per-name tensors whichever path made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dgc.compressors.base import Item


@dataclass(frozen=True)
class Layout:
    """The tensors of one exchange, in order: names, shapes, sizes and where each starts in the flat space."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, items: list[Item]) -> Layout:
        numels = tuple(it.grad.numel() for it in items)
        offsets, pos = [], 0
        for n in numels:
            offsets.append(pos)
            pos += n
        first = items[0].grad
        return cls(tuple(it.name for it in items), tuple(it.grad.shape for it in items), numels, tuple(offsets),
                   first.dtype, first.device)  # fmt: skip

    @property
    def total(self) -> int:
        return sum(self.numels)

    def __len__(self) -> int:
        return len(self.names)


class Bucket:
    """Flat buffers of one :class:`Layout` and each tensor's views of them (see the module docstring)."""

    def __init__(self, layout: Layout, multiple: int = 1):
        self.layout = layout
        device = layout.device
        #: the buffers' length: the layout's total, padded with zeros to a multiple of ``multiple`` (the padding is
        #: no tensor's: it stays zero in the gradient, which a gather never writes there)
        self.size = layout.total + (-layout.total % multiple)
        self.multiple = multiple
        self.grad = torch.zeros(self.size, dtype=layout.dtype, device=device)
        #: the gradient buffer's parts in the parameters' shapes (``_foreach_copy_`` in and out)
        self.grad_views = self.shaped(self.grad)
        self.buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        #: what a compressor derives from the layout and keeps with it (DGC: its sampling plans by density)
        self.plans: dict[Any, Any] = {}
        # per-tensor constants on the device, made once
        self.numels_t = torch.tensor(layout.numels, dtype=torch.int64, device=device)
        self.offsets_t = torch.tensor(layout.offsets, dtype=torch.int64, device=device)
        self.ends_t = self.offsets_t + self.numels_t

    def shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (a bucket-sized buffer), one per tensor, in its shape."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.layout.offsets, self.layout.numels, self.layout.shapes)]

    def flat_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n] for o, n in zip(self.layout.offsets, self.layout.numels)]

    def adopt(self, state: dict[str, dict[str, torch.Tensor]], keys: tuple[str, ...]) -> None:
        """Make ``state[name][key]`` views of this bucket's buffers, for every tensor and key: existing buffers
        (of the right size) are copied in, missing ones start at zero. Cheap when they already are its views."""
        for key in keys:
            buf = self.buffers.get(key)
            if buf is None:
                buf = self.buffers[key] = torch.zeros(self.size, dtype=self.layout.dtype,
                                                      device=self.layout.device)  # fmt: skip
                self._views[key] = self.flat_views(buf)
            for name, view in zip(self.layout.names, self._views[key]):
                slot = state.setdefault(name, {})
                old = slot.get(key)
                if old is view:
                    continue
                if old is not None and old.numel() == view.numel():
                    view.copy_(old.view(-1))
                else:
                    view.zero_()
                slot[key] = view

    def views(self, key: str) -> list[torch.Tensor]:
        return self._views[key]

    def gather(self, items: list[Item]) -> torch.Tensor:
        """The items' gradients copied into :attr:`grad` (one dispatch), which is returned."""
        torch._foreach_copy_(self.grad_views, [it.grad for it in items])
        return self.grad

    def scatter(self, items: list[Item], flat: torch.Tensor | None = None) -> None:
        """Copy ``flat`` (default: :attr:`grad`; another dtype is converted) back into the items' gradients."""
        if flat is not None and flat is not self.grad:
            self.grad.copy_(flat)
        torch._foreach_copy_([it.grad for it in items], self.grad_views)


class Buckets:
    """Buckets per kind of exchange (``key``) and set of tensors, made again when the tensors change.

    One exchange of all tensors uses one bucket per key. An overlapped exchange (:mod:`dgc.overlap`) calls the same
    compressor once per DDP bucket, each with other tensors: each keeps its own bucket, so no buffer is made again
    from step to step. A new bucket replaces those holding any of its tensors (DDP's bucket rebuild after its first
    step), so the buffers never hold a tensor twice."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, tuple[str, ...]], Bucket] = {}

    def __contains__(self, key: str) -> bool:
        return any(k == key for k, _ in self._by_key)

    def of(self, key: str, items: list[Item], multiple: int = 1) -> Bucket:
        """The bucket of ``key`` for these items (buffers padded to a multiple of ``multiple``)."""
        layout = Layout.of(items)
        slot = (key, layout.names)
        bucket = self._by_key.get(slot)
        if bucket is None or bucket.layout != layout or bucket.multiple != multiple:
            names = set(layout.names)
            for other in [s for s in self._by_key if s[0] == key and s != slot and names.intersection(s[1])]:
                del self._by_key[other]
            bucket = self._by_key[slot] = Bucket(layout, multiple)
        return bucket
