"""The cost model: collectives' alpha-beta times, calibration on runs, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgc import costmodel
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
    assert costmodel.main([*files, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["max_abs_error"] < 1e-6 and out.with_suffix(".png").stat().st_size > 0
    speedup = report["projection"]["speedup"]["1gbit"]
    # one worker per machine at 1 Gbps: DGC beats the fp32 allreduce at every N > 1
    for i, n in enumerate(report["projection"]["nodes"]):
        if n > 1:
            assert speedup["dgc"][i] > speedup["none"][i]
    assert json.loads(capsys.readouterr().out)["max_abs_error"] < 1e-6


def test_unreadable_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert costmodel.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and not (tmp_path / "c.json").exists()
