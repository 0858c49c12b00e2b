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
from dgc.tasks.tiny_data import write_fmnist

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
    assert lines[-1].endswith("checkpoint state of 2 ranks")  # every rank's compression state, not rank 0's alone


def test_the_report_command_writes_where_the_readme_says_with_a_run_missing(tmp_path, monkeypatch, capsys):
    """README's report command on the shipped layout (results/runs/<table>/) while a run is still missing: the
    table is written where the README's comment says, the missing row marked, exit 0."""
    from dgc.repro import report
    from tests.test_report import fake_table

    (line,) = [line for line in blocks(section("The paper's tables"), "bash")[0].splitlines()
               if line.startswith("python -m dgc.repro.report")]  # fmt: skip
    command, comment = line.split("#", 1)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "dgc.repro.report"] and "results/cpu-fmnist.{md,csv}" in comment
    monkeypatch.chdir(tmp_path)
    fake_table(Path("results/runs"), "cpu-fmnist", skip=("topk-s1",))
    report.main(words[3:])  # no SystemExit: status 0
    out, err = capsys.readouterr()
    assert "| Gradient Dropping | 1 | not run |" in (tmp_path / "results" / "cpu-fmnist.md").read_text()
    assert (tmp_path / "results" / "cpu-fmnist.csv").is_file() and "wrote results/cpu-fmnist.md" in out
    assert err.startswith("warning: table cpu-fmnist: 1 of 12 runs not done yet") and "topk-s1" in err
    assert "`make cpu-fmnist SWEEP_ARGS=--skip-done`" in err


def test_the_cost_model_numbers_are_what_explain_prints():
    """README quotes two ratios of hierarchical to flat DGC at 128 x 8, 1 Gbps: of the exchange times and of the
    speed-ups of a whole step; `python -m dgc.bench costmodel --explain` prints both, and the README names it."""
    cmd = [sys.executable, "-m", "dgc.bench", "costmodel", "--explain", "--machines", "128", "--ranks-per-node", "8"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    exchange = re.search(r"hierarchical is ([\d.]+)x faster than flat \(exchange time alone\)", out.stdout)
    speedup = re.search(r"\(hierarchical ([\d.]+)x flat's\)", out.stdout)
    assert exchange and speedup, out.stdout
    text = " ".join(section("Performance").split())
    assert f"hierarchical DGC's speed-up over one worker is {speedup[1]}x flat DGC's, for a whole step" in text
    assert f"its exchange alone is {exchange[1]}x faster than flat's" in text
    assert "`python -m dgc.bench costmodel --explain --machines 128 --ranks-per-node 8` prints both" in text


def test_the_local_cluster_is_run_as_root_and_stop_keeps_what_purge_removes():
    slurm_readme = (ROOT / "launch" / "slurm" / "README.md").read_text()
    for text in (README, slurm_readme):
        assert not re.search(r"^sudo launch/slurm/local_cluster\.sh", text, flags=re.M)
    flat = " ".join(section("The paper's tables").split())
    assert "`launch/slurm/local_cluster.sh start`, as root (`sudo` when you are not)" in flat
    assert "`stop` stops its daemons and keeps `/etc/slurm`, `/etc/munge` and the packages" in flat
    assert "`stop --purge` also removes those" in flat
    assert "each job's log: `runs/slurm/<job name>-<job id>.out`" in flat
    # what the script does: stop removes nothing; purge removes what the manifest lists (/etc/slurm, /etc/munge, ...)
    script = (ROOT / "launch" / "slurm" / "local_cluster.sh").read_text()
    assert "((PURGE == 0)) || purge" in script and "PKG_DIRS=(/etc/slurm /etc/munge" in script


def test_the_examples_run_as_written(tmp_path):
    """README's "Use it with Lightning or Accelerate": each example command as written (the examples' paths from the
    checkout), in a fresh directory; the resumed runs continue from what the first ones saved."""
    from tests.multiproc import kill_tree

    block = blocks(section("Use it in your training script"), "bash")
    commands = [shlex.split(line, comments=True) for b in block for line in b.splitlines() if "examples/" in line]
    assert len(commands) == 7
    env = environment(tmp_path)
    for words in commands:
        words = [str(ROOT / w) if w.startswith("examples/") else w for w in words]
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]] if words[0] == "torchrun" else words
        proc = subprocess.Popen(words, cwd=tmp_path, env={**env, "TMPDIR": str(tmp_path)}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
        assert proc.returncode == 0, f"{shlex.join(words)}:\n{out[-3000:]}"
        if "--resume" in words:
            assert "epoch 3" in out or "epoch 2:" in out, out[-2000:]  # it went on from the saved epoch
            assert "epoch 0:" not in out, out[-2000:]
    assert (tmp_path / "runs/examples/ddp_hook/checkpoint.pt").exists()
    assert (tmp_path / "runs/examples/lightning/last.ckpt").exists()
    assert (tmp_path / "runs/examples/accelerate/state/custom_checkpoint_0.pkl").exists()
