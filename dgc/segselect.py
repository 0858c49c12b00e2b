"""DGC's per-tensor sampled selection, computed for all tensors of a flat bucket at once.

:func:`dgc.select.sampled_select` selects one tensor at a time: a few dozen operations and several host reads
per tensor (the count after each threshold, the sizes of the positions), which a GPU pays as a kernel launch
each and a drained stream each. Here the same selection, the same per-tensor ``k`` and threshold, is computed
segment-wise on a :class:`~dgc.bucket.Bucket` in a number of operations that does not grow with the number of
tensors, and with two host reads per step (the size of the candidate set, then every tensor's counts and
thresholds in one small tensor):

1. **Samples.** Every tensor's starts are drawn on the CPU generator exactly as the per-tensor path draws them
   (:func:`draw_starts`), the samples of all tensors are gathered with one ``take`` into one 2-D tensor (a row
   per tensor, padded with -1), and one sort of the rows gives every threshold (the ``k_sample``-th largest of
   the row) and, for each of the ``max_adaptations + 1`` thresholds ``thr * 0.8**j`` a tensor may end at, how
   many of its samples pass.
2. **Candidates.** Each tensor compares with the lowest of its thresholds its sample predicts it may need (the
   first ``j >= 1`` whose sample count is at least :data:`MARGIN` times ``k_sample``, capped at
   ``max_adaptations``): one comparison with the thresholds expanded over the bucket and one ``nonzero``.
3. **The adaptation, replayed.** From the candidates' magnitudes the count at every level of every tensor
   follows (one ``index_add_``); each tensor's level is the first one the per-tensor loop would have stopped
   at (count >= ``lower_bound * k``, or ``max_adaptations``). A tensor whose level lies below the candidates
   it has (its sample was misleading: rare) makes the step compare once more with lower thresholds for it.
4. **Keep the k largest** of each tensor's candidates at its level (two stable sorts order them by tensor and
   magnitude), and, for the gap coding of :mod:`dgc.wire`, each kept entry's gap to the previous one of its
   tensor, so that the message's size is known with the counts.

The result equals the per-tensor path's: the same thresholds (a threshold is a sampled value, and lowering it
is the same float32 multiplication), the same counts, and the same sent entries; the one freedom is which of
several entries of exactly equal magnitude at the k-th place is kept (``torch.topk`` does not say either).
Tensors too small to sample (``num_samples >= n``) are a row of their own holding all their entries with
``k_sample = k``: exact top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgc.bucket import Bucket
from dgc.select import sampling_plan, target_count
from dgc.wire import ESCAPE_GAP

#: ``torch.randint(0, high)`` on a CPU generator uses one 32-bit draw per value, ``V % high``, while
#: ``high < 2**28`` (a 64-bit draw above): tests/test_segselect.py checks it against the pinned PyTorch
ONE_WORD_LIMIT = 2**28
#: where the plans' constants are built and the starts drawn (the generator is a CPU one)
HOST = "cpu"
#: the candidates are collected at the first threshold where a tensor's sample has MARGIN times k_sample entries
MARGIN = 3
#: the thresholds computed at first: ``thr * 0.8**j`` for j up to this (the rest when a tensor needs them)
FIRST_LEVELS = 4


@dataclass(frozen=True)
class _Draws:
    """Consecutive sampled tensors whose starts one ``randint`` draws: ``high`` a multiple of every stride."""

    high: int
    strides: torch.Tensor  # CPU int64


class Plan:
    """Where each tensor of a bucket is sampled at one density (host constants and their device tensors)."""

    def __init__(self, bucket: Bucket, density: float, sample_ratio: float, lower_bound: float, max_adaptations: int):
        layout = bucket.layout
        device = layout.device
        self.T = len(layout)
        self.levels = max_adaptations + 1
        ks, k, sampled, strides, base, rows, exact_base, exact_rows = [], [], [], [], [], [], [], []
        for t, (n, off) in enumerate(zip(layout.numels, layout.offsets)):
            plan = sampling_plan(n, density, sample_ratio)
            k.append(target_count(n, density))
            if plan is None:  # exact top-k: the whole tensor is the row
                ks.append(k[-1])
                sampled.append(False)
                exact_base.append(torch.arange(off, off + n, device=HOST))
                exact_rows.append(torch.full((n,), t, device=HOST))
            else:
                ks.append(plan.k_sample)
                sampled.append(True)
                strides.append(plan.stride)
                base.append(off + plan.stride * torch.arange(plan.num_samples, device=HOST))
                rows.append(torch.full((plan.num_samples,), t, device=HOST))
        self.k = k
        self.sampled = sampled
        self.num_sampled = len(strides)
        self.draws = _group_draws(strides)
        counts = [b.numel() for b in base]
        self.samples_sampled = sum(counts)
        all_rows = torch.cat(rows + exact_rows)
        width = max(counts + [b.numel() for b in exact_base])
        self.width = width
        # position of each sample in the [T, width] matrix: its row, then its place in the row
        col = torch.cat([torch.arange(c, device=HOST) for c in counts + [b.numel() for b in exact_base]])
        self.dest = (all_rows * width + col).to(device)
        self.base_sampled = (torch.cat(base) if base else torch.zeros(0, dtype=torch.int64, device=HOST)).to(device)
        self.base_exact = torch.cat(exact_base).to(device) if exact_base else None
        self.samples_per_tensor = torch.tensor(counts, dtype=torch.int64, device=device)
        ks_t = torch.tensor(ks, dtype=torch.int64, device=HOST)
        self.kth = (width - ks_t).view(-1, 1).to(device)  # column of the k_sample-th largest in an ascending row
        #: a level has enough samples above it when fewer than this many lie below it
        self.sample_limit = (width - MARGIN * ks_t).view(-1, 1).to(device)
        self.k_t = torch.tensor(k, dtype=torch.int64, device=device)
        self.need = torch.tensor([lower_bound * x for x in k], dtype=torch.float64, device=device).view(-1, 1)
        self.sampled_t = torch.tensor(sampled, dtype=torch.bool, device=device)
        self.t_index = torch.arange(self.T, device=device)

    def starts(self, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """This step's sampling starts of the sampled tensors (on ``device``), drawn as the per-tensor path draws."""
        parts = [
            torch.randint(0, d.high, (d.strides.numel(),), generator=generator, device=HOST) % d.strides
            for d in self.draws
        ]
        starts = parts[0] if len(parts) == 1 else torch.cat(parts)
        return starts.to(device)


