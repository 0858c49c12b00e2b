"""Selecting the largest-magnitude entries of a flat tensor.

Selectors, all returning ascending int64 positions:

* :func:`exact_topk` -- ``torch.topk`` on ``|x|``; the reference and the fallback
  for small tensors.
* :func:`sampled_select` -- DGC's threshold-by-sampling selection:

  1. take ``num_samples = max(ceil(n * sample_ratio), ceil(2 / density))`` entries
     of ``|x|`` with a fixed stride and a random start;
  2. the threshold is the ``ceil(num_samples * density)``-th largest sample;
  3. count the entries with ``|x| >= threshold``. Fewer than ``lower_bound * k``:
     lower the threshold by ``0.8`` and count again, at most ``max_adaptations``
     times. More than ``k``: keep the ``k`` largest of the candidates (an exact
     top-k on the candidates only; the authors' code kept the lowest-index ones
     when 1x-1.3x the target passed, which this fixes).

  The result is always "the m largest entries of |x|" for some ``m <= k``;
  ``m >= lower_bound * k`` whenever the adaptation succeeded.
* :func:`threshold_select` -- the same with a given threshold (DGC reuses the
  previous step's threshold, see :class:`dgc.compressors.DGC`): accepted only when
  the count lies in ``[lower_bound * k, upper_bound * k]``, then the same "keep the
  k largest" rule, so the guarantee above holds for reused thresholds too.

Tensors with ``n <= 2 / density`` (fewer samples than the sample size) use exact
top-k; ``k >= n`` sends everything.

Counting never materializes ``|x|`` when the native kernel (:mod:`dgc.kernels`) is
available: one pass compares, counts and collects the positions that pass. Without
it, ``|x|`` goes into a reused buffer and the positions come from the mask with
:func:`mask_positions`, which avoids ``mask.nonzero()`` on a bool tensor (slow on CPU): it
finds the non-zero 8-byte words of the mask first and expands only those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgc import kernels


def target_count(numel: int, density: float) -> int:
    """Number of entries to send: ``ceil(numel * density)``, between 1 and numel."""
    return max(1, min(numel, math.ceil(numel * density - 1e-12)))


def exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the ``k`` largest ``|x|`` (x is 1-D)."""
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return torch.sort(idx).values


