"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation with error feedback.

Per matrix-shaped gradient M (viewed as ``shape[0] x rest``) and step:

1. ``M = g + e`` (error feedback);
2. ``P = M Q`` with Q from the previous step (warm start; random at first, the
   same on every worker);
3. allreduce-average all P at once; orthonormalize each P;
4. ``Q = M^T P``; allreduce-average all Q at once;
5. the update is ``P Q^T``; ``e = M - P Q^T``.

Tensors for which rank r would not save bytes (``r (n + m) >= n m``) are averaged
dense in the same allreduce as P. Two collectives per step, in the same order on
every worker (PyTorch's own PowerSGD hook chains them from future callbacks and
crashes under gloo).

The matrices live in one flat bucket (:mod:`dgc.bucket`) ordered by shape, so that the matrices of
one shape are one ``[count, n, m]`` view and each product and orthonormalization is one batched
operation per shape (ResNet-50's 54 matrices have 21 shapes; ResNet-101's 105 the same 21), and
error feedback is one operation over the bucket. The Ps, the dense tensors and the Qs are written
into persistent message buffers through views made once per layout; ``state[name]["q"]`` and
``["error"]`` are views of those buffers (saved per parameter name as before).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dgc import seeding
from dgc.bucket import Bucket, Buckets, Layout
from dgc.collectives import AllreduceMean, Steps
from dgc.compressors.base import Compressor, CompressorConfig, Item, check_int, register
from dgc.memory import Memory, Residual
from dgc.timing import Phases


@dataclass
class PowerSGDConfig(CompressorConfig):
    name: str = "powersgd"
    #: rank r of the approximation
    rank: int = 4
    error_feedback: bool = True
    #: start each step's power iteration from the last Q
    warm_start: bool = True
    #: seed of the first Q (the same on every worker)
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self.rank, "rank", 1)


def _matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    return _dims(t.shape)


def _dims(shape: torch.Size) -> tuple[int, int]:
    """A tensor of ``shape`` as a matrix: its first dimension by the rest."""
    n = shape[0] if len(shape) > 0 else 1
    return n, shape.numel() // max(n, 1)