def _group_draws(strides: list[int]) -> list[_Draws]:
    """Cut the tensors into runs whose strides' least common multiple stays below :data:`ONE_WORD_LIMIT`: one
    ``randint(0, lcm)`` per run, each value modulo its stride, is then exactly one ``randint(0, stride)`` per
    tensor (``V % lcm % stride == V % stride`` when the stride divides the lcm)."""
    out, run, high = [], [], 1
    for s in strides:
        joined = math.lcm(high, s)
        if run and joined >= ONE_WORD_LIMIT:
            out.append(_Draws(high, torch.tensor(run, dtype=torch.int64, device=HOST)))
            run, joined = [], s
        run.append(s)
        high = joined
    if run:
        out.append(_Draws(high, torch.tensor(run, dtype=torch.int64, device=HOST)))
    return out


@dataclass
class Selection:
    """What :func:`select` chose: the sent entries and, per tensor, what the host needs."""

    #: ascending positions in the bucket of the entries to send
    positions: torch.Tensor
    #: per sent entry, the gap to the previous sent entry of its tensor (the first: local position + 1)
    gaps: torch.Tensor
    #: per tensor: entries sent, delta16 words they take, the threshold used (None: exact top-k), adaptations
    counts: list[int]
    words: list[int]
    thresholds: list[float | None]
    adaptations: list[int]
    #: extra comparisons made because a tensor needed a threshold below its candidates (rare)
    retries: int = 0
    _tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def tensors(self) -> torch.Tensor:
        """Per sent entry, its tensor."""
        assert self._tensors is not None
        seg, at = self._tensors
        return seg[at]


