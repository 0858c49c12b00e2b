"""The cost model: collectives' alpha-beta times, calibration on runs, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgc import costmodel
from dgc.bench import main as bench_main
from dgc.costmodel import CostModel, Network, Workload

NUMEL = 25_557_032
#: the "true" machine the synthetic runs below come from
TRUE = {
    "alpha": 1.5e-3,
    "bandwidth": 0.9 * 125e6,
    "cpu": {"none": 2e-9, "fp16": 5e-9, "dgc": 1.2e-9, "dgc_compact": 2.5e-9},
}


def test_collective_times() -> None:
    net = Network(bandwidth=100.0, alpha=1.0)
    assert net.allreduce(400, 1) == 0.0 and net.allgather(400, 1) == 0.0
    assert net.allreduce(400, 4) == pytest.approx(2 * 3 * 1.0 + 2 * 3 / 4 * 4.0)
    assert net.allgather(400, 4) == pytest.approx(3 * (1.0 + 4.0))
    # the sparse allgather grows with N, the ring allreduce does not
    assert net.allgather(400, 64) / net.allgather(400, 4) > 15 > net.allreduce(400, 64) / net.allreduce(400, 4)


def test_every_method_pays_the_agreement_the_bench_times_with_it() -> None:
    # latency alone: each ring collective over 4 ranks is 2 x 3 hops (allreduce) or 3 (allgather)
    model = CostModel(Network(bandwidth=1e15, alpha=1.0))
    hops = {m: model.exchange(m, Workload(1000, 100.0), 4)["communicate_s"] for m in ("none", "fp16", "dgc")}
    assert hops == pytest.approx({"none": 6 + 6, "fp16": 6 + 6, "dgc": 3 + 3 + 6})
    # the calibration's features count it too: flat DGC with a dense rest is lengths, message, rest and agreement
    o = {"method": "dgc", "nodes": 4, "rate": "1gbit", "numel": 1000, "message_bytes": 100.0,
         "dense_rest_bytes": 500.0}  # fmt: skip
    assert costmodel._net_features(o)[0] == 2 * 3 + 2 * 3 + 2 * 3
    assert costmodel._net_features({**o, "nodes": 1})[0] == 0
    # hierarchical agrees by machine: among 4 machines of 2 ranks, 2 x 3 hops, not the 2 x 7 of all 8 ranks
    h = {**o, "method": "dgc_hierarchical", "nodes": 8, "ranks_per_node": 2, "machines": 4, "compressed_numel": 1000,
         "agreement": "by_machine"}  # fmt: skip
    assert costmodel._net_features(h)[0] == 2 * 3 + 2 * 3 + 2 * 3
    # a run measured while it agreed over all 8 ranks (before the exchange agreed by machine) is fitted as it ran
    assert costmodel._net_features({**h, "agreement": "flat"})[0] == 2 * 3 + 2 * 3 + 2 * 7
    assert costmodel._agreement("dgc_hierarchical") == "by_machine" and costmodel._agreement("dgc") == "flat"
    # the projection's dense baseline is DDP as users run it: no agreement
    none = {"method": "none", "nodes": 4, "rate": "1gbit", "numel": 1000}
    assert costmodel._net_features(none)[0] == 2 * 3 + 2 * 3
    assert costmodel._net_features({**none, "agreement": "none"})[0] == 2 * 3
    params = {"alpha": 1.0, "efficiency": 1e9, "reduce_fp16": 0.0, "cpu_none": 0.0, "cpu_dgc": 0.0}
    w = costmodel.StepBytes(1000, 100.0)
    assert costmodel.project(params, w, "none", 4, 1, "1gbit", 1e9) == pytest.approx(2 * 3, rel=1e-6)
    assert costmodel.project(params, w, "dgc", 4, 1, "1gbit", 1e9) == pytest.approx(3 + 3 + 2 * 3, rel=1e-6)


def test_dense_rest_by_allgather_when_one_bit() -> None:
    model = CostModel(Network(bandwidth=1e6, alpha=0.0))
    reduce = model.exchange("dgc", Workload(1000, 100.0, 500.0), 8)["communicate_s"]
    gather = model.exchange("dgc", Workload(1000, 100.0, 500.0, dense_rest_gather=True), 8)["communicate_s"]
    base = model.exchange("dgc", Workload(1000, 100.0), 8)["communicate_s"]
    assert reduce == pytest.approx(base + 2 * 7 / 8 * 500 / 1e6)
    assert gather == pytest.approx(base + 7 * 500 / 1e6)


def synthetic_run(nodes: int) -> dict:
    """A cluster-bench JSON as the true machine would produce it (4 ranks share 2 cores: contention)."""
    net = Network(TRUE["bandwidth"], TRUE["alpha"])
    truth = CostModel(net, TRUE["cpu"], cores=2)
    sparse, rest = 150_000.0, 216_480.0
    rows = {}
    for m in ("none", "fp16", "dgc", "dgc_compact"):
        w = {
            "none": Workload(NUMEL, 0.0),
            "fp16": Workload(NUMEL, 0.0),
            "dgc": Workload(NUMEL, sparse, rest),
            "dgc_compact": Workload(NUMEL, 80_000.0, 7_193.0, dense_rest_gather=True),
        }[m]
        t = truth.exchange(m, w, nodes)
        row = {
            "exchange_s": t["exchange_s"], "compress_s": t["cpu_s"] * 0.7, "decompress_s": t["cpu_s"] * 0.3,
            "communicate_s": t["communicate_s"], "dense_bytes": 4 * NUMEL,
            "sent_bytes": int((4 if m == "none" else 2) * NUMEL) if m in ("none", "fp16") else 0,
        }  # fmt: skip
        if m.startswith("dgc"):
            row["dense_sent_bytes"] = w.dense_rest_bytes
            row["sent_bytes"] = int(w.sparse_bytes + w.dense_rest_bytes + 8)
            row["policy"] = {"dense_values": "1bit"} if w.dense_rest_gather else {}
        rows[m] = row
    return {"mode": "exchange", "model": "resnet50", "numel": NUMEL, "nodes": nodes, "rate": "1gbit", "cores": 2,
            "threads_per_rank": 1, "methods": rows}  # fmt: skip


def test_calibration_recovers_the_machine() -> None:
    runs = [synthetic_run(n) for n in (2, 4, 8)]
    params, obs = costmodel.calibrate(runs)
    assert params["alpha"] == pytest.approx(TRUE["alpha"], rel=1e-6)
    assert params["efficiency"] == pytest.approx(0.9, rel=1e-6)
    for m, c in TRUE["cpu"].items():
        assert params[f"cpu_{m}"] == pytest.approx(c, rel=1e-6)
    assert max(abs(o["error"]) for o in obs) < 1e-6
    compact = [o for o in obs if o["method"] == "dgc_compact"]
    assert all(o["dense_rest_gather"] and o["dense_rest_bytes"] == 7_193.0 for o in compact)
    assert all(o["message_bytes"] == 80_000.0 for o in compact)


def test_command_line_writes_report_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for n in (2, 4, 8):
        f = tmp_path / f"cluster_n{n}.json"
        f.write_text(json.dumps(synthetic_run(n)))
        files.append(str(f))
    out = tmp_path / "costmodel.json"
    assert bench_main(["costmodel", *files, "--out", str(out), "--ranks-per-node", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["max_abs_error"] < 1e-6 and out.with_suffix(".png").stat().st_size > 0
    assert set(report["projection"]["speedup"]) == {"1gbit", "10gbit", "25gbit"}
    speedup = report["projection"]["speedup"]["1gbit"]
    # one worker per machine at 1 Gbps: DGC beats the fp32 allreduce (as DDP runs it) from 2 to 128 workers; then
    # flat DGC has stopped scaling (each worker receives every other's message) and the allreduce catches up
    machines = report["projection"]["machines"]
    for i, n in enumerate(machines):
        if 1 < n <= 128:
            assert speedup["dgc"][i] > speedup["none"][i]
    assert machines[-2:] == [128, 256] and speedup["dgc"][-1] < 1.1 * speedup["dgc"][-2]
    assert json.loads(capsys.readouterr().out)["max_abs_error"] < 1e-6


def test_unreadable_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["costmodel", str(tmp_path / "missing.json"), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and not (tmp_path / "c.json").exists()


#: a machine for the exchanges of dgc.exchanges (seconds per value/byte, alpha, efficiency, local bus)
EXCHANGE_TRUTH = {
    "alpha": 2e-3, "efficiency": 0.9, "reduce_fp16": 0.0, "local_s_per_byte": 5e-9,
    "cpu_dgc": 2e-9, "cpu_msg_dgc": 4e-9, "cpu_dgc_hierarchical": 3e-9, "cpu_msg_dgc_hierarchical": 1e-8,
    "cpu_dgc_sparse_allreduce": 2.5e-9, "cpu_msg_dgc_sparse_allreduce": 6e-9, "cpu_none": 1e-9,
}  # fmt: skip


def exchange_run(machines: int, per_node: int) -> dict:
    """A cluster-bench JSON of flat, hierarchical and sparse-allreduce DGC made by EXCHANGE_TRUTH."""
    n, rest, message = machines * per_node, 216_480.0, 150_000.0
    rows = {}
    for m in ("none", "dgc", "dgc_hierarchical", "dgc_sparse_allreduce"):
        sent = message / per_node if m == "dgc_hierarchical" else message
        recv = {"dgc": (n - 1) * (sent + 8), "dgc_hierarchical": (machines - 1) * (sent + 8),
                "dgc_sparse_allreduce": 450_000.0 * (n - 1) / n, "none": 0.0}[m]  # fmt: skip
        o = {"method": m, "nodes": n, "ranks_per_node": per_node, "machines": machines, "rate": "1gbit",
             "threads": 1, "cores": 2, "numel": NUMEL, "compressed_numel": NUMEL, "message_bytes": sent,
             "recv_sparse_bytes": recv, "dense_rest_bytes": rest if m != "none" else 0.0}  # fmt: skip
        costmodel.predict(EXCHANGE_TRUTH, o)
        cpu, comm = o["predicted_cpu"], o["predicted_communicate"]
        row = {"exchange_s": cpu + comm, "compress_s": cpu / 2, "decompress_s": cpu / 2, "communicate_s": comm,
               "dense_bytes": 4 * NUMEL, "sent_bytes": 4 * NUMEL}  # fmt: skip
        if m != "none":
            row.update(dense_sent_bytes=rest, sent_bytes=int(sent + rest + 8), recv_bytes_max_rank=recv + rest,
                       compressed_numel=NUMEL)  # fmt: skip
        rows[m] = row
    return {"mode": "exchange", "model": "resnet50", "numel": NUMEL, "nodes": n, "machines": machines,
            "ranks_per_node": per_node, "rate": "1gbit", "cores": 2, "threads_per_rank": 1,
            "methods": rows}  # fmt: skip


def test_calibration_recovers_the_exchanges() -> None:
    runs = [exchange_run(2, 1), exchange_run(4, 1), exchange_run(8, 1), exchange_run(4, 2)]
    params, obs = costmodel.calibrate(runs)
    for key in ("alpha", "local_s_per_byte", "cpu_dgc_hierarchical", "cpu_dgc_sparse_allreduce"):
        assert params[key] == pytest.approx(EXCHANGE_TRUTH[key], rel=1e-4), key
    assert params["efficiency"] == pytest.approx(0.9, rel=1e-4)
    assert max(abs(o["error"]) for o in obs) < 1e-4
    hier = [(o["machines"], o["ranks_per_node"], o["nodes"]) for o in obs if o["method"] == "dgc_hierarchical"]
    assert hier == [(2, 1, 2), (4, 1, 4), (8, 1, 8), (4, 2, 8)]


def test_hierarchical_traffic_follows_machines_and_sparse_allreduce_does_not_grow() -> None:
    w = costmodel.StepBytes(NUMEL, 150_000.0, 216_480.0, 450_000.0)
    net_only = {**EXCHANGE_TRUTH, **{k: 0.0 for k in EXCHANGE_TRUTH if k.startswith("cpu_")}, "alpha": 0.0}

    def t(method: str, machines: int, r: int) -> float:
        return costmodel.project(net_only, w, method, machines, r, "1gbit", 50e9)

    # flat: the allgather grows with the N = M R ranks; hierarchical: with the M machines only
    assert t("dgc", 128, 8) / t("dgc", 16, 8) > 7
    assert t("dgc_hierarchical", 128, 8) < t("dgc", 128, 8) / 6
    # sparse allreduce: the bytes a rank receives barely change from 8 to 1024 ranks
    assert t("dgc_sparse_allreduce", 128, 8) < 1.2 * t("dgc_sparse_allreduce", 8, 1)


def report_file(tmp_path: Path) -> Path:
    files = []
    for m, r in ((2, 1), (4, 1), (8, 1), (4, 2)):
        f = tmp_path / f"run_{m}x{r}.json"
        f.write_text(json.dumps(exchange_run(m, r)))
        files.append(str(f))
    out = tmp_path / "costmodel.json"
    assert bench_main(["costmodel", *files, "--out", str(out)]) == 0
    return out


def test_auto_choice_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = report_file(tmp_path)
    capsys.readouterr()
    best, why = costmodel.auto_exchange(str(report), NUMEL, 1024, 8, "1gbit", 0.001)
    assert best == "hierarchical" and "128 machine(s) x 8 rank(s)" in why
    assert costmodel.auto_exchange(str(report), NUMEL, 1, 1, "1gbit", 0.001)[0] == "flat"
    # one rank per machine: hierarchical is exactly flat and not considered
    assert "hierarchical" not in costmodel.auto_exchange(str(report), NUMEL, 8, 1, "1gbit", 0.001)[1]
    assert (
        bench_main(["costmodel", "--explain", "--machines", "128", "--ranks-per-node", "8", "--params", str(report)])
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("exchange=auto -> hierarchical: 128 machine(s) x 8 rank(s)") and "\n" not in line
    with pytest.raises(ValueError, match="sync.exchange=auto needs a calibrated cost model"):
        costmodel.auto_exchange(str(tmp_path / "none.json"), NUMEL, 8, 1, "1gbit", 0.001)


def test_sync_config_auto(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import torch

    import dgc
    from dgc.sync.config import SyncConfig

    report = report_file(tmp_path)
    model = torch.nn.Linear(1000, 1000)
    cfg = SyncConfig(exchange="auto", costmodel=str(report), ranks_per_node=8)
    best, why = cfg.choose(model, dgc.build_compressor("dgc"), SimpleNamespace(world_size=1024))
    assert best == "hierarchical" and why.startswith("exchange=auto chose hierarchical")
    assert cfg.choose(model, dgc.build_compressor("fp16"), SimpleNamespace(world_size=1024))[0] == "flat"
    sync = dgc.GradientSync.from_config(cfg, model, dgc.build_compressor("dgc"))  # one process: nothing to exchange
    assert sync.exchange.name == "flat" and "one rank" in sync.exchange_reason
    with pytest.raises(
        ValueError, match="sync.exchange must be one of flat, densify, hierarchical, sparse_allreduce, auto"
    ):
        SyncConfig(exchange="ring")
    with pytest.raises(ValueError, match="unknown rate"):
        SyncConfig(exchange="auto", bandwidth="fast")
