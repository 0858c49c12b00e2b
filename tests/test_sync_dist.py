"""Multi-process tests of GradientSync on gloo (2 and 4 real processes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dgc
from dgc import wire
from dgc.comm import Comm
from tests.multiproc import run


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 5),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def local_backward(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, world: int) -> None:
    """Dense data-parallel SGD: average the gradients with a plain all_reduce."""
    local_backward(model, rank, step)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_loop(rank: int, model: torch.nn.Module, sync: dgc.GradientSync, opt: torch.optim.Optimizer, steps: int,
               ddp_buckets_mb: float | None = None) -> tuple[list[float], list[dgc.StepStats]]:  # fmt: skip
    """``steps`` steps of :func:`batch` on ``model``: through DDP with the DGC comm hook (buckets of
    ``ddp_buckets_mb``) or, when None, the library path (``sync.step()`` after the backward pass); the optimizer
    steps unless the exchange skipped the step. Each step's loss and the exchange's stats."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = model
    if ddp_buckets_mb is not None:
        net = DDP(model, bucket_cap_mb=ddp_buckets_mb)
        net.register_comm_hook(sync, dgc.ddp_comm_hook)
    losses, stats = [], []
    for step in range(steps):
        sync.set_epoch(step / 4)
        x, y = batch(rank, step % 4)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        stats.append(sync.last if ddp_buckets_mb is not None else sync.step())
        if not stats[-1].skipped:
            opt.step()
        losses.append(loss.item())
    return losses, stats


# -- density 1.0: DGC equals momentum SGD (masking off) or plain SGD (masking on) ----------


def _density_one(rank: int, world: int) -> dict:
    steps, lr, wd = 6, 0.1, 1e-3
    out = {}
    for nesterov in (False, True):
        model, ref = make_model(), make_model()
        comp = dgc.build_compressor("dgc", density=1.0, momentum_masking=False)
        sync = dgc.GradientSync(model, comp)
        opt = dgc.SGD(model.parameters(), sync, lr=lr, momentum=0.9, nesterov=nesterov, weight_decay=wd)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, nesterov=nesterov, weight_decay=wd)
        for step in range(steps):
            local_backward(model, rank, step)
            sync.step()
            opt.step()
            reference_step(ref, ref_opt, rank, step, world)
        out[f"mask_off_nesterov={nesterov}"] = (params(model), params(ref))

    # masking on: every coordinate is sent every step and loses its momentum, so the
    # compressed tensors follow plain SGD; biases (sent dense) keep ordinary momentum.
    model, ref = make_model(), make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=1.0))
    opt = dgc.SGD(model.parameters(), sync, lr=lr, momentum=0.9)
    weights = [p for p in ref.parameters() if p.dim() > 1]
    biases = [p for p in ref.parameters() if p.dim() <= 1]
    ref_opt = torch.optim.SGD([{"params": weights, "momentum": 0.0}, {"params": biases}], lr=lr, momentum=0.9)
    for step in range(steps):
        local_backward(model, rank, step)
        sync.step()
        opt.step()
        reference_step(ref, ref_opt, rank, step, world)
    out["mask_on"] = (params(model), params(ref))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dgc_at_density_one_matches_dense_sgd(world: int) -> None:
    results = run(_density_one, world)
    for rank_out in results:
        for case, (got, want) in rank_out.items():
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, c=case: f"{c}: {m}")
    # every rank holds the same model
    for case in results[0]:
        for g0, g1 in zip(results[0][case][0], results[-1][case][0], strict=True):
            assert torch.equal(g0, g1), case


# -- variable counts, including zero, through the real allgather ----------------------------


