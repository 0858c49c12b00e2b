"""sync.pack (dgc.packing): the values left dense, and the agreement, travel in the compressor's own message, on real
gloo ranks.

Packed and unpacked from the same start must train to the same weights (up to rounding: the dense average is a sum
in another order), agree exactly across ranks, send the same bytes, and issue one (``dense``) or two (``all``)
collectives fewer per step; with the agreement in the message a non-finite gradient on one rank still skips the step
on every rank with nothing changed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import dgc
from dgc.collectives import Allgather, AllgatherBytes, AllreduceMax, AllreduceMean, Steps
from dgc.compressors.base import Compressor, CompressorConfig, Item
from dgc.packing import carry
from dgc.sync import PACKS
from dgc.sync.config import SyncConfig
from dgc.timing import Phases
from tests.multiproc import run
from tests.test_sync_dist import local_backward, make_model, params, train_loop

#: every compressor, at settings small enough for the test model's tensors to send something every step, and DGC's
#: chunk selection (a fixed-size allgather): label -> (compressor, options)
CASES = {name: (name, {}) for name in dgc.COMPRESSORS} | {
    "topk": ("topk", {"density": 0.05}), "dgc": ("dgc", {"density": 0.05, "seed": 1}),
    "powersgd": ("powersgd", {"rank": 2}),
    "demo": ("demo", {"tile": 8}), "sparseloco": ("sparseloco", {"chunk_size": 8}),
    "dgc_chunk": ("dgc", {"density": 0.05, "selection": "chunk", "chunk_size": 16}),
}  # fmt: skip


#: every torch.distributed collective a worker calls (counted by :func:`_count_calls`)
CALLS: list[str] = []


def _count_calls() -> None:
    import torch.distributed as dist

    for name in ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "all_to_all_single"):
        original = getattr(dist, name)
        if not hasattr(original, "counted"):
            counted = lambda *a, _f=original, _n=name, **k: (CALLS.append(_n), _f(*a, **k))[1]  # noqa: E731
            counted.counted = True
            setattr(dist, name, counted)


def _train(rank: int, name: str, options: dict, pack: str, steps: int = 6, ddp_buckets_mb: float | None = None,
           **sync_kw):  # fmt: skip
    _count_calls()
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor(name, **options), pack=pack, **sync_kw)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    start = len(CALLS)
    losses, stats = train_loop(rank, model, sync, opt, steps, ddp_buckets_mb)
    calls = len(CALLS) - start
    return params(model), losses, [(s.sent_bytes, s.dense_sent_bytes, s.collectives) for s in stats], calls


def _both(rank: int, world: int, labels: list[str], sync_kw: dict, pack: str = "dense") -> dict:
    out = {}
    for label in labels:
        name, options = CASES[label]
        out[label] = (_train(rank, name, options, "none", **sync_kw), _train(rank, name, options, pack, **sync_kw))
    return out


def _check(outs: list[dict], fewer: int | None, agreement: bool = False) -> None:
    """Packed trained like plain on every rank, with the same bytes and ``fewer`` collectives a step (None: never more,
    and fewer in all); ``agreement``: the packed run's agreement rode in the message too (one allreduce fewer a
    step, outside the collectives the stats count, and its flag bytes in the message)."""
    for name in outs[0]:
        for rank_out in outs:
            (plain_w, plain_loss, plain_stats, plain_calls), (packed_w, packed_loss, packed_stats, packed_calls) = (
                rank_out[name]
            )
            for a, b in zip(plain_w, packed_w, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            assert packed_loss == pytest.approx(plain_loss, rel=1e-5), name
            # the policy leaves tensors dense but for the compressors of every tensor; the dense allreduces carry
            # nothing (their agreement goes in an allreduce after them: no fewer collectives, one more in the stats)
            rest = not dgc.COMPRESSORS[CASES[name][0]].handles_all_tensors
            carrier = CASES[name][0] not in ("none", "fp16", "bf16")
            flags = 4 * 4 if agreement else 0  # the agreement's flags, as fp32 values in the message
            for (sent, dense, calls), (p_sent, p_dense, p_calls) in zip(plain_stats, packed_stats, strict=True):
                assert (p_sent, p_dense) == (sent + flags, dense), name  # the same bytes, the dense in the message
                if fewer is None:
                    assert p_calls <= calls, name
                else:
                    assert p_calls == calls - (fewer if rest else 0) + (agreement and not carrier), name
            if fewer is None:
                assert sum(s[2] for s in packed_stats) < sum(s[2] for s in plain_stats), name
            else:  # what reached torch.distributed: the stats' collectives, and the agreement
                steps = len(plain_stats)
                fewer_calls = (fewer if rest else 0) + (agreement and carrier)
                assert packed_calls == plain_calls - steps * fewer_calls, name
        first = outs[0][name][1][0]
        for other in outs[1:]:  # the packed average is the same sum on every rank: the replicas agree exactly
            assert all(torch.equal(a, b) for a, b in zip(first, other[name][1][0])), name


@pytest.mark.parametrize("world", [2, 3])
def test_packing_trains_like_the_separate_allreduce_with_one_collective_fewer(world):
    _check(run(_both, world, sorted(CASES), {}), fewer=1)


@pytest.mark.parametrize("world", [2, 3])
def test_packing_the_agreement_too_leaves_one_collective_a_step(world):
    _check(run(_both, world, sorted(CASES), {}, "all"), fewer=1, agreement=True)


def test_packing_dense_values_in_16_bits_and_with_updates():
    # bf16 dense values ride as bf16 (PowerSGD's fp32 P cannot carry them: its own allreduce, no fewer collectives)
    outs = run(_both, 2, ["dgc", "topk"], {"policy": dgc.Policy(dense_values="bf16"), "clip_norm": 1.0})
    for rank_out in outs:
        for name, ((plain_w, *_), (packed_w, *_)) in rank_out.items():
            for a, b in zip(plain_w, packed_w, strict=True):  # bf16 summed in fp32 here, in bf16 by the allreduce
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
    outs = run(_both, 2, ["powersgd"], {"policy": dgc.Policy(dense_values="bf16")})
    _check(outs, fewer=0)


def test_packing_under_the_overlapped_ddp_hook():
    # each DDP bucket's part packs its own dense values (a part with no compressed tensor sends them alone)
    _check(run(_both, 2, ["dgc", "dgc_chunk"], {"ddp_buckets_mb": 0.001, "overlap": True}), fewer=None)


def _overlapped(rank: int, world: int) -> dict:
    name, options = CASES["dgc"]
    return {pack: _train(rank, name, options, pack, ddp_buckets_mb=0.001, overlap=True) for pack in PACKS}


def test_packing_the_agreement_under_the_overlapped_hook_drops_each_buckets_own():
    for out in run(_overlapped, 2):
        plain_w, plain_loss, plain_stats, _ = out["none"]
        dense_calls = out["dense"][3]
        all_w, all_loss, all_stats, all_calls = out["all"]
        for a, b in zip(plain_w, all_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all_loss == pytest.approx(plain_loss, rel=1e-5)
        # each bucket holding a compressed tensor (at least one a step) sends no agreement of its own: its flags
        # (4, as fp32) ride in its message instead, 16 bytes more for each allreduce fewer
        packed = [(a_sent - sent) / 16 for (sent, _, _), (a_sent, _, _) in zip(plain_stats, all_stats, strict=True)]
        assert all(n >= 1 and n == int(n) for n in packed)
        assert dense_calls - all_calls == sum(packed)


# -- what can carry the dense values --------------------------------------------------------------------------


@dataclass
class _MaxOnlyConfig(CompressorConfig):
    name: str = "max_only"


class _MaxOnly(Compressor):
    """Yields nothing the dense values can ride in: they get their own allreduce after its collective."""

    name: ClassVar[str] = "max_only"
    config_class = _MaxOnlyConfig

    def steps(self, items: list[Item], phases: Phases) -> Steps:
        scales = torch.stack([it.grad.abs().max() for it in items])
        yield AllreduceMax(scales)
        for it, s in zip(items, scales):
            it.grad.fill_(float(s))


def _max_only(rank: int, world: int) -> tuple[list[torch.Tensor], int]:
    model = make_model()
    sync = dgc.GradientSync(model, _MaxOnly(_MaxOnlyConfig()), pack="dense")
    opt = dgc.SGD(model.parameters(), sync, lr=0.05)
    _, stats = train_loop(rank, model, sync, opt, 1)
    return [p.grad.clone() for p in model.parameters()], stats[0].collectives


def test_a_compressor_without_a_carrier_sends_the_dense_values_on_their_own():
    outs = run(_max_only, 2)
    (g0, calls), (g1, _) = outs
    assert calls == 2  # the maximum, then the dense values' allreduce (the agreement is counted apart)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b)


def test_carry_refuses_what_cannot_hold_the_dense_values():
    dense = torch.ones(3)
    assert carry(AllreduceMax(torch.ones(2)), dense) is None
    assert carry(AllreduceMean(torch.ones(2, dtype=torch.bfloat16)), dense) is None  # another dtype
    for op in (Allgather(torch.ones(2, dtype=torch.float16)), AllgatherBytes(torch.ones(5, dtype=torch.uint8)),
               AllreduceMean(torch.ones(2))):  # fmt: skip
        assert carry(op, dense) is not None


def test_carry_splits_the_rows_back_into_the_message_and_the_mean():
    dense = torch.tensor([1.0, 2.0])
    message = torch.tensor([7, -3], dtype=torch.int32)
    packed, split = carry(Allgather(message), dense)
    rows = torch.stack(
        [packed.tensor, torch.cat([torch.tensor([3.0, 6.0]).view(torch.uint8), message.view(torch.uint8)])]
    )
    own, mean = split(rows)
    assert torch.equal(own, torch.stack([message, message]))
    assert torch.equal(mean, torch.tensor([2.0, 4.0]))
    packed, split = carry(AllgatherBytes(torch.tensor([9, 8, 7], dtype=torch.uint8)), dense)
    (rows, lengths), mean = split((packed.message.unsqueeze(0), [packed.message.numel()]))
    assert lengths == [3] and torch.equal(rows[0, :3], torch.tensor([9, 8, 7], dtype=torch.uint8))
    assert torch.equal(mean, dense)


# -- misuse ---------------------------------------------------------------------------------------------------


def test_pack_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="sync.pack=dense needs sync.exchange=flat, got sparse_allreduce"):
        dgc.GradientSync(make_model(), dgc.build_compressor("dgc"), exchange="sparse_allreduce", pack="dense")
    with pytest.raises(ValueError, match="dense_values=1bit"):
        dgc.GradientSync(make_model(), dgc.build_compressor("dgc"), policy=dgc.Policy(dense_values="1bit"),
                         pack="all")  # fmt: skip
    with pytest.raises(ValueError, match="sync.pack must be one of none, dense, all, got True"):
        SyncConfig(pack=True)
    with pytest.raises(ValueError, match="needs sync.exchange=flat, got hierarchical"):
        SyncConfig(pack="all", exchange="hierarchical")
    with pytest.raises(ValueError, match="sync.exchange=auto may choose another: set sync.exchange=flat"):
        SyncConfig(pack="dense", exchange="auto")
    with pytest.raises(ValueError, match="sync.pack must be one of none, dense, all, got 'yes'"):
        SyncConfig(pack="yes", exchange="auto")  # checked whatever the exchange
    SyncConfig(pack="all", ddp_hook=True, overlap=True)  # each bucket's flags in its message (test_overlap)


# -- the agreement in the message: a step undone ----------------------------------------------------------------------


def _nan_first(rank: int, world: int) -> dict:
    out = {}
    for pack in ("none", "all"):
        model = make_model()
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05), pack=pack)
        opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
        skipped, zero_state = [], None
        for step in range(3):
            sync.set_epoch(step / 4)
            local_backward(model, rank, step)
            if step == 0 and rank == 1:  # before any state exists: what the step made must be undone to zeros
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            skipped.append(sync.step().skipped)
            opt.step()
            if step == 0:
                tensors = [t for s in sync.compressor.state.values() for t in s.values()]
                zero_state = (len(tensors), all(bool((t == 0).all()) for t in tensors))
        out[pack] = (params(model), skipped, zero_state)
    return out


def test_a_first_step_undone_leaves_the_state_it_made_at_zero():
    for out in run(_nan_first, 2):
        (plain_w, plain_skipped, plain_zero), (packed_w, packed_skipped, packed_zero) = out["none"], out["all"]
        assert plain_skipped == packed_skipped == [True, False, False]
        assert plain_zero == (0, True)  # the agreement came first: the compressor never ran
        assert packed_zero[0] > 0 and packed_zero[1]  # it ran, and what it made is back at zero
        for a, b in zip(plain_w, packed_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
