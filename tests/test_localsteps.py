"""Local steps (dgc.localsteps): DiLoCo and SparseLoCo against their papers' equations re-derived by hand, the
sparseloco compressor's arithmetic, refusals, the non-finite guard, and exact resume through the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dgc.tasks.tiny_data import write_fmnist

import dgc
from dgc.comm import Comm
from dgc.compressors.base import Item
from dgc.compressors.sparseloco import dequantize2, pack2, quantize2, unpack2
from dgc.repro.config import EXIT_DIVERGED, EXIT_INTERRUPTED
from dgc.timing import Phases
from tests.multiproc import run
from tests.runs import TINY, assert_same_training, cli, load, records

SHAPES = {"w": (6, 5), "v": (3, 7), "b": (5,)}  # b: left dense by the default policy


class Quadratic(torch.nn.Module):
    """Loss 0.5 * |p - target|^2 per tensor: the gradient is p - target, a different target on every rank."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))

    def loss(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(0.5 * ((getattr(self, n) - t) ** 2).sum() for n, t in targets.items())


def targets(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {n: torch.randn(shape, generator=gen) for n, shape in SHAPES.items()}


# -- the references: the papers' equations on plain tensors, every rank simulated here ------------------------------


def inner_sgd(theta, rank, first_step, steps, lr, momentum, buf):
    """H steps of momentum SGD (torch.optim.SGD's rule: b = m b + g; p -= lr b) on rank ``rank``'s targets."""
    theta = {n: t.clone() for n, t in theta.items()}
    for s in range(first_step, first_step + steps):
        tg = targets(rank, s)
        for n in theta:
            g = theta[n] - tg[n]
            buf[n] = g.clone() if n not in buf else buf[n] * momentum + g
            theta[n] = theta[n] - lr * buf[n]
    return theta


def diloco_reference(world, rounds, every, lr, momentum, outer_lr, outer_momentum):
    """DiLoCo (Douillard et al. 2023, Algorithm 1) with outer Nesterov SGD: delta_r = theta - theta_r after H inner
    steps, delta = mean_r delta_r, m = mu m + delta, theta -= lr_out (delta + mu m)."""
    theta = {n: p.detach().clone() for n, p in Quadratic().named_parameters()}
    bufs = [{} for _ in range(world)]
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    for r in range(rounds):
        locals_ = [inner_sgd(theta, k, r * every, every, lr, momentum, bufs[k]) for k in range(world)]
        for n in theta:
            delta = sum(theta[n] - loc[n] for loc in locals_) / world
            m[n] = outer_momentum * m[n] + delta
            theta[n] = theta[n] - outer_lr * (delta + outer_momentum * m[n])
    return theta


def chunk_top_k_2bit(e, chunk, k):
    """SparseLoCo's Q(TopK(e)) as this library defines Q: per chunk, the k largest |e|; magnitudes at or below
    their (lower) median become the mean of those, the others the mean of the others; signs kept."""
    out = torch.zeros_like(e)
    for c in range(e.numel() // chunk):
        part = e[c * chunk : (c + 1) * chunk]
        idx = torch.topk(part.abs(), k).indices
        mags = part[idx].abs()
        median = mags.sort().values[(k - 1) // 2]
        low = [float(x) for x in mags if x <= median]
        high = [float(x) for x in mags if x > median]
        lo = sum(low) / len(low)
        hi = sum(high) / len(high) if high else lo
        for i, mag in zip(idx.tolist(), mags.tolist()):
            out[c * chunk + i] = (hi if mag > median else lo) * (1.0 if part[i] > 0 else -1.0)
    return out


def sparseloco_reference(world, rounds, every, lr, momentum, outer_lr, chunk, k, decay):
    """SparseLoCo (Sarfi et al. 2025, Algorithm 1) on the compressed tensors (w, v: concatenated and padded to whole
    chunks): e_r = beta e_r + delta_r, q_r = Q(TopK(e_r)), e_r -= q_r, theta -= alpha mean_r q_r; the dense tensor
    (b) averaged plainly."""
    theta = {n: p.detach().clone() for n, p in Quadratic().named_parameters()}
    bufs = [{} for _ in range(world)]
    numel = sum(theta[n].numel() for n in ("w", "v"))
    size = numel + (-numel % chunk)
    errors = [torch.zeros(size) for _ in range(world)]
    for r in range(rounds):
        locals_ = [inner_sgd(theta, q, r * every, every, lr, momentum, bufs[q]) for q in range(world)]
        sent = torch.zeros(size)
        for q in range(world):
            delta = torch.cat([(theta[n] - locals_[q][n]).reshape(-1) for n in ("w", "v")])
            e = errors[q]
            e.mul_(decay)[:numel] += delta
            out = chunk_top_k_2bit(e, chunk, k)
            e -= out
            sent += out / world
        pos = 0
        for n in ("w", "v"):
            count = theta[n].numel()
            theta[n] = theta[n] - outer_lr * sent[pos : pos + count].view(theta[n].shape)
            pos += count
        theta["b"] = theta["b"] - outer_lr * sum(theta["b"] - loc["b"] for loc in locals_) / world
    return theta


# -- the library in real processes -------------------------------------------------------------------------------------


def _train(rank, world, compressor, options, every, outer, rounds, lr, momentum):
    model = Quadratic()
    sync = dgc.GradientSync(model, dgc.build_compressor(compressor, **options))
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    local = dgc.LocalSteps(sync, every, *outer, optimizer=inner)
    sent = []
    for step in range(rounds * every):
        model.loss(targets(rank, step)).backward()
        stepped = local.step()  # the inner step, and every H-th the exchange and the outer step
        inner.zero_grad()
        assert not stepped.skipped
        stats = stepped.outer
        assert (stats is not None) == ((step + 1) % every == 0)
        if stats is not None:
            sent.append(stats.sent_bytes)
            assert stats.dense_bytes == 4 * sum(p.numel() for p in model.parameters())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, sent


def _both_methods(rank, world):
    diloco = _train(rank, world, "none", {}, 3, (0.7, 0.9, True), 3, 0.05, 0.5)
    sparse = _train(rank, world, "sparseloco", {"chunk_size": 8, "density": 0.25, "decay": 0.9}, 2,
                    (0.8, 0.0, False), 4, 0.05, 0.5)  # fmt: skip
    bf16 = _train(rank, world, "bf16", {}, 3, (0.7, 0.9, True), 2, 0.05, 0.5)
    return diloco, sparse, bf16


def test_diloco_and_sparseloco_equal_their_papers_equations_on_two_ranks():
    results = run(_both_methods, 2)
    want = diloco_reference(2, 3, 3, 0.05, 0.5, 0.7, 0.9)
    for (weights, sent), _, _ in results:
        for n in want:
            torch.testing.assert_close(weights[n], want[n], rtol=1e-5, atol=1e-6)
        assert sent == [4 * 56] * 3  # every round the fp32 pseudo-gradient of 56 values, nothing in between
    want = sparseloco_reference(2, 4, 2, 0.05, 0.5, 0.8, 8, 2, 0.9)
    for _, (weights, sent), _ in results:
        for n in want:
            torch.testing.assert_close(weights[n], want[n], rtol=1e-5, atol=1e-6)
        # w and v: 51 values in 7 chunks of 8, 2 each: 14 codes in 4 bytes, 7 x 2 fp32 scales, 14 16-bit positions;
        # b: 5 fp32 values
        assert sent == [4 + 56 + 28 + 20] * 4
    # the bf16 pseudo-gradients: the two ranks end equal and near the fp32 run's weights
    (a, sent_a), (b, _) = results[0][2][0:2], results[1][2][0:2]
    assert all(torch.equal(a[n], b[n]) for n in a) and sent_a == [2 * 56] * 2
    fp32 = diloco_reference(2, 2, 3, 0.05, 0.5, 0.7, 0.9)
    for n in fp32:
        torch.testing.assert_close(a[n], fp32[n], rtol=2e-2, atol=2e-2)


# -- the sparseloco compressor alone ----------------------------------------------------------------------------------


def test_two_bit_codes_pack_four_to_a_byte_and_decode_to_two_magnitudes_per_sign():
    values = torch.tensor([[0.1, -0.2, 3.0, -4.0], [1.0, 1.0, 1.0, 1.0], [-0.5, 0.0, 0.0, 0.0]])
    codes, scales = quantize2(values)
    torch.testing.assert_close(scales, torch.tensor([[0.15, 3.5], [1.0, 1.0], [0.0, 0.5]]))
    torch.testing.assert_close(dequantize2(codes, scales),
                               torch.tensor([[0.15, -0.15, 3.5, -3.5], [1.0] * 4, [-0.5, 0.0, 0.0, 0.0]]))  # fmt: skip
    assert torch.equal(unpack2(pack2(codes), 12).view(3, 4), codes) and pack2(codes).numel() == 3
    odd = torch.tensor([3, 1, 2, 0, 1], dtype=torch.uint8)
    assert unpack2(pack2(odd), 5).tolist() == odd.tolist()


@pytest.mark.parametrize("values", ["2bit", "fp32", "fp16"])
def test_what_is_not_sent_stays_in_the_decaying_error_buffer(values):
    """One worker: the error buffer plus what was sent is exactly beta * e + g, over several steps."""
    comp = dgc.build_compressor("sparseloco", chunk_size=16, density=0.2, decay=0.5, values=values)
    comm = Comm.local()
    comp.bind(comm)
    gen = torch.Generator().manual_seed(3)
    e = torch.zeros(40)
    for _ in range(4):
        g = torch.randn(40, generator=gen)
        items = [Item("a", g, g.clone().view(5, 8))]
        comp.exchange(items, comm, Phases())
        e = 0.5 * e + g
        sent = items[0].grad.view(-1)
        assert int((sent != 0).sum()) == 3 * 3  # round(0.2 * 16) per chunk, 3 chunks (the last one padded)
        torch.testing.assert_close(comp.state["a"]["error"] + sent, e, rtol=0, atol=1e-6)
        e = comp.state["a"]["error"].clone()


def test_bad_sparseloco_options_name_the_valid_ones():
    with pytest.raises(ValueError, match="values must be one of 2bit, fp32, fp16, bf16"):
        dgc.build_compressor("sparseloco", values="3bit")
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\]"):
        dgc.build_compressor("sparseloco", decay=1.5)
    with pytest.raises(ValueError, match="chunk_size must be at most 65536"):
        dgc.build_compressor("sparseloco", chunk_size=70000)


# -- refusals, the guard, the synced weights ---------------------------------------------------------------------------


def test_local_steps_refuse_what_acts_on_each_steps_gradient():
    model = Quadratic()
    with pytest.raises(ValueError, match="keeps the optimizer's momentum"):
        dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("dgc")), 4)
    with pytest.raises(ValueError, match="set sync.clip_norm=null"):
        dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none"), clip_norm=1.0), 4)
    with pytest.raises(ValueError, match="local_steps.every must be an integer >= 1"):
        dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none")), 0)
    with pytest.raises(ValueError, match="local_steps.every must be an integer >= 0, got -1"):
        dgc.LocalStepsConfig(every=-1)
    with pytest.raises(ValueError, match="outer_nesterov=true needs local_steps.outer_momentum > 0"):
        dgc.LocalStepsConfig(every=4, outer_momentum=0.0)
    # DGC without momentum correction is plain error feedback: it composes
    dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("dgc", momentum_correction=False)), 4)


