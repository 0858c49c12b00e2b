"""``python -m dgc.bench``: the CLI contract (one JSON on stdout, the same text in the file,
one-line errors) and the wire-size claim on ResNet-50."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgc.bench.common import configurations
from dgc.repro import presets

ROOT = Path(__file__).resolve().parents[1]
RESNET50_NUMEL = 25_557_032
COMMON_KEYS = {"bench", "torch", "threads", "device", "platform", "argv", "command", "timestamp_utc"}


def bench(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "dgc.bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def bench_here(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m dgc.bench ARGS`` in this process: its exit status, stdout and stderr."""
    from dgc.bench import main

    try:
        code = main(list(args))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def ok(proc: subprocess.CompletedProcess[str], out: Path) -> dict:
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert out.read_text() == proc.stdout
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary left
    return result


def test_select_small(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "select.json"  # parent folders are created
    r = ok(bench("select", "--numel", "200000", "--repeats", "2", "--seed", "3", "--out", str(out)), out)
    assert COMMON_KEYS <= r.keys()
    assert r["bench"] == "select" and r["device"] == "cpu" and r["argv"][1:3] == ["select", "--numel"]
    assert r["command"].startswith("python -m dgc.bench select --numel 200000")
    assert {"machine", "cpu_count"} <= r["platform"].keys()
    assert r["numel"] == 200_000 and r["density"] == 0.001 and r["k"] == 200 and r["repeats"] == 2
    for key in ("dgc_ms", "accumulate_ms", "select_ms", "gather_mask_ms", "topk_ms", "pass_ms"):
        assert r[key] > 0, key
        assert len(r["runs_ms"][key.removesuffix("_ms")]) == 2
    assert r["dgc_over_topk"] == pytest.approx(r["dgc_ms"] / r["topk_ms"])
    assert r["dgc_over_pass"] == pytest.approx(r["dgc_ms"] / r["pass_ms"])
    assert 0.8 * r["k"] <= r["selected"] <= r["k"]
    assert r["round_orders"] == ["dgc/topk/pass", "topk/pass/dgc"]


def test_default_out_path_is_not_the_committed_results(tmp_path: Path) -> None:
    r = ok(bench("select", "--numel", "5000", "--repeats", "1", cwd=tmp_path), tmp_path / "runs/bench/select.json")
    assert r["k"] == 5 and not (tmp_path / "results").exists()


def test_wire_all_compressors_small_model(tmp_path: Path) -> None:
    out = tmp_path / "wire.json"
    r = ok(bench("wire", "--model", "squeezenet1_1", "--density", "0.01", "--steps", "2", "--out", str(out)), out)
    assert COMMON_KEYS <= r.keys() and r["bench"] == "wire"
    assert r["model"] == "squeezenet1_1" and r["density"] == 0.01
    assert r["numel"] == r["numel_dim_gt1"] + r["numel_rest"] > 0
    # every compression preset of python -m dgc.train, and the variants
    names = ["none", "fp16", "topk", "dgc", "dgc_int32", "dgc_fp16", "dgc_rice", "dgc_compact", "dgc_compact_all"]
    names += ["terngrad", "powersgd"]
    assert set(names) <= set(r["compressors"]) and list(r["compressors"]) == list(configurations())
    assert set(presets.names()) <= set(r["compressors"])
    for name, row in r["compressors"].items():
        assert row["dense_bytes"] == 4 * r["numel"], name
        assert row["wire_ratio"] == pytest.approx(row["dense_bytes"] / row["sent_bytes"]), name
    c = r["compressors"]
    assert c["none"]["wire_ratio"] == 1.0 and c["fp16"]["wire_ratio"] == 2.0
    assert c["dgc"]["options"] == {"density": 0.01} and c["topk"]["options"] == {"density": 0.01}
    assert c["dgc_int32"]["options"] == {"density": 0.01, "wire_indices": "int32"}
    assert c["dgc_int32"]["sent_bytes"] > c["dgc"]["sent_bytes"] > c["dgc_fp16"]["sent_bytes"]
    assert c["dgc"]["sent_bytes"] > c["dgc_rice"]["sent_bytes"]
    assert c["dgc"]["compressed_numel"] == r["numel_dim_gt1"]
    assert c["dgc_compact_all"]["policy"] == {"min_ndim": 1} and c["dgc_compact_all"]["compressed_numel"] == r["numel"]
    # the compact format sends the 1-D tensors in 1 bit each: fewer bytes than dgc_fp16 with them in fp32
    assert c["dgc_compact"]["policy"] == {"dense_values": "1bit"}
    assert c["dgc_compact"]["compressed_numel"] == r["numel_dim_gt1"]
    assert c["dgc_compact"]["sent_bytes"] < c["dgc_fp16"]["sent_bytes"]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["select", "--density", "0"], "(0, 1]"),
        (["select", "--repeats", "0"], ">= 1"),
        (["select", "--device", "tpu"], "'cpu', 'cuda'"),
        (["wire", "--model", "nosuchmodel"], "resnet50"),
        (["wire", "--compressors", "dgc,zip"], "powersgd"),
        (["frobnicate"], "'select', 'wire', 'ops', 'cluster'"),
        (["cluster", "--ddp"], "--ddp and --comm-ratios go with --e2e"),
        (["cluster", "--e2e", "--comm-ratios", "2"], "--comm-ratios goes with --ddp"),
        (["cluster", "--e2e", "--ddp", "--comm-ratios", "0,2"], "must be numbers > 0"),
        (["cluster", "--e2e", "--ddp", "--methods", "ddp,zip"], "ddp_powersgd4,dgc,dgc_overlap"),
    ],
)
def test_bad_arguments(tmp_path: Path, capsys, args: list[str], expect: str) -> None:
    """In this process (the exit status and the one line of a real process: test_out_is_a_folder,
    test_cuda_unavailable_is_one_line)."""
    out = tmp_path / "x.json"
    code, stdout, stderr = bench_here(capsys, *args, "--out", str(out))
    assert code != 0
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and expect in lines[0], stderr
    assert not out.exists()