def select(v: torch.Tensor, bucket: Bucket, plan: Plan, generator: torch.Generator | None) -> Selection:
    """DGC's selection of every tensor of ``bucket`` from its accumulator ``v`` (flat, the bucket's size)."""
    T, J = plan.T, plan.levels - 1
    # 1. the samples, one row per tensor, sorted: thresholds and sample counts per level
    idx = plan.base_sampled
    if plan.num_sampled:
        idx = idx + plan.starts(generator, v.device).repeat_interleave(
            plan.samples_per_tensor, output_size=plan.samples_sampled
        )
    if plan.base_exact is not None:
        idx = torch.cat([idx, plan.base_exact])
    rows = torch.full((T * plan.width,), -1.0, dtype=v.dtype, device=v.device)
    rows.index_copy_(0, plan.dest, v.take(idx).abs_())
    rows = rows.view(T, plan.width).sort(dim=1).values
    levels = [rows.gather(1, plan.kth)]  # [T, 1]: the k_sample-th largest sample
    known = min(J, FIRST_LEVELS)
    L = _lower(levels, known)
    if known:
        # samples below each level (non-increasing in j): the floor is the first j >= 1 with enough above it
        floor = (torch.searchsorted(rows, L) > plan.sample_limit).sum(1).clamp_(1, known).mul_(plan.sampled_t)
    else:
        floor = torch.zeros(T, dtype=torch.int64, device=v.device)
    retries = 0
    while True:
        # 2. candidates at each tensor's floor threshold
        low = L[plan.t_index, floor]
        P = (torch.abs(v) >= low.repeat_interleave(bucket.numels_t, output_size=v.numel())).nonzero().view(-1)
        seg = torch.searchsorted(bucket.ends_t, P, right=True)  # host read 1 (above): how many candidates
        mag = v[P].abs_()
        # 3. the count at every level (non-decreasing in j, exact up to the floor); the level the per-tensor
        # loop stops at: the first with enough, or the last one
        count = torch.zeros((T, known + 1), dtype=torch.int64, device=v.device)
        count.index_add_(0, seg, (mag.view(-1, 1) >= L[seg]).to(torch.int64))
        short = (count < plan.need).sum(1)
        level = torch.minimum(short, floor)
        fail = (short > floor) & (floor < J)
        final = L[plan.t_index, level]
        # 4. the k largest of each tensor's candidates at its level: by tensor, then by magnitude
        chosen = mag >= final[seg]
        order = torch.argsort(torch.where(chosen, mag, -1.0), descending=True, stable=True)
        order = order[torch.argsort(seg[order], stable=True)]
        seg_sorted = seg[order]
        rank = torch.arange(P.numel(), device=v.device) - torch.searchsorted(seg, plan.t_index)[seg_sorted]
        keep = torch.empty_like(chosen)
        keep[order] = chosen[order] & (rank < plan.k_t[seg_sorted])
        kept = torch.minimum(count[plan.t_index, level], plan.k_t)
        # gaps to the previous kept entry of the same tensor (positions ascend: the largest kept before it,
        # unless that lies in an earlier tensor)
        last = torch.where(keep, P, -1).cummax(0).values
        start = bucket.offsets_t[seg] - 1
        gaps = P - torch.maximum(torch.cat([start[:1], last[:-1]]), start)
        escapes = ((gaps > ESCAPE_GAP) & keep).any()
        info = torch.cat([kept, final.double(), level, fail.any().view(1), escapes.view(1)])
        host = info.tolist()  # host read 2: everything the host needs, in one small tensor
        if not host[-2]:
            break
        retries += 1  # a tensor needs a lower threshold than its candidates reach: compare again for it
        if known < J:
            known = J
            L = _lower([L], J - L.shape[1] + 1)
        floor = torch.where(fail, torch.clamp(floor + MARGIN, max=known), floor)
    counts = [int(c) for c in host[:T]]
    at = torch.argsort((~keep).to(torch.uint8), stable=True)[: sum(counts)]  # the kept ones, ascending
    gaps = gaps[at]
    if host[-1]:  # a gap needs escape words (rare): how many, per tensor
        extra = torch.zeros(T, dtype=torch.int64, device=v.device).index_add_(
            0, seg[at], torch.div(gaps - 1, ESCAPE_GAP, rounding_mode="floor")
        )
        words = [c + int(e) for c, e in zip(counts, extra.tolist())]
    else:
        words = counts
    return Selection(
        positions=P[at],
        gaps=gaps,
        counts=counts,
        words=words,
        thresholds=[th if s else None for th, s in zip(host[T : 2 * T], plan.sampled)],
        adaptations=[int(a) for a in host[2 * T : 3 * T]],
        retries=retries,
        _tensors=(seg, at),
    )


def _lower(levels: list[torch.Tensor], more: int) -> torch.Tensor:
    """``more`` further columns, each the last one times 0.8 (the per-tensor loop's float32 multiplications, in
    its order), joined: ``[T, columns]``."""
    for _ in range(more):
        levels.append(levels[-1][:, -1:] * 0.8)
    return levels[0] if len(levels) == 1 else torch.cat(levels, 1)