def test_step_steps_the_inner_optimizer_unless_this_workers_gradient_is_not_finite():
    model = Quadratic()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    local = dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none")), 2, optimizer=inner)
    start = model.w.detach().clone()
    clipped = []
    model.loss(targets(0, 0)).backward()
    model.w.grad.view(-1)[0] = float("nan")
    stepped = local.step(before_update=lambda: clipped.append(1))
    assert stepped.skipped and stepped.outer is None and clipped == [] and torch.equal(model.w, start)
    inner.zero_grad()
    model.loss(targets(0, 1)).backward()
    stepped = local.step(before_update=lambda: clipped.append(1))  # the 2nd inner step: the exchange (one rank)
    assert not stepped.skipped and clipped == [1] and stepped.outer is not None and not stepped.outer_skipped
    assert stepped.sent_bytes == stepped.outer.sent_bytes > 0 and local.rounds == 1
    model.loss(targets(0, 2)).backward()
    assert local.step(last=True).outer is not None  # the run's last step exchanges early
    with pytest.raises(ValueError, match=r"build it with LocalSteps\(sync, every, optimizer=inner\)"):
        dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none")), 2).step()


def test_a_non_finite_pseudo_gradient_puts_every_worker_back_on_the_synced_weights():
    model = Quadratic()
    local = dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none")), 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.w.add_(1.0)
        assert local.after_step() is None
        with local.synced():  # evaluation between exchanges sees the synced weights, then this worker's again
            assert torch.equal(model.w, start["w"])
        assert torch.equal(model.w, start["w"] + 1.0)
        model.v[0, 0] = float("nan")
    stats = local.after_step()
    assert stats.skipped and local.outer.state_dict()["state"] == {}  # no outer step
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), start[n]), n