def test_cuda_unavailable_is_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "x.json"
    proc = bench("select", "--device", "cuda", "--numel", "1000", "--out", str(out))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0]
    assert not out.exists()


def test_wire_keeps_each_presets_density_unless_told() -> None:
    """Without --density every preset runs at its own (SparseLoCo 2%, DGC 0.1%); with it, every sparse one at it."""
    from dgc.bench.wire import bench_wire

    r = bench_wire("squeezenet1_1", None, steps=1, compressors=["dgc", "sparseloco"])
    assert r["density"] is None
    dgc, sparseloco = r["compressors"]["dgc"], r["compressors"]["sparseloco"]
    assert sparseloco["density"] == pytest.approx(0.02, rel=0.1)
    assert dgc["density"] == pytest.approx(0.001, rel=0.5)
    r = bench_wire("squeezenet1_1", 0.001, steps=1, compressors=["sparseloco"])
    assert r["density"] == 0.001 and r["compressors"]["sparseloco"]["density"] == pytest.approx(0.001, rel=0.5)


def test_help(capsys) -> None:
    for args in ([], ["select"], ["wire"]):
        code, stdout, _ = bench_here(capsys, *args, "--help")
        assert code == 0 and "usage:" in stdout


def test_wire_resnet50_claim(tmp_path: Path) -> None:
    """The paper's setting: DGC at density 0.001 on ResNet-50 sends at least 270x fewer bytes."""
    out = tmp_path / "wire.json"
    names = "dgc,dgc_int32,dgc_compact,dgc_compact_all"
    r = ok(bench("wire", "--model", "resnet50", "--compressors", names, "--out", str(out)), out)
    assert r["numel"] == RESNET50_NUMEL
    dgc, int32 = r["compressors"]["dgc"], r["compressors"]["dgc_int32"]
    assert dgc["dense_bytes"] == RESNET50_NUMEL * 4
    assert dgc["wire_ratio"] >= 270
    assert 235 <= int32["wire_ratio"] < dgc["wire_ratio"]
    # the compact format (fp16 values, Rice-coded gaps, BatchNorm/bias in 1 bit) beats 4 bytes per
    # value; with every tensor sparse instead, a little more
    compact, compact_all = r["compressors"]["dgc_compact"], r["compressors"]["dgc_compact_all"]
    assert 1000 <= compact["wire_ratio"] < compact_all["wire_ratio"]


def test_out_is_a_folder(tmp_path: Path) -> None:
    proc = bench("select", "--numel", "1000", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "is a folder" in proc.stderr
    assert list(tmp_path.iterdir()) == []
