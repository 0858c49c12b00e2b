"""The frontier's arms on real links (dgc.repro.frontier_cost): prices re-derived by hand, the library's own
collective counts, the frontier of accuracy against bytes, and the report's extra files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dgc.bench.common import configurations
from dgc.bench.wire import measure
from dgc.costmodel import hardware
from dgc.repro import frontier_cost as fc
from tests.test_report import PNG, fake_table, run_report

ROOT = Path(__file__).resolve().parents[1]
W = hardware.RESNET50
DENSE = 4 * W.numel


@pytest.mark.parametrize("name", [*sorted(fc.COLLECTIVES), *fc.WHAT_IF])
def test_collectives_per_exchange_are_what_the_library_issues(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200), torch.nn.Linear(200, 10))
    compression, overrides = configurations()[name]
    assert measure(model, name, density=0.001, steps=2)["collectives"] == len(fc.collectives_of(compression, overrides))


def test_every_tensor_in_the_chunk_message_is_one_allgather_and_nothing_dense():
    arm = fc.arm_cost("one", "dgc_chunk", 0, 0.0, measured=("dgc_chunk_one", 300_000.0),
                      overrides=configurations()["dgc_chunk_one"][1])  # fmt: skip
    assert (arm.collectives, arm.rest_bytes) == (("allgather",), 0.0)
    p, n = fc.link_profile(1.0, 30.0), 4
    assert fc.exchange_s(arm, p, n) == pytest.approx(hardware.allgather_s(p, 300_000.0, n))
    assert fc.collectives_of("dgc_chunk") == ("allgather", "rest")


def test_dense_values_in_the_message_ride_with_its_payload():
    for compression, before in (("dgc", ("lengths", "allgather")), ("dgc_chunk", ("allgather",))):
        for pack in ("dense", "all"):
            overrides = ("compression.wire_values=fp16", f"sync.pack={pack}")
            arm = fc.arm_cost("packed", compression, 0, 0.0, measured=("x", 300_000.0), overrides=overrides)
            assert (arm.collectives, arm.rest_bytes, arm.agreements) == (before, 0.0, float(pack == "dense"))
    arm = fc.arm_cost("packed", "dgc_chunk", 0, 0.0, measured=("x", 300_000.0), overrides=("sync.pack=dense",))
    plain = fc.arm_cost("plain", "dgc_chunk", 0, 0.0, measured=("x", 300_000.0))
    far, near = fc.link_profile(1.0, 30.0), fc.link_profile(1.0, 0.1)
    # 6 latencies fewer between regions; on a 1 Gb/s LAN with many workers the allgathered dense values cost more
    assert fc.exchange_s(plain, far, 4) - fc.exchange_s(arm, far, 4) == pytest.approx(0.180, rel=0.05)
    assert fc.exchange_s(arm, near, 64) > fc.exchange_s(plain, near, 64)


def test_the_agreement_bytes_are_the_guards_flags():
    import dgc

    model = torch.nn.Linear(4, 2)
    sync = dgc.GradientSync(model, dgc.build_compressor("none"))
    model(torch.ones(1, 4)).sum().backward()
    assert fc.AGREEMENT_BYTES == sync.step().control_bytes  # what the library's agreement puts in its allreduce


def test_the_projection_takes_the_number_of_workers(tmp_path, capsys):
    wire = tmp_path / "wire.json"
    names = ("none", "bf16", "powersgd", "dgc_fp16", "dgc_chunk_fp16", "diloco", "demo_flat", "sparseloco_dense_rest")
    wire.write_text(json.dumps({"numel": W.numel, "density": None,
                                "compressors": {n: {"sent_bytes": 1000.0} for n in names}}))  # fmt: skip
    fc.main(["--wire", str(wire), "--workers", "16"])
    md = capsys.readouterr().out
    assert md.splitlines()[0].endswith("16 workers") and "--workers 16" in md


def test_an_allgather_arm_by_hand():
    arm = fc.arm_cost("DGC", "dgc", 0, wire_ratio=200.0)
    assert (arm.kind, arm.every, arm.collectives) == ("serial", 1, ("lengths", "allgather", "rest"))
    assert arm.nbytes == pytest.approx(DENSE / 200)
    rest = 4 * W.dense_rest
    assert arm.rest_bytes == rest
    p = fc.link_profile(1.0, 30.0)  # 125 MB/s, 30 ms per message
    n = 4
    lengths = (n - 1) * 0.030 + (n - 1) * 8 / 125e6
    message = (n - 1) * 0.030 + (n - 1) * (arm.nbytes - rest) / 125e6
    dense_rest = 2 * (n - 1) * 0.030 + 2 * (n - 1) / n * rest / 125e6
    agreement = 2 * (n - 1) * 0.030 + 2 * (n - 1) / n * 4 / 125e6  # the flags' allreduce before the exchange
    assert fc.step_s(arm, p, n) == pytest.approx(W.compute_s + agreement + lengths + message + dense_rest)


def test_powersgd_splits_its_payload_between_p_and_q():
    arm = fc.arm_cost("PowerSGD", "powersgd", 0, wire_ratio=10.0)
    p, n = fc.link_profile(10.0, 0.1), 4
    half = (arm.nbytes - arm.rest_bytes) / 2
    by_hand = 2 * hardware.allreduce_s(p, half, n) + hardware.allreduce_s(p, arm.rest_bytes, n)
    assert fc.exchange_s(arm, p, n) == pytest.approx(by_hand)


def test_local_steps_send_a_whole_pseudo_gradient_every_h_steps():
    # a run of 100 steps at H = 16: 7 exchanges (the 7th at the end of the run), the ratio measured per step
    steps, h = 100, 16
    ratio = steps / math.ceil(steps / h)
    arm = fc.arm_cost("DiLoCo", "diloco", h, wire_ratio=ratio, steps=steps)
    assert (arm.kind, arm.every, arm.collectives, arm.rest_bytes) == ("serial", h, ("allreduce",), 0.0)
    assert arm.nbytes == pytest.approx(DENSE)
    p = fc.link_profile(10.0, 0.1)
    n = 4
    ring = 2 * (n - 1) * 0.1e-3 + 2 * (n - 1) / n * DENSE / 1.25e9
    agreement = 2 * (n - 1) * 0.1e-3 + 2 * (n - 1) / n * 4 / 1.25e9  # once per exchange: inner steps send nothing
    assert fc.step_s(arm, p, n) == pytest.approx(W.compute_s + (ring + agreement) / h)


def test_dense_arms_are_ddp_overlapped_with_the_backward_pass():
    p = fc.link_profile(25.0, 0.1)
    for compression, method in (("none", "ddp_fp32"), ("bf16", "ddp_bf16")):
        arm = fc.arm_cost("dense", compression, 0, wire_ratio=1.0 if compression == "none" else 2.0)
        assert arm.kind == "ddp"
        assert fc.step_s(arm, p, 4) == hardware.step_s(p, W, method, 4)["step_s"]
    # the overlap hides part of the allreduce: the step is below compute + the serial exchanges
    dense = fc.arm_cost("dense", "none", 0, 1.0)
    serial = W.compute_s + len(hardware.ddp_buckets(DENSE)) * hardware.allreduce_s(p, 0, 4) + hardware.allreduce_s(
        p, DENSE, 4) - hardware.allreduce_s(p, 0, 4)  # fmt: skip
    assert fc.step_s(dense, p, 4) < serial


def test_latency_decides_between_many_small_messages_and_few_large_ones():
    dgc = fc.arm_cost("DGC", "dgc", 0, 270.0)
    diloco = fc.arm_cost("DiLoCo H=64", "diloco", 64, 64.0)
    lan, wan = fc.link_profile(1.0, 0.1), fc.link_profile(1.0, 30.0)
    assert fc.step_s(dgc, lan) < fc.step_s(diloco, lan)  # a 1 Gb/s LAN: DGC's 0.4 MB per step beats 98 MB per 64
    assert fc.step_s(diloco, wan) < fc.step_s(dgc, wan)  # 30 ms per message: DGC's 3 allgathers every step lose


def test_unknown_arms_are_refused_naming_the_valid_ones():
    with pytest.raises(fc.FrontierCostError, match="valid: none, bf16"):
        fc.arm_cost("x", "terngrad", 0, 15.0)
    with pytest.raises(fc.FrontierCostError, match="no measured wire ratio"):
        fc.arm_cost("x", "dgc", 0, None)


def test_the_frontier_keeps_the_points_nothing_beats_on_both():
    points = [(1e6, 91.4), (5e5, 91.4), (4e3, 90.8), (4e3, 90.5), (1e3, 89.3), (2e4, 89.0), (4e3, 75.0)]
    assert fc.frontier(points) == [4, 2, 1]
    assert fc.frontier([(1.0, 1.0)]) == [0]


def test_the_frontier_table_report_adds_bytes_plot_and_projection(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-frontier")
    out = tmp_path / "results"
    code, stdout, _ = run_report(
        ["--table", "cpu-frontier", "--runs-root", str(tmp_path / "runs"), "--out", str(out)], capsys
    )
    assert code == 0, stdout
    assert (out / "cpu-frontier-bytes.png").read_bytes().startswith(PNG)
    md = (out / "cpu-frontier-projection.md").read_text()
    assert "| method | top1 | H | bytes/exchange (ResNet-50) | 1 Gb/s, 0.1 ms |" in md
    assert md.count("\n| ") == 1 + 10  # the header and the 10 arms
    assert "- 1 Gb/s, 30 ms: fastest " in md
    proj = json.loads((out / "cpu-frontier-projection.json").read_text())
    assert len(proj["arms"]) == 10 and all(len(a["step_s"]) == 6 for a in proj["arms"])
    # a table that is not a frontier adds nothing
    fake_table(tmp_path / "runs", "cpu-compact")
    run_report(["--table", "cpu-compact", "--runs-root", str(tmp_path / "runs"), "--out", str(out)], capsys)
    assert not list(out.glob("cpu-compact-projection*"))


def test_each_arm_finds_the_wire_bench_configuration_of_its_compression_settings():
    trained = ("task.compression_warmup_epochs=1", "compression.wire_values=fp16", "optim.lr=0.1")
    assert fc.bench_name("dgc", trained) == "dgc_fp16"
    assert fc.bench_name("dgc_chunk", trained) == "dgc_chunk_fp16"
    assert fc.bench_name("diloco", ("local_steps.every=16", "local_steps.outer_lr=0.7")) == "diloco"
    assert fc.bench_name("dgc", ("compression.density=0.01",)) is None  # the bench has no such configuration


def test_the_wire_bench_prices_resnet50s_own_bytes_when_it_is_resnet50s_at_each_presets_density(tmp_path):
    path = tmp_path / "wire.json"
    assert fc.wire_bench(path) == {}  # no file: the runs' ratios
    bench = {"numel": W.numel, "density": None, "compressors": {"dgc_fp16": {"sent_bytes": 300_000}}}
    path.write_text(json.dumps(bench))
    assert fc.wire_bench(path) == {"dgc_fp16": 300_000.0}
    for wrong in ({"numel": 11_000_000}, {"density": 0.01}):  # another model; one density for every preset
        path.write_text(json.dumps({**bench, **wrong}))
        assert fc.wire_bench(path) == {}
    arm = fc.arm_cost("DGC", "dgc", 0, wire_ratio=100.0, measured=("dgc_fp16", 300_000.0))
    assert (arm.nbytes, arm.bench) == (300_000.0, "dgc_fp16")
    assert fc.arm_cost("DGC", "dgc", 0, wire_ratio=100.0).bench == ""


def test_the_report_prices_from_the_wire_bench_beside_the_runs_and_marks_the_rest(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-frontier")
    (tmp_path / "bench").mkdir()
    bench = {"numel": W.numel, "density": None, "compressors": {"none": {"sent_bytes": DENSE},
                                                                 "dgc_fp16": {"sent_bytes": 2**20}}}  # fmt: skip
    (tmp_path / "bench" / "wire.json").write_text(json.dumps(bench))
    out = tmp_path / "results"
    code, stdout, _ = run_report(
        ["--table", "cpu-frontier", "--runs-root", str(tmp_path / "runs"), "--out", str(out)], capsys
    )
    assert code == 0, stdout
    rows = {line.split(" | ")[0][2:]: line for line in (out / "cpu-frontier-projection.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| method")}  # fmt: skip
    dgc, dense = "DGC (the paper's settings), lr x4", "dense fp32 allreduce, lr x2"
    assert "| 1.00 MB |" in rows[dgc] and f"| {DENSE / 2**20:,.2f} MB |" in rows[dense]
    assert all(" MB * |" in line for name, line in rows.items() if name not in (dgc, dense)), rows
    proj = json.loads((out / "cpu-frontier-projection.json").read_text())
    assert {a["method"]: a["bench"] for a in proj["arms"]}[dgc] == "dgc_fp16"


def test_the_projection_from_the_wire_bench_alone(tmp_path, capsys):
    wire = tmp_path / "wire.json"
    names = ("none", "bf16", "powersgd", "dgc_fp16", "dgc_chunk_fp16", "diloco", "demo_flat", "sparseloco_dense_rest")
    rows = {n: {"sent_bytes": 1000.0 * (i + 1)} for i, n in enumerate(names)}
    wire.write_text(json.dumps({"numel": W.numel, "density": None, "compressors": rows}))
    fc.main(["--wire", str(wire)])
    md = capsys.readouterr().out
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(lines) == 10 and not any(" * |" in line for line in lines)  # every arm priced from the bench
    h16 = next(line for line in lines if line.startswith("| DiLoCo, H = 16"))
    assert h16.split(" | ")[2] == "16"  # H from the row's local_steps.every
    sparseloco = next(line for line in lines if line.startswith("| SparseLoCo"))
    assert sparseloco.split(" | ")[2] == "16"  # H from the preset's default
    # a setting the table does not run is priced beside its arms when the bench has it, with no accuracy
    rows["dgc_chunk_one"] = {"sent_bytes": 2000.0}
    wire.write_text(json.dumps({"numel": W.numel, "density": None, "compressors": rows}))
    fc.main(["--wire", str(wire)])
    one = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {fc.WHAT_IF['dgc_chunk_one']}")]
    assert len(one) == 1 and one[0].split(" | ")[1] == "-"
    # no usable bench, a table that is not a frontier: one line, exit 1
    cases = (
        (["--wire", str(tmp_path / "none.json")], "no wire bench of ResNet-50"),
        (["--table", "cpu-fmnist", "--wire", str(wire)], "not a frontier table; valid: cpu-frontier"),
        (["--wire", str(wire), "--workers", "1"], "--workers must be an integer >= 2, got 1"),
    )
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            fc.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_a_loss_frontier_keeps_the_lower_points():
    points = [(10.0, 1.3), (10.0, 1.2), (100.0, 1.25), (1000.0, 1.1)]
    assert fc.frontier(points, higher=False) == [1, 3]
    assert fc.frontier(points) == [0]  # higher is better: the fewest bytes and the highest value


def test_the_language_model_frontier_prices_gpt2_on_8_workers_with_nothing_dense():
    gpt2 = hardware.GPT2_124M
    arm = fc.arm_cost("DGC (b)", "dgc", 0, wire_ratio=500.0, steps=7773, w=gpt2)
    assert arm.collectives == ("lengths", "allgather") and arm.rest_bytes == 0
    assert arm.nbytes == pytest.approx(4 * gpt2.numel / 500)
    diloco = fc.arm_cost("DiLoCo", "diloco_bf16", 256, wire_ratio=512.0, steps=7773, w=gpt2)
    assert diloco.every == 256 and diloco.nbytes == pytest.approx(4 * gpt2.numel * (7773 / 31) / 512)
    proj = fc.projection([arm, diloco], 8, gpt2)
    assert proj["workload"] == "gpt2_124m" and proj["workers"] == 8
    assert proj["compute_s"] == pytest.approx(0.133, rel=1e-3)
    assert fc.wire_bench(ROOT / "results" / "bench" / "wire.json", gpt2) == {}  # ResNet-50's bench prices no GPT-2