def _one_round(rank: int, world: int) -> dict:
    """A round of H = 4 inner steps, every torch.distributed call counted: a NaN in rank 1's inner step 1, a stop
    asked on rank 0 at inner step 1."""
    import torch.distributed as dist

    calls = []
    for name in ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "all_to_all_single"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    model = Quadratic()
    local = dgc.LocalSteps(dgc.GradientSync(model, dgc.build_compressor("none")), 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"skipped": [], "requests": [], "calls": []}
    for step in range(4):
        inner.zero_grad()
        model.loss(targets(rank, step)).backward()
        if step == 1 and rank == 1:
            model.w.grad.view(-1)[0] = float("nan")
        if step == 1 and rank == 0:
            local.sync.request("stop")
        stats = local.before_step()
        if not stats.skipped:
            inner.step()
        outer = local.after_step()
        out["skipped"].append(stats.skipped)
        out["requests"].append(stats.requests + (outer.requests if outer else ()))
        out["calls"].append(len(calls))
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_inner_steps_send_nothing_and_a_rank_skips_only_its_own_non_finite_step():
    outs = run(_one_round, 2)
    for rank, out in enumerate(outs):
        assert out["calls"][:3] == [0, 0, 0]  # no collective, not even the agreement, until the exchange
        assert out["calls"][3] == 2  # the exchange: its agreement and the pseudo-gradient's allreduce
        assert out["skipped"] == [False, rank == 1, False, False]
        assert out["requests"] == [(), (), (), ("stop",)]  # asked at step 1, seen by both at the exchange
    for a, b in zip(outs[0]["weights"], outs[1]["weights"], strict=True):
        assert torch.equal(a, b) and bool(a.isfinite().all())