def _uneven(rank: int, world: int) -> dict:
    comm = Comm()
    numels = [50, 70_000, 3]
    fmt_results = {}
    for fmt in (wire.WireFormat("fp32", "delta16"), wire.WireFormat("fp16", "int32")):
        expected = [torch.zeros(n) for n in numels]
        mine = None
        for r in range(world):
            gen = torch.Generator().manual_seed(r)
            vals, idxs = [], []
            for t, n in enumerate(numels):
                count = 0 if r == 0 else min(n, (r * 7 + t * 3) % (n + 1))  # rank 0 sends nothing
                idx = torch.sort(torch.randperm(n, generator=gen)[:count]).values
                val = torch.randn(count, generator=gen).to(fmt.value_dtype).float()
                expected[t].index_add_(0, idx, val)
                vals.append(val)
                idxs.append(idx)
            if r == rank:
                mine = (vals, idxs)
        message = wire.encode(*mine, fmt)
        rows, lengths = comm.allgather_bytes(message)
        offsets = torch.tensor([0, numels[0], numels[0] + numels[1]])
        flat = torch.zeros(sum(numels))
        for r in range(world):
            pos, val = wire.decode(rows[r, : lengths[r]], offsets, fmt)
            flat.index_add_(0, pos, val)
        fmt_results[str(fmt)] = (flat, torch.cat(expected), lengths, message.numel())
    return fmt_results


def test_uneven_counts_exchange_correctly() -> None:
    results = run(_uneven, 3)
    for rank, out in enumerate(results):
        for name, (got, want, lengths, mine) in out.items():
            torch.testing.assert_close(got, want, msg=name)
            assert lengths[rank] == mine
            assert len(set(lengths)) > 1, "the test must exercise different message sizes"


# -- local clipping: clip_norm is the clip of the averaged gradient ---------------------------


def _local_clip(rank: int, world: int) -> dict:
    # one 1-D parameter of 4 * world entries; rank r's local gradient is 10 on its own block of 4
    # entries (norm 20, far above the clip) and 0 elsewhere, so the gradients are orthogonal
    out = {}
    for shared in (False, True):
        model = torch.nn.Linear(1, 4 * world, bias=False)
        sync = dgc.GradientSync(model, dgc.build_compressor("none"), clip_norm=0.5)
        grad = torch.zeros_like(model.weight)
        block = slice(0, 4) if shared else slice(4 * rank, 4 * rank + 4)
        grad[block] = 10.0
        model.weight.grad = grad
        sync.step()
        out["shared" if shared else "orthogonal"] = float(model.weight.grad.norm())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_local_clipping_keeps_the_average_at_the_dense_clip(world: int) -> None:
    # each worker clips its own gradient at 0.5 * sqrt(N): N orthogonal clipped gradients average
    # to exactly the dense run's clip 0.5, and N identical ones to 0.5 * sqrt(N)
    for out in run(_local_clip, world):
        assert out["orthogonal"] == pytest.approx(0.5, rel=1e-5)
        assert out["shared"] == pytest.approx(0.5 * world**0.5, rel=1e-5)


# -- the other compressors keep every rank identical and train ------------------------------


def _every_compressor(rank: int, world: int) -> dict:
    out = {}
    # every registered compressor, with options that suit this small model where it has them
    small = {"topk": {"density": 0.05}, "dgc": {"density": 0.05, "warmup_epochs": 1}, "powersgd": {"rank": 2},
             # DeMo's sign steps want a sign method's rate and no second momentum: here its decoded mean, in 8 x 8
             # tiles with a quarter of the coefficients sent, under this loop's momentum SGD
             "demo": {"tile": 8, "topk": 16, "decay": 0.5, "sign": False}}  # fmt: skip
    for name in dgc.COMPRESSORS:
        kwargs = small.get(name, {})
        model = make_model()
        sync = dgc.GradientSync(model, dgc.build_compressor(name, **kwargs), clip_norm=5.0)
        opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
        losses = []
        for step in range(30):
            sync.set_epoch(step / 10)
            x, y = batch(rank, step % 3)  # a few batches, revisited: the loss must fall
            model.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            stats = sync.step()
            opt.step()
            losses.append(float(loss))
        out[name] = (params(model), losses, stats.as_dict())
    return out


def test_every_compressor_trains_consistently_on_four_ranks() -> None:
    results = run(_every_compressor, 4)
    for name in results[0]:
        for rank_out in results[1:]:
            for a, b in zip(results[0][name][0], rank_out[name][0], strict=True):
                assert torch.equal(a, b), f"{name}: ranks diverged"
        losses = results[0][name][1]
        assert sum(losses[-3:]) < sum(losses[:3]), f"{name}: loss did not fall {losses[:3]} -> {losses[-3:]}"
        stats = results[0][name][2]
        assert stats["sent_bytes"] > 0 and stats["dense_bytes"] == sum(p.numel() for p in make_model().parameters()) * 4
        if name != "none":
            assert stats["wire_ratio"] > 1.5, (name, stats)
    assert set(results[0]) == set(dgc.COMPRESSORS)