@register
class PowerSGD(Compressor):
    name: ClassVar[str] = "powersgd"
    config_class = PowerSGDConfig
    config: PowerSGDConfig
    shardable: ClassVar[bool] = False

    def __init__(self, config: PowerSGDConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.rank_r = self.config.rank
        self.error_feedback = bool(self.config.error_feedback)
        self.warm_start = bool(self.config.warm_start)
        self.seed = int(self.config.seed)
        self.buckets = Buckets()
        #: the plan of each set of tensors (the overlapped hook's parts each have theirs), by their names
        self._plans: dict[tuple[tuple[str, ...], tuple[str, ...]], _Plan] = {}

    def _low_rank(self, item: Item) -> bool:
        n, m = _matrix_shape(item.grad)
        r = min(self.rank_r, n, m)
        return item.grad.dim() > 1 and r * (n + m) < n * m

    def _initial_q(self, name: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        # same seed on every worker, different per tensor
        gen = seeding.generator(self.seed, zlib.crc32(name.encode()))
        # drawn on the CPU from a CPU generator (the same numbers whatever the device), then moved there
        return torch.randn(m, r, generator=gen, device="cpu").to(like.device, like.dtype)

    def _plan(self, low: list[Item], dense: list[Item]) -> _Plan:
        """The buffers and views of these tensors (made again when they change), with the state adopted."""
        bucket = self.buckets.of("powersgd", low) if low else None
        dense_layout = Layout.of(dense) if dense else None
        if bucket is not None and self.error_feedback:
            bucket.adopt(self.state, self.memory.keys)  # before the plan: its matrices are views of the error
        key = (bucket.layout.names if bucket else (), dense_layout.names if dense_layout else ())
        plan = self._plans.get(key)
        if plan is None or plan.bucket is not bucket or plan.dense_layout != dense_layout:
            names = set(key[0]) | set(key[1])  # a plan holding any of these tensors is stale (DDP's bucket rebuild)
            for other in [k for k in self._plans if k != key and names.intersection(k[0] + k[1])]:
                del self._plans[other]
            plan = self._plans[key] = _Plan(bucket, dense_layout, self.rank_r, self)
        if bucket is not None:
            plan.adopt_q(self)
        return plan

    def make_memory(self) -> Memory:
        return Residual("error")

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        if not items:
            return
        low = [it for it in items if self._low_rank(it)]
        dense = [it for it in items if not self._low_rank(it)]
        # the matrices of one shape side by side (stable: first appearance, then item order)
        shapes: dict[tuple[int, int], int] = {}
        low.sort(key=lambda it: shapes.setdefault(_matrix_shape(it.grad), len(shapes)))
        with phases("compress"):
            plan = self._plan(low, dense)
            if low:
                g = plan.bucket.gather(low)
                if self.error_feedback:  # M = g + e, in the error buffer (the plan's matrices are its views)
                    self.memory.compensate(g, plan.bucket.buffers)
                if not self.warm_start:
                    plan.q.copy_(plan.q0)
                for g in plan.groups:
                    torch.bmm(g.m, g.q, out=g.p)
            if dense:
                torch._foreach_copy_(plan.dense_views, [it.grad for it in dense])
        yield AllreduceMean(plan.first)
        if low:
            with phases("compress"):
                for g in plan.groups:
                    torch.linalg.qr(g.p, out=(g.p_orth, g.r))
                    torch.bmm(g.m_t, g.p_orth, out=g.q)
        if dense:
            torch._foreach_copy_([it.grad for it in dense], plan.dense_views)
        if low:
            yield AllreduceMean(plan.q)
            with phases("decompress"):
                for g in plan.groups:
                    torch.bmm(g.p_orth, g.q_t, out=g.approx)
                if self.error_feedback:  # e = M - P Q^T
                    self.memory.update(plan.bucket.buffers, plan.scratch)
                torch._foreach_copy_([it.grad for it in low], plan.approx_views)
            phases.counters["values_sent"] += plan.p_numel + plan.q.numel()


@dataclass(frozen=True)
class _Group:
    """The matrices of one shape: ``count`` of ``n x m``, rank ``r``; views of the plan's buffers."""

    m: torch.Tensor  # [count, n, m] of the bucket's gradient
    m_t: torch.Tensor  # its transpose [count, m, n]
    p: torch.Tensor  # [count, n, r] in the first message
    p_orth: torch.Tensor  # [count, n, r]
    r: torch.Tensor  # [count, r, r] (QR's triangle, unused)
    q: torch.Tensor  # [count, m, r] in the second message (the warm start)
    q_t: torch.Tensor  # [count, r, m]
    approx: torch.Tensor  # [count, n, m] of the scratch buffer


class _Plan:
    """Message buffers and their views for one layout: the first message holds every P (by shape group) then
    the dense tensors; the second every Q; ``q0`` the first Qs (for ``warm_start=False``)."""

    def __init__(self, bucket: Bucket | None, dense_layout: Layout | None, rank: int, comp: PowerSGD) -> None:
        self.bucket, self.dense_layout = bucket, dense_layout
        layout = bucket.layout if bucket is not None else dense_layout
        dtype, device = layout.dtype, layout.device
        runs: list[list[int]] = []  # [n, m, count] of consecutive matrices of one shape, in bucket order
        for shape in bucket.layout.shapes if bucket else ():
            n, m = _dims(shape)
            if runs and runs[-1][:2] == [n, m]:
                runs[-1][2] += 1
            else:
                runs.append([n, m, 1])
        sizes = [(c, n, m, min(rank, n, m)) for n, m, c in runs]
        self.p_numel = sum(c * n * r for c, n, m, r in sizes)
        q_numel = sum(c * m * r for c, n, m, r in sizes)

        def empty(numel: int) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=device)

        self.first = empty(self.p_numel + (dense_layout.total if dense_layout else 0))
        self.q = empty(q_numel)
        self.q0 = empty(0 if comp.warm_start else q_numel)
        self.scratch = empty(bucket.layout.total if bucket else 0)
        p_orth, r_buf = empty(self.p_numel), empty(sum(c * r * r for c, n, m, r in sizes))
        self.groups: list[_Group] = []
        at_m = at_p = at_q = at_r = 0
        # the matrices M: the error buffer, where error feedback makes g + e, or the gradient
        matrices = (bucket.buffers["error"] if comp.error_feedback else bucket.grad) if bucket else None
        for c, n, m, r in sizes:
            mm = matrices[at_m : at_m + c * n * m].view(c, n, m)
            qq = self.q[at_q : at_q + c * m * r].view(c, m, r)
            self.groups.append(_Group(
                mm, mm.transpose(1, 2), self.first[at_p : at_p + c * n * r].view(c, n, r),
                p_orth[at_p : at_p + c * n * r].view(c, n, r), r_buf[at_r : at_r + c * r * r].view(c, r, r),
                qq, qq.transpose(1, 2), self.scratch[at_m : at_m + c * n * m].view(c, n, m),
            ))  # fmt: skip
            at_m, at_p, at_q, at_r = at_m + c * n * m, at_p + c * n * r, at_q + c * m * r, at_r + c * r * r
        #: per low-rank tensor, in bucket order: its Q (m x r) in :attr:`q` and :attr:`q0`, its approximation
        self.q_views = [q for g in self.groups for q in g.q.unbind(0)]
        self.q0_views = [q for q in self.q0.split([q.numel() for q in self.q_views])] if self.q0.numel() else []
        self.approx_views = bucket.shaped(self.scratch) if bucket else []
        self.dense_views = (
            [self.first[self.p_numel + o : self.p_numel + o + k].view(s)
             for o, k, s in zip(dense_layout.offsets, dense_layout.numels, dense_layout.shapes)]
            if dense_layout else []
        )  # fmt: skip

    def adopt_q(self, comp: PowerSGD) -> None:
        """Make ``state[name]["q"]`` the views of :attr:`q`: a saved Q of the right shape is copied in (warm start),
        a missing one starts from the tensor's seeded random Q. Cheap when they already are its views."""
        for i, (name, view) in enumerate(zip(self.bucket.layout.names, self.q_views)):
            slot = comp.state.setdefault(name, {})
            old = slot.get("q")
            if old is view:
                continue
            if old is None or old.shape != view.shape or not comp.warm_start:
                old = comp._initial_q(name, view.shape[0], view.shape[1], view)
            view.copy_(old)
            if not comp.warm_start:
                self.q0_views[i].copy_(view.reshape(-1))
            slot["q"] = view