# -- the trainer: presets, a resume in the middle of a round ---------------------------------------------------------


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return write_fmnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=64, n_test=16)


def test_a_run_killed_between_exchanges_resumes_exactly(fmnist, tmp_path):
    """Two ranks of sparseloco with 3 local steps and outer momentum, killed after step 5 (the checkpoint of step 4
    is one step into a round: each rank's own weights and inner momentum differ there), resumed, equal to the run
    left alone; the run's last step is an exchange and the evaluations read the synced weights."""
    args = [*TINY, f"data.root={fmnist}", "compression=sparseloco", "local_steps.every=3", "data.limit=48"]
    args += ["local_steps.outer_momentum=0.5", "train.max_steps=8", "train.checkpoint_every=2", "train.log_every=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    out = cli([*args, f"run_dir={a}"], tmp_path, torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    out = cli([*args, f"run_dir={b}"], tmp_path, torchrun=True, env={"DGC_FAULTS": "kill@5"})
    assert out.returncode != 0 and load(b)["counters"]["step"] == 4
    ranks = load(b)["ranks"]
    assert ranks[0]["local_steps"]["since"] == 1
    assert not torch.equal(ranks[0]["weights"]["fc.weight"], ranks[1]["weights"]["fc.weight"])
    out = cli([*args, f"run_dir={b}", "resume=true"], tmp_path, torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert_same_training(a, b)
    for ra, rb in zip(load(a)["ranks"], load(b)["ranks"]):
        assert torch.equal(ra["local_steps"]["anchor"]["fc.weight"], rb["local_steps"]["anchor"]["fc.weight"])
    end = load(a)
    assert end["ranks"][0]["local_steps"]["since"] == 0  # step 8 is not a multiple of 3: forced exchange
    assert torch.equal(end["ranks"][0]["weights"]["fc.weight"], end["ranks"][1]["weights"]["fc.weight"])
    summary = json.loads((a / "summary.json").read_text())
    assert summary["method"] == "sparseloco-local3" and summary["local_steps"] == 3
    sent = [r["sent_bytes"] for r in records(a, "train")]
    assert [s > 0 for s in sent] == [False, False, True, False, False, True, False, True]
    assert summary["bytes_per_step"] == pytest.approx(sum(sent) / 8)


def test_a_signal_between_exchanges_stops_every_rank_at_the_next_exchange(fmnist, tmp_path):
    args = [*TINY, f"data.root={fmnist}", "compression=diloco", "local_steps.every=4", "data.limit=48"]
    args += ["train.max_steps=12", f"run_dir={tmp_path / 'r'}"]
    out = cli(args, tmp_path, nproc=2, env={"DGC_FAULTS": "term@2:1"})
    assert out.returncode == EXIT_INTERRUPTED, out.stderr[-3000:]
    assert "stopped at step 4" in out.stderr
    state = load(tmp_path / "r")
    assert state["counters"]["step"] == 4 and all(r["local_steps"]["since"] == 0 for r in state["ranks"])


def test_a_ranks_run_of_non_finite_inner_steps_ends_every_rank_at_the_next_exchange(fmnist, tmp_path):
    args = [*TINY, f"data.root={fmnist}", "compression=diloco", "local_steps.every=4", "data.limit=48"]
    args += ["train.max_steps=12", "train.max_bad_steps=3", f"run_dir={tmp_path / 'r'}"]
    out = cli(args, tmp_path, nproc=2, env={"DGC_FAULTS": "nan@1:0,nan@2:0,nan@3:0"})
    assert out.returncode == EXIT_DIVERGED, out.stderr[-3000:]
    assert "3 inner steps in a row had non-finite gradients on some rank (seen at the exchange of step 4)" in out.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["compression=dgc", "local_steps.every=4"], "keeps the optimizer's momentum"),
        (["compression=diloco", "sync.ddp_hook=true"], "local_steps.every needs sync.ddp_hook=false"),
    ],
)
def test_bad_local_steps_settings_get_one_line(override, message, fmnist, tmp_path):
    out = cli([*TINY, f"data.root={fmnist}", "train.max_steps=1", *override], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
