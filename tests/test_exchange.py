"""The exchanges of dgc.exchanges on real gloo ranks: hierarchical (dense in a machine, sparse between) and the
sparse allreduce (regions reduced at owners), against the flat exchange and against plain averaging."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import dgc
from dgc.localbus import SharedMemoryError
from dgc.sync.agreement import AGREEMENT_BYTES
from dgc.topology import Topology
from tests.multiproc import run
from tests.test_sync_dist import local_backward, make_model, params


def _train(rank: int, exchange: str, name: str, kwargs: dict, steps: int, r: int | None = None, **sync_kw):
    model = make_model()
    comp = dgc.build_compressor(name, **kwargs)
    sync = dgc.GradientSync(model, comp, exchange=exchange, ranks_per_node=r, **sync_kw)
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
    losses, stats = [], []
    for step in range(steps):
        sync.set_epoch(step / 8)
        losses.append(float(local_backward(model, rank, step % 4)))
        stats.append(sync.step())
        opt.step()
    return model, sync, losses, stats


# -- topology -------------------------------------------------------------------------------------------


def _topology(rank: int, world: int) -> tuple:
    t = Topology.build(2)
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=t.local)
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=t.cross)
    return t.machine, t.local_rank, t.machines, float(x), float(y)


def test_topology_groups_machines_and_shards():
    outs = run(_topology, 4)
    # machines {0, 1} and {2, 3}; the cross groups pair equal local ranks: {0, 2} and {1, 3}
    assert outs == [(0, 0, 2, 1.0, 2.0), (0, 1, 2, 1.0, 4.0), (1, 0, 2, 5.0, 2.0), (1, 1, 2, 5.0, 4.0)]


# -- hierarchical ---------------------------------------------------------------------------------------


def _one_rank_per_machine(rank: int, world: int) -> dict:
    kwargs = {"density": 0.05, "warmup_epochs": 0.5}
    out = {}
    for exchange in ("flat", "hierarchical"):
        model, sync, losses, _ = _train(rank, exchange, "dgc", kwargs, 10, r=1)
        out[exchange] = (params(model), sync.state_dict(), losses)
    return out


def test_hierarchical_with_one_rank_per_machine_is_exactly_flat():
    for out in run(_one_rank_per_machine, 2):
        (fp, fs, fl), (hp, hs, hl) = out["flat"], out["hierarchical"]
        assert fl == hl
        for a, b in zip(fp, hp, strict=True):
            assert torch.equal(a, b)
        for n, slot in fs["compressor"]["tensors"].items():
            for k, t in slot.items():
                assert torch.equal(t, hs["compressor"]["tensors"][n][k])


def _dense_equivalent(rank: int, world: int) -> dict:
    # at density 1 without momentum correction every entry is sent: the exchange is an exact average
    kwargs = {"density": 1.0, "momentum_correction": False}
    model, _, _, stats = _train(rank, "hierarchical", "dgc", kwargs, 5, r=2)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        local_backward(ref, rank, step % 4)
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
    return {"hier": params(model), "ref": params(ref), "collectives": stats[-1].collectives}


def test_hierarchical_averages_exactly_at_density_one():
    outs = run(_dense_equivalent, 4)
    for out in outs:
        for a, b in zip(out["hier"], out["ref"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[0]["hier"], outs[3]["hier"], strict=True):
        assert torch.equal(a, b)  # every rank the same


def _five_steps(rank: int, world: int, name: str, exchange: str, bus: str = "auto") -> dict:
    model = make_model()
    # PowerSGD at rank 1: this model's 5 x 144 gradient has rank 4 (its rows sum to zero), where rank 4 is exact
    comp = dgc.build_compressor(name, **({"rank": 1} if name == "powersgd" else {}))
    sync = dgc.GradientSync(model, comp, exchange=exchange, ranks_per_node=2, local_bus=bus)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        local_backward(model, rank, step % 4)
        exact = [p.grad.clone() for p in model.parameters()]
        for g in exact:
            dist.all_reduce(g)
            g.div_(world)
        stats = sync.step()
        got = torch.cat([p.grad.view(-1) for p in model.parameters()])
        if step == 0:
            first = got.clone()
        opt.step()
    want = torch.cat([g.view(-1) for g in exact])
    return {"got": got, "cos": float(torch.nn.functional.cosine_similarity(got, want, dim=0)),
            "err": float((got - want).abs().max()), "sent": stats.sent_bytes, "params": params(model),
            "first": first}  # fmt: skip


def _every_compressor(rank: int, world: int) -> dict:
    """5 steps of each dense and quantizing compressor and of PowerSGD through hierarchical (2 machines x 2
    ranks, both local buses), against the exact mean; PowerSGD also through flat."""
    out = {(name, bus): _five_steps(rank, world, name, "hierarchical", bus)
           for name in ("none", "fp16", "terngrad", "qsgd", "powersgd") for bus in ("shm", "group")}  # fmt: skip
    out["powersgd", "flat"] = _five_steps(rank, world, "powersgd", "flat")
    return out


def test_hierarchical_carries_every_compressor():
    outs = run(_every_compressor, 4)
    for out in outs:
        for bus in ("shm", "group"):
            assert out["none", bus]["err"] < 1e-6 and out["fp16", bus]["err"] < 1e-3
            # unbiased but noisy on a model of 801 values (both ~0.7 here; a shard put in the wrong place: ~0)
            assert out["terngrad", bus]["cos"] > 0.4 and out["qsgd", bus]["cos"] > 0.4
            # fewer bytes between machines than the dense fp32 shard
            assert out["qsgd", bus]["sent"] < out["none", bus]["sent"] / 4
            assert out["powersgd", bus]["sent"] < out["none", bus]["sent"] / 2  # whole tensors: less balanced
            assert out["powersgd", bus]["err"] > 1e-3  # rank 1: not the exact mean
            # PowerSGD is linear in the gradient: on each machine's mean (whole tensors per rank) it is flat
            # PowerSGD over the 4 ranks, to rounding (2e-7 of the largest value at the first step; the warm-started
            # power iteration then carries the rounding on, ~10x a step on this 5-row matrix at rank 4)
            flat, hier = out["powersgd", "flat"]["first"], out["powersgd", bus]["first"]
            assert (hier - flat).abs().max() <= 1e-5 * flat.abs().max(), bus
        for name in ("none", "fp16", "terngrad", "qsgd", "powersgd"):  # both buses carry the same shards
            assert torch.equal(out[name, "shm"]["got"], out[name, "group"]["got"]), name
    for name in ("none", "fp16", "terngrad", "qsgd", "powersgd"):  # every rank the same model
        for out in outs[1:]:
            for a, b in zip(outs[0][name, "shm"]["params"], out[name, "shm"]["params"], strict=True):
                assert torch.equal(a, b), name


def _hier_train_resume(rank: int, world: int) -> dict:
    kwargs = {"density": 0.05, "warmup_epochs": 0.5}

    def build():
        model = make_model()
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", **kwargs), exchange="hierarchical", ranks_per_node=2)
        return model, sync, dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)

    def train(model, sync, opt, steps):
        losses = []
        for step in steps:
            sync.set_epoch(step / 8)
            losses.append(float(local_backward(model, rank, step % 4)))
            sync.step()
            opt.step()
        return losses

    model, sync, opt = build()
    losses = train(model, sync, opt, range(8))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sync.state_dict()))
    losses += train(model, sync, opt, range(8, 16))
    model2, sync2, opt2 = build()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sync2.load_state_dict(saved[2])
    train(model2, sync2, opt2, range(8, 16))
    names = sorted(saved[2]["compressor"]["tensors"])
    return {"params": params(model), "resumed": params(model2), "losses": losses, "names": names}


def test_hierarchical_trains_and_keeps_every_rank_identical():
    outs = run(_hier_train_resume, 4)
    for out in outs[1:]:
        for a, b in zip(outs[0]["params"], out["params"], strict=True):
            assert torch.equal(a, b)
    assert sum(outs[0]["losses"][-4:]) < sum(outs[0]["losses"][:4])
    # local rank 0 owns the first half of the flat compressed tensors, local rank 1 the second
    assert outs[0]["names"] == outs[2]["names"] and outs[1]["names"] == outs[3]["names"]
    assert set(outs[0]["names"]).isdisjoint(outs[1]["names"]) and any("@" in n for n in outs[1]["names"])
    for out in outs:  # this rank's shard state, saved and loaded, continues the identical trajectory
        for a, b in zip(out["params"], out["resumed"], strict=True):
            assert torch.equal(a, b)


def _agreement_by_machine(rank: int, world: int) -> dict:
    """3 hierarchical steps on 2 machines x 2 ranks: a NaN on rank 3 at step 1, a stop asked by rank 2 at step 2;
    the sizes of the groups every all_reduce goes over, and each step's control bytes."""
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05), exchange="hierarchical",
                            ranks_per_node=2)  # fmt: skip
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9)
    sizes: list[list[int]] = []
    real = dist.all_reduce

    def sized(tensor, *args, group=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sizes[-1].append(dist.get_world_size(group))
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = sized
    try:
        out = []
        for step in range(3):
            local_backward(model, rank, step)
            if step == 1 and rank == 3:
                next(model.parameters()).grad[0] = float("nan")
            if step == 2 and rank == 2:
                sync.request("stop")
            sizes.append([])
            stats = sync.step()
            opt.step()
            out.append((stats.skipped, stats.requests, stats.control_bytes))
    finally:
        dist.all_reduce = real
    return {"steps": out, "sizes": sizes, "params": params(model)}


def test_hierarchical_agrees_by_machine_and_every_rank_acts_alike():
    outs = run(_agreement_by_machine, 4)
    for out in outs:
        assert [(skipped, requests) for skipped, requests, _ in out["steps"]] == [
            (False, ()), (True, ()), (False, ("stop",))]  # fmt: skip
        # the flags inside the machine, then between the machines: only the latter is network traffic
        assert {control for _, _, control in out["steps"]} == {AGREEMENT_BYTES}
        # no step's allreduce spans all 4 ranks: the agreement is 2 small ones (2 ranks each), and a skipped step
        # stops there
        assert all(sizes and max(sizes) == 2 for sizes in out["sizes"])
        assert out["sizes"][1] == [2, 2]
        assert all(torch.isfinite(p).all() for p in out["params"])
    for out in outs[1:]:
        for a, b in zip(outs[0]["params"], out["params"], strict=True):
            assert torch.equal(a, b)


# -- the shared-memory local bus (dgc.localbus) -----------------------------------------------------------


def _buses(rank: int, world: int, r: int) -> dict:
    kwargs = {"density": 0.05, "warmup_epochs": 0.5}
    out = {}
    for bus in ("shm", "group"):
        model, sync, losses, stats = _train(rank, "hierarchical", "dgc", kwargs, 8, r=r, local_bus=bus)
        out[bus] = {"params": params(model), "losses": losses, "local": stats[-1].local_bytes,
                    "sent": stats[-1].sent_bytes, "on_bus": sync.exchange.bus.name == "shm"}  # fmt: skip
    # the buffers' files are gone as soon as every rank mapped them
    out["left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"dgc-{os.getpid()}-")]
    return out


@pytest.mark.parametrize("r", [2, 4])
def test_shared_memory_bus_matches_the_process_group(r):
    """Through shared memory or gloo, the machine's ranks compute the same shards: exactly with 2 ranks per
    machine (a + b either way), to float rounding with 4 (another order of the sums); bytes counted alike."""
    for out in run(_buses, 4, r):
        shm, group = out["shm"], out["group"]
        assert shm["on_bus"] and not group["on_bus"] and out["left"] == []
        assert shm["sent"] == group["sent"] and shm["local"] > 0
        for a, b in zip(shm["params"], group["params"], strict=True):
            if r == 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if r == 2:
            assert shm["losses"] == group["losses"]


def _apart(rank: int, world: int, tmp: str, mode: str) -> dict:
    # each rank looks for the buffers in its own directory: as if ranks_per_node=2 put them on two machines
    os.environ["DGC_SHM_DIR"] = os.path.join(tmp, str(rank))
    os.makedirs(os.environ["DGC_SHM_DIR"])
    kwargs = {"density": 0.05}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, sync, _, _ = _train(rank, "hierarchical", "dgc", kwargs, 3, r=2, local_bus=mode)
    except SharedMemoryError as exc:
        return {"error": str(exc), "left": os.listdir(os.environ["DGC_SHM_DIR"])}
    ref, _, _, _ = _train(rank, "hierarchical", "dgc", kwargs, 3, r=2, local_bus="group")
    same = all(torch.equal(a, b) for a, b in zip(params(model), params(ref), strict=True))
    return {"warnings": [str(w.message) for w in caught], "same": same, "bus": sync.exchange.bus.name == "group",
            "left": os.listdir(os.environ["DGC_SHM_DIR"])}  # fmt: skip


def test_ranks_that_cannot_share_memory_fall_back_or_fail_alike(tmp_path):
    auto = run(_apart, 2, str(tmp_path / "auto"), "auto")
    for out in auto:  # auto: one warning naming why, then the process group, with the same result
        assert out["same"] and out["bus"] and out["left"] == []
    assert any("another rank of the machine could not map" in w for w in auto[0]["warnings"]), auto[0]["warnings"]
    assert any("rank 1 of the machine cannot map" in w for w in auto[1]["warnings"]), auto[1]["warnings"]
    shm = run(_apart, 2, str(tmp_path / "shm"), "shm")
    assert all("shared-memory local bus" in out["error"] and out["left"] == [] for out in shm)
    assert "rank 1 of the machine cannot map" in shm[1]["error"]


def test_a_bad_local_bus_names_the_valid_ones():
    with pytest.raises(ValueError, match="sync.local_bus must be one of auto, shm, group"):
        dgc.SyncConfig(local_bus="nvlink")


def _wrong_compressor(rank: int, world: int) -> str:
    try:
        dgc.GradientSync(make_model(), dgc.build_compressor("qsgd"), exchange="sparse_allreduce")
    except ValueError as exc:
        return str(exc)
    return ""


def test_only_sparse_compressors_take_the_sparse_allreduce():
    # (hierarchical carries every compressor: test_hierarchical_carries_every_compressor)
    assert "is for the sparse compressors (dgc, topk), not 'qsgd'" in run(_wrong_compressor, 2)[0]
    with pytest.raises(ValueError, match="valid: flat, densify, hierarchical, sparse_allreduce"):
        dgc.GradientSync(make_model(), dgc.build_compressor("dgc"), exchange="ring")


# -- densify --------------------------------------------------------------------------------------------


def _densify(rank: int, world: int) -> dict:
    """flat and densify from the same gradients, at a density where the allgather is cheaper (0.01) and one where
    the allreduce is (0.9: at 2 workers above 2/3 with 6-byte entries)."""
    out = {}
    for density in (0.01, 0.9):
        for exchange in ("flat", "densify"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(400, 500), torch.nn.Linear(500, 10))
            sync = dgc.GradientSync(model, dgc.build_compressor("topk", density=density), exchange=exchange)
            gen, grads = torch.Generator().manual_seed(rank), []
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                stats = sync.step()
                grads.append([p.grad.clone() for p in model.parameters()])
            residual = {n: s["residual"].clone() for n, s in sync.compressor.state.items()}
            out[density, exchange] = (grads, residual, stats.recv_bytes, stats.counters.get("densified", 0))
    try:
        dgc.GradientSync(make_model(), dgc.build_compressor("qsgd"), exchange="densify")
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_densify_allreduces_the_selections_when_that_moves_fewer_bytes():
    for out in run(_densify, 2):
        for density, exact in ((0.01, True), (0.9, False)):
            (flat, flat_res, flat_recv, _), (dens, dens_res, dens_recv, densified) = (
                out[density, "flat"], out[density, "densify"])  # fmt: skip
            for a, b in zip(sum(flat, []), sum(dens, []), strict=True):
                assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            assert flat_res.keys() == dens_res.keys()
            assert all(torch.equal(flat_res[n], dens_res[n]) for n in flat_res)  # the same left behind
            if exact:
                assert densified == 0 and dens_recv == flat_recv
            else:
                assert densified == 1 and dens_recv < 0.8 * flat_recv
        assert "exchange=densify is for the sparse compressors (dgc, topk), not 'qsgd'" in out["refused"]


# -- sparse allreduce -----------------------------------------------------------------------------------


def _conservation(rank: int, world: int) -> dict:
    """topk keeps a residual and no momentum: sum over workers of (residual + N * applied) == sum of inputs."""
    model = make_model()
    sync = dgc.GradientSync(model, dgc.build_compressor("topk", density=0.05), exchange="sparse_allreduce")
    grads, applied = [], []
    for step in range(6):
        local_backward(model, rank, step)
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        sync.step()
        applied.append([p.grad.detach().clone() for p in model.parameters()])
    residual = {n: s["residual"].clone() for n, s in sync.compressor.state.items()}
    names = [n for n, _ in sync.params]
    return {"grads": grads, "applied": applied, "residual": residual, "names": names, "last": sync.last}


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_allreduce_loses_nothing_and_agrees(world):
    outs = run(_conservation, world)
    names = outs[0]["names"]
    for i, name in enumerate(names):
        if name not in outs[0]["residual"]:  # biases go dense
            continue
        total_in = sum(sum(g[i] for g in o["grads"]) for o in outs)
        applied = sum(a[i] for a in outs[0]["applied"])
        left = sum(o["residual"][name].view_as(applied) for o in outs)
        assert bool(applied.abs().sum() > 0) and bool(left.abs().sum() > 0)  # some sent, some kept back
        torch.testing.assert_close(left + world * applied, total_in, rtol=1e-4, atol=1e-5)
        for o in outs[1:]:  # every worker applies the same
            assert all(torch.equal(a[i], b[i]) for a, b in zip(outs[0]["applied"], o["applied"]))
    stats = outs[0]["last"]
    # about k entries kept per tensor (per region), where flat would apply up to N * k
    assert stats.counters.get("values_returned", 0) > 0


def _traffic(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(400, 500), torch.nn.Linear(500, 10))
    out = {}
    for exchange in ("flat", "sparse_allreduce"):
        sync = dgc.GradientSync(model, dgc.build_compressor("topk", density=0.01), exchange=exchange)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            stats = sync.step()
        out[exchange] = stats.recv_bytes
    return out


def test_sparse_allreduce_traffic_does_not_grow_with_the_workers():
    two, four = run(_traffic, 2)[0], run(_traffic, 4)[0]
    assert four["flat"] > 2.5 * two["flat"]  # the allgather: N - 1 messages
    assert four["sparse_allreduce"] < 1.5 * two["sparse_allreduce"]


def _sa_train(rank: int, world: int) -> dict:
    model, sync, losses, _ = _train(rank, "sparse_allreduce", "dgc", {"density": 0.05, "warmup_epochs": 0.5}, 16)
    return {"params": params(model), "losses": losses}


def test_sparse_allreduce_trains_dgc_identically_on_every_rank():
    outs = run(_sa_train, 4)
    for out in outs[1:]:
        for a, b in zip(outs[0]["params"], out["params"], strict=True):
            assert torch.equal(a, b)
    assert sum(outs[0]["losses"][-4:]) < sum(outs[0]["losses"][:4])


def _one_bit_dense_by_machine(rank: int, world: int) -> list[list[float]]:
    """2 machines x 2 ranks: the bias (left dense, 1-bit) of machine 0's ranks is [1, 1, 1, 1] and [3, -1, 3, -1]
    (mean [2, 0, 2, 0]), of machine 1's [0, 2, 0, 2] on both; two steps, the same gradients."""
    layer = torch.nn.Linear(3, 4)
    sync = dgc.GradientSync(layer, dgc.build_compressor("topk", density=0.5), exchange="hierarchical",
                            ranks_per_node=2, policy=dgc.Policy(dense_values="1bit"))  # fmt: skip
    bias = {0: [1.0, 1, 1, 1], 1: [3.0, -1, 3, -1], 2: [0.0, 2, 0, 2], 3: [0.0, 2, 0, 2]}[rank]
    got = []
    for _ in range(2):
        layer.weight.grad = torch.ones_like(layer.weight)
        layer.bias.grad = torch.tensor(bias)
        sync.step()
        got.append(layer.bias.grad.tolist())
    return got


def test_one_bit_dense_values_go_by_machine_under_hierarchical():
    """Under exchange=hierarchical the 1-bit dense values are each machine's exact mean, compressed between the
    machines (each rank its shard: [2, 0] on machine 0, [0, 2] on machine 1, one scale each), not each rank's own
    values over all 4 ranks (which gave [1.25, 0.25, 1.25, 0.25]). Error feedback is by machine too: step 2 sends
    [2, -2] and [-2, 2], whose mean is 0."""
    for got in run(_one_bit_dense_by_machine, 4):
        assert got == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
