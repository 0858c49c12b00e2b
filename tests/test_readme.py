"""The README's commands run as written: the training examples (with tiny overrides appended where the
full run would take long) and the library script, so the README cannot drift from the code."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.datafiles import write_fmnist

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FMNIST = Path("/usr/share/datasets/fashion-mnist")
#: appended to the README's commands that would train a whole task
TINY = ["train.max_steps=2", "data.limit=64", "data.eval_limit=32", "train.batch_size=8", "train.eval_batch_size=32"]


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def train_commands() -> list[list[str]]:
    """The commands of the first block of "Train any task" (``source`` lines are what the environment does)."""
    commands = []
    for line in blocks(section("Train any task"), "bash")[0].splitlines():
        words = shlex.split(os.path.expandvars(line), comments=True)
        if words and words[0] != "source":
            commands.append(words)
    return commands


def environment(tmp: Path) -> dict[str, str]:
    """What ``source .venv/bin/activate`` gives: the interpreter running the tests first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env["DGC_DATA"] = str(tmp / "data")
    return env


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> list[str]:
    """The Fashion-MNIST the README's commands use, or a tiny one where the Debian package is missing."""
    if (FMNIST / "train-images-idx3-ubyte.gz").exists() or (FMNIST / "train-images-idx3-ubyte").exists():
        return []
    return [f"data.root={write_fmnist(tmp_path_factory.mktemp('data') / 'fmnist', n_train=128, n_test=64)}"]


def test_the_train_block_is_what_this_test_runs():
    commands = train_commands()
    assert len(commands) == 6
    assert [c[0] for c in commands] == ["python", "python", "python", "torchrun", "python", "python"]


@pytest.mark.parametrize("index", range(6))
def test_train_command_runs_as_written(index, fmnist, tmp_path):
    words = train_commands()[index]
    after = words[words.index("dgc.train") + 1 :]
    quick, sweep, show = "train.max_steps=30" in words, after[:1] == ["-m"], "--cfg" in words
    extra = [] if show else [*fmnist] if quick else [*TINY, *fmnist]
    if not sweep and not show:
        extra.append(f"run_dir={tmp_path / 'run'}")
    out = subprocess.run([*words, *extra], cwd=tmp_path, env=environment(tmp_path), capture_output=True,
                         timeout=600)  # fmt: skip
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, f"{shlex.join(words)}\n{stderr[-3000:]}"
    if show:
        assert "compression:" in stdout and "name: dgc" in stdout and str(Path.home()) in stdout
        return
    if sweep:  # one run per compressor under runs/
        assert len(list(tmp_path.glob("runs/fmnist_resnet20/*/*/summary.json"))) == 3
        return
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "fmnist_resnet20" and summary["compression"] == "dgc"
    assert isinstance(summary["wire_ratio"], float) and summary["wire_ratio"] > 1
    assert b"\r" not in out.stdout + out.stderr  # piped: plain log lines, no progress bar
    if quick:
        assert summary["steps"] == 30
        assert summary["wire_ratio_over"].startswith("all steps")  # 30 steps end inside DGC's warm-up


def test_the_library_script_trains_on_two_workers(tmp_path):
    script = blocks(section("Use it in your training script"), "python")[0]
    (tmp_path / "train_dgc.py").write_text(script)
    cmd = ["torchrun", "--standalone", "--nproc_per_node=2", "train_dgc.py"]
    out = subprocess.run(cmd, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 3 and "density 0.01" in lines[-1] and "bytes sent" in lines[-1]
