"""``python -m dgc.bench gpu`` (make gpu-check): its refusal without a GPU and its self-test on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dgc.bench import gpu

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgc.bench", "gpu", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_one_line_and_non_zero(tmp_path: Path) -> None:
    out = gpu_check("--out-dir", str(tmp_path / "gpu"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "python -m dgc.bench gpu: error: no CUDA device here: the GPU check needs one "
        "(--self-test checks the script on the CPU)"
    ]
    assert not (tmp_path / "gpu").exists()


def test_unknown_part_is_refused(tmp_path: Path) -> None:
    out = gpu_check("--self-test", "--parts", "tests,nope", "--out-dir", str(tmp_path))
    assert out.returncode == 2
    assert "unknown part 'nope'; valid: tests, tasks, collectives, select, cluster" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_self_test_runs_every_part_and_writes_the_summary(tmp_path: Path) -> None:
    out = gpu_check("--self-test", "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["self_test"]
    parts = summary["parts"]
    assert set(parts) == {"tests", "tasks", "collectives", "select", "cluster"}
    collectives = {r["name"]: r for r in parts["collectives"]["runs"]}
    assert parts["collectives"]["ok"] and parts["collectives"]["backend"] == "gloo"
    assert set(collectives) == {"world_1 flat"}  # the part's logic; every run of it: the slow test below
    assert all(r["last_step"] == 6 for r in collectives.values())
    runs = {r["name"]: r for r in parts["tasks"]["runs"]}
    assert set(runs) == {"fmnist_resnet20", "ddp_hook_world_1", "resume"}
    assert all(r["ok"] for r in runs.values())
    assert runs["resume"]["last_step"] == 6  # stopped at 4, resumed to 6
    select = json.loads((tmp_path / "select_tiny.json").read_text())
    assert select["dgc_ms"] > 0 and select["topk_ms"] > 0
    assert parts["cluster"]["ok"] is None  # skipped, not failed
    for name in ("tests", "tasks", "collectives", "select", "cluster", "summary"):
        assert (tmp_path / f"{name}.json").exists()
    table = (tmp_path / "summary.md").read_text()
    assert "| collectives | world_1 flat | ok |" in table
    assert "| tasks | resume | ok |" in table and "| cluster |  | skipped | not in the self-test |" in table


def test_a_failing_part_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dgc.bench import gpu

    monkeypatch.setitem(gpu.PARTS, "select", lambda ctx: {"ok": False, "runs": [{"name": "x", "ok": False}]})
    args = gpu.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args(
        ["--self-test", "--parts", "select", "--out-dir", str(tmp_path)]
    )
    with pytest.raises(SystemExit) as stop:
        gpu.run(args)
    assert stop.value.code == 1
    assert "| select | x | FAILED |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", gpu.COLLECTIVE_RUNS + gpu.GPU_COLLECTIVE_RUNS)
def test_every_collective_run_passes_on_the_cpu(tmp_path: Path, name: str, extra: list[str]) -> None:
    # every run of the collectives part (on a GPU: NCCL), here on the CPU (gloo, a group of one): 4 steps, resumed
    # to 6; the CPU self-test runs only the first
    fm = str(gpu._writers().fmnist(tmp_path / "fmnist", n_train=32, n_test=16))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "2", gpu.COLLECTIVES_AT_WORLD_1: "1"})
    base = ["task=fmnist_resnet20", f"data.root={fm}", "train.progress=false", "device=cpu", *gpu.TINY[1:]]
    ctx = gpu.Context(tmp_path, 600, self_test=True)
    row = gpu._run_resumed([sys.executable, "-m", "dgc.train", *base, *extra], tmp_path / name, ctx, env)
    assert row["rc"] == 0 and row["ok_steps"], row