# -- state_dict in mid-run continues the identical trajectory --------------------------------


def _resume(rank: int, world: int) -> dict:
    def build():
        model = make_model()
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05, warmup_epochs=2), clip_norm=1.0)
        opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
        return model, sync, opt

    def train(model, sync, opt, steps):
        for step in steps:
            sync.set_epoch(step / 4)
            local_backward(model, rank, step)
            sync.step()
            opt.step()

    model, sync, opt = build()
    train(model, sync, opt, range(5))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sync.state_dict()))
    train(model, sync, opt, range(5, 10))
    straight = params(model)

    model, sync, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sync.load_state_dict(saved[2])
    train(model, sync, opt, range(5, 10))
    return {"straight": straight, "resumed": params(model)}


def test_state_dict_round_trip_continues_identically() -> None:
    for out in run(_resume, 2):
        for a, b in zip(out["straight"], out["resumed"], strict=True):
            assert torch.equal(a, b)


# -- a non-finite gradient on one rank: every rank skips the step; requests reach every rank ----------


def _nonfinite(rank: int, world: int, pack: str = "none", name: str = "dgc", options: dict | None = None) -> dict:
    model = make_model()
    compressor = dgc.build_compressor(name, **(options if options is not None else {"density": 0.1}))
    sync = dgc.GradientSync(model, compressor, clip_norm=1.0, pack=pack)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
    out: dict = {"skipped": [], "requests": []}
    for step in range(5):
        local_backward(model, rank, step)
        if step in (2, 3) and rank == 1:  # a NaN, then an Inf, in one value of one rank's gradient
            next(model.parameters()).grad.view(-1)[0] = float("nan") if step == 2 else float("inf")
        if step == 2:
            before = (params(model), copy.deepcopy(sync.compressor.state))
        if step == 3 and rank == 0:
            sync.request("stop")
        stats = sync.step()
        opt.step()
        out["skipped"].append(stats.skipped)
        out["requests"].append(stats.requests)
        if step == 3:
            out["unchanged"] = (before, (params(model), copy.deepcopy(sync.compressor.state)))
            out["zeroed"] = all(bool((p.grad == 0).all()) for p in model.parameters())
        out["control_bytes"] = stats.control_bytes
    out["final"] = params(model)
    return out


@pytest.mark.parametrize(
    ("pack", "name", "options"),
    [("none", "dgc", None), ("all", "dgc", None),
     ("all", "dgc", {"density": 0.1, "selection": "chunk", "chunk_size": 16}), ("all", "powersgd", {"rank": 2}),
     ("all", "demo", {"tile": 8})],
    ids=["separate-agreement", "agreement-in-dgcs-message", "in-chunk-selections", "in-powersgds-first-allreduce",
         "in-demos-allgather"],
)  # fmt: skip
def test_a_non_finite_gradient_on_one_rank_is_skipped_on_every_rank(pack, name, options) -> None:
    # with sync.pack=all the step runs before the ranks agree on it, and is undone on every rank
    outs = run(_nonfinite, 2, pack, name, options)
    for out in outs:
        assert out["skipped"] == [False, False, True, True, False]
        assert out["requests"] == [(), (), (), ("stop",), ()]  # asked on rank 0, seen by both at once
        (model_before, state_before), (model_after, state_after) = out["unchanged"]
        for a, b in zip(model_before, model_after, strict=True):  # no update from the skipped steps
            assert torch.equal(a, b)
        for name, slot in state_before.items():  # nothing entered DGC's momenta and residuals
            for key, tensor in slot.items():
                assert torch.equal(tensor, state_after[name][key]) and bool(tensor.isfinite().all())
        # a byte per flag (non-finite, stop, checkpoint, diverged); in the message, a value of its dtype per flag
        assert out["zeroed"] and out["control_bytes"] == (4 if pack == "none" else 16)
    for a, b in zip(outs[0]["final"], outs[1]["final"], strict=True):
        assert torch.equal(a, b) and bool(a.isfinite().all())