def mask_positions(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """Ascending positions of True entries of a bool tensor whose length is a multiple of 8.

    Entries at and beyond ``numel`` must be False.
    """
    words = mask.view(torch.int64)
    hot = torch.nonzero(words).view(-1)
    rows, cols = torch.nonzero(mask.view(-1, 8)[hot], as_tuple=True)
    return hot[rows] * 8 + cols


def candidate_capacity(k: int) -> int:
    """How many candidate positions the native kernel collects (per thread) before falling back to a mask."""
    return max(32 * k, 4096)


def keep_largest(x: torch.Tensor, idx: torch.Tensor, k: int) -> torch.Tensor:
    """Of the ascending candidate positions ``idx``, the (ascending) ``k`` with the largest ``|x|``."""
    n = idx.numel()
    if n <= k:
        return idx
    mag = x[idx].abs()
    if n - k < k:
        # few too many (the dense warm-up stages: 503,090 candidates for k = 500,000): dropping the n - k
        # smallest is a far smaller top-k, and the mask keeps the positions ascending without a sort
        keep = torch.ones(n, dtype=torch.bool, device=idx.device)
        keep[torch.topk(mag, n - k, largest=False, sorted=False).indices] = False
        return idx[keep]
    keep = torch.topk(mag, k, sorted=False).indices
    return torch.sort(idx[keep]).values


@dataclass
class SelectInfo:
    """What one selection did: useful for tests and statistics."""

    k: int
    selected: int
    candidates: int = 0
    adaptations: int = 0
    exact: bool = False
    #: the threshold finally used (None for exact top-k)
    threshold: float | None = None
    #: True when a given (reused) threshold was accepted without sampling
    reused: bool = False


class Scratch:
    """Reusable work buffers (|x|, a mask, the kernel's position buffers), grown to the largest tensor seen."""

    def __init__(self) -> None:
        self._abs: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self.kernel = kernels.Buffers()

    def get(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = (numel + 7) // 8 * 8
        if (
            self._abs is None
            or self._abs.numel() < padded
            or self._abs.device != like.device
            or self._abs.dtype != like.dtype
        ):
            self._abs = torch.empty(padded, dtype=like.dtype, device=like.device)
            self._mask = torch.zeros(padded, dtype=torch.bool, device=like.device)
        assert self._mask is not None
        mask = self._mask[:padded]
        mask[numel:] = False
        return self._abs[:numel], mask


def use_kernel(x: torch.Tensor) -> bool:
    """Whether counting on ``x`` goes through the native kernel."""
    return x.numel() >= kernels.MIN_NUMEL and kernels.usable(x)


class Candidates:
    """Entries with ``|x| >= threshold``: their count now, their positions on demand."""

    def __init__(self, x: torch.Tensor, threshold: torch.Tensor | float, capacity: int, scratch: Scratch):
        self.x, self.scratch = x, scratch
        self.threshold = threshold
        self._positions: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        if use_kernel(x):
            self.count, self._positions = kernels.acc_select(
                x, float(threshold), capacity, mode=kernels.COMPARE, buffers=scratch.kernel
            )
        else:
            self._count_with_mask()

    @classmethod
    def known(cls, x: torch.Tensor, threshold: float, count: int, positions: torch.Tensor | None, scratch: Scratch):
        """Candidates already counted (by the fused accumulate-and-count kernel)."""
        self = cls.__new__(cls)
        self.x, self.scratch, self.threshold = x, scratch, threshold
        self.count, self._positions, self._mask = count, positions, None
        return self

    def _count_with_mask(self) -> None:
        n = self.x.numel()
        mag, mask = self.scratch.get(n, self.x)
        torch.abs(self.x, out=mag)
        torch.ge(mag, self.threshold, out=mask[:n])
        self.count = int(torch.count_nonzero(mask))
        self._mask = mask

    def positions(self) -> torch.Tensor:
        """Ascending positions of all candidates (uses the scratch mask: call before the next count)."""
        if self._positions is None:
            if self._mask is None:  # the kernel's buffers overflowed: count again with a mask
                self._count_with_mask()
            assert self._mask is not None
            self._positions = mask_positions(self._mask, self.x.numel())
        return self._positions


def threshold_select(
    x: torch.Tensor,
    k: int,
    threshold: float,
    *,
    lower_bound: float = 0.8,
    upper_bound: float = 1.3,
    scratch: Scratch | None = None,
    candidates: Candidates | None = None,
) -> tuple[torch.Tensor | None, SelectInfo]:
    """Select with a given threshold if ``lower_bound * k <= count <= upper_bound * k``, else return None."""
    scratch = scratch or Scratch()
    if candidates is None:
        candidates = Candidates(x, threshold, math.ceil(upper_bound * k) + 1, scratch)
    count = candidates.count
    info = SelectInfo(k=k, selected=0, candidates=count, threshold=float(threshold))
    if not lower_bound * k <= count <= upper_bound * k:
        return None, info
    idx = keep_largest(x, candidates.positions(), k)
    info.selected, info.reused = idx.numel(), True
    return idx, info


@dataclass(frozen=True)
class SamplingPlan:
    """Where :func:`sampled_select` samples a tensor of ``n`` entries: ``x[start::stride][:num_samples]``."""

    n: int
    k: int
    num_samples: int
    stride: int
    k_sample: int

    def draw_start(self, generator: torch.Generator | None) -> int:
        # a host value from a CPU generator: the same start on every device, no device sync
        return int(torch.randint(self.stride, (1,), generator=generator, device="cpu").item())

    def positions(self, start: int) -> slice:
        return slice(start, start + self.stride * (self.num_samples - 1) + 1, self.stride)

    def threshold(self, sample_abs: torch.Tensor) -> torch.Tensor:
        """The ``k_sample``-th largest of the sampled magnitudes (a 0-d tensor)."""
        return torch.topk(sample_abs, self.k_sample, sorted=False).values.min()


def sampling_plan(n: int, density: float, sample_ratio: float) -> SamplingPlan | None:
    """The sample :func:`sampled_select` takes, or None when it uses exact top-k instead."""
    k = target_count(n, density)
    num_samples = max(math.ceil(n * sample_ratio), math.ceil(2.0 / density))
    if k >= n or num_samples >= n:
        return None
    return SamplingPlan(n, k, num_samples, n // num_samples, max(1, math.ceil(num_samples * density)))


def adapt_threshold(
    x: torch.Tensor,
    k: int,
    threshold: torch.Tensor | float,
    *,
    lower_bound: float = 0.8,
    max_adaptations: int = 10,
    scratch: Scratch | None = None,
    first: Candidates | None = None,
    adaptations: int = 0,
) -> tuple[Candidates, torch.Tensor | float, int]:
    """Count ``|x| >= threshold``; while fewer than ``lower_bound * k`` pass, lower it by 0.8 (at most
    ``max_adaptations`` times in all). ``first``: the count at ``threshold``, when already made, after
    ``adaptations`` lowerings. Returns ``(candidates, final threshold, adaptations)``."""
    scratch = scratch or Scratch()
    # the positions buffers hold many times k (a lowered threshold can let 5-10x k through);
    # more candidates than that are rare and use the mask
    capacity = candidate_capacity(k)
    found = first if first is not None else Candidates(x, threshold, capacity, scratch)
    while found.count < lower_bound * k and adaptations < max_adaptations:
        threshold = threshold * 0.8
        adaptations += 1
        found = Candidates(x, threshold, capacity, scratch)
    return found, threshold, adaptations


def sampled_select(
    x: torch.Tensor,
    density: float,
    *,
    sample_ratio: float = 0.01,
    lower_bound: float = 0.8,
    max_adaptations: int = 10,
    generator: torch.Generator | None = None,
    scratch: Scratch | None = None,
    sample: Callable[[slice], torch.Tensor] | None = None,
    first_count: Callable[[torch.Tensor], Candidates] | None = None,
) -> tuple[torch.Tensor, SelectInfo]:
    """DGC's sampled-threshold selection on a 1-D tensor (see the module docstring).

    ``sample(where)`` returns ``|x[where]|`` and ``first_count(threshold)`` the first count; by
    default both read ``x`` as it is. A caller that is about to update ``x`` in place (DGC's
    accumulation) passes both to sample the values it will write and to update and count in one
    pass; ``x`` must hold the updated values once ``first_count`` returns.
    """
    plan = sampling_plan(x.numel(), density, sample_ratio)
    if plan is None:
        k = target_count(x.numel(), density)
        idx = exact_topk(x, k)
        return idx, SelectInfo(k=k, selected=idx.numel(), candidates=idx.numel(), exact=True)
    where = plan.positions(plan.draw_start(generator))
    threshold = plan.threshold(sample(where) if sample is not None else x[where].abs())
    found, threshold, adaptations = adapt_threshold(
        x,
        plan.k,
        threshold,
        lower_bound=lower_bound,
        max_adaptations=max_adaptations,
        scratch=scratch,
        first=first_count(threshold) if first_count is not None else None,
    )
    return finish(x, plan.k, found, threshold, adaptations)


def finish(
    x: torch.Tensor, k: int, found: Candidates, threshold: torch.Tensor | float, adaptations: int
) -> tuple[torch.Tensor, SelectInfo]:
    """Keep the k largest candidates; the :class:`SelectInfo` of the selection."""
    idx = keep_largest(x, found.positions(), k)
    info = SelectInfo(
        k=k, selected=idx.numel(), candidates=found.count, adaptations=adaptations, threshold=float(threshold)
    )
    return idx, info