# -- accumulate="updates": the residual holds rate-scaled contributions ----------------------------------


def _accumulate(rank: int, world: int) -> dict:
    """topk keeps a residual: with the rate dropping from 0.5 to 0.05, which sums are conserved."""
    rates = [0.5, 0.5, 0.5, 0.05, 0.05, 0.05]
    out = {}
    for mode in ("gradients", "updates"):
        model = make_model()
        sync = dgc.GradientSync(model, dgc.build_compressor("topk", density=0.05), accumulate=mode)
        opt = dgc.SGD(model.parameters(), sync, lr=rates[0])
        fed = [torch.zeros_like(p) for p in model.parameters()]  # sum of lr_t * g_t
        fed_raw = [torch.zeros_like(p) for p in model.parameters()]  # sum of g_t
        applied = [torch.zeros_like(p) for p in model.parameters()]  # sum of lr_t * G_t
        applied_raw = [torch.zeros_like(p) for p in model.parameters()]  # sum of G_t
        for step, lr in enumerate(rates):
            opt.param_groups[0]["lr"] = lr
            local_backward(model, rank, step)  # the weights stay: the same model every step
            for f, r, p in zip(fed, fed_raw, model.parameters()):
                f.add_(p.grad, alpha=lr)
                r.add_(p.grad)
            sync.step()
            for a, r, p in zip(applied, applied_raw, model.parameters()):
                a.add_(p.grad, alpha=lr)
                r.add_(p.grad)
        names = [n for n, _ in sync.params]
        state = sync.compressor.state  # the dense tensors (biases) keep no residual
        residual = [state[n]["residual"].view_as(p) if n in state else torch.zeros_like(p)
                    for n, p in zip(names, model.parameters())]  # fmt: skip
        out[mode] = {"fed": fed, "fed_raw": fed_raw, "applied": applied, "applied_raw": applied_raw,
                     "residual": residual}  # fmt: skip
    # constant rate: the two modes take the same steps (to float rounding)
    model_a, model_b = make_model(), make_model()
    for model, mode in ((model_a, "gradients"), (model_b, "updates")):
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05), accumulate=mode)
        opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, weight_decay=1e-4)
        for step in range(6):
            local_backward(model, rank, step)
            sync.step()
            opt.step()
    out["constant"] = (params(model_a), params(model_b))
    return out


def test_accumulate_updates_applies_each_contribution_at_its_own_rate() -> None:
    """Summed over the workers, nothing is lost in either mode, but in different units: "gradients" conserves
    N sum G_t + residuals = sum g_t, "updates" conserves N sum lr_t G_t + residuals = sum lr_t g_t, so a value
    computed at lr 0.5 and sent after the drop to 0.05 moves the weights by 0.5 x, not 0.05 x, its size."""
    outs = run(_accumulate, 2)

    def total(mode: str, key: str) -> list[torch.Tensor]:
        return [sum(t) for t in zip(*(o[mode][key] for o in outs))]

    world = len(outs)
    for mode, fed, applied in (("gradients", "fed_raw", "applied_raw"), ("updates", "fed", "applied")):
        # every worker applies the same average: N times one worker's is what all of them sent
        for f, a, r in zip(total(mode, fed), outs[0][mode][applied], total(mode, "residual"), strict=True):
            torch.testing.assert_close(world * a + r, f, rtol=1e-5, atol=1e-6)
    # and the other mode's identity does not hold after the drop: the modes really differ
    lhs = [world * a + r for a, r in zip(outs[0]["gradients"]["applied"], total("gradients", "residual"))]
    assert any(not torch.allclose(x, f, rtol=1e-3, atol=1e-4) for x, f in zip(lhs, total("gradients", "fed")))
    for a, b in zip(*outs[0]["constant"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulate_needs_a_known_value_and_the_rate() -> None:
    with pytest.raises(ValueError, match="sync.accumulate must be one of gradients, updates"):
        dgc.SyncConfig(accumulate="momenta")
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("topk", density=0.1), accumulate="updates")
    local_backward(model, 0, 0)
    with pytest.raises(RuntimeError, match="needs the learning rate"):
        sync.step()
