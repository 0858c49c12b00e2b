"""A Hydra multirun (``python -m dgc.train -m``) lists the run directories it made in its sweep folder, says
where at the end, and ``python -m dgc.repro.report`` takes that folder, naming each row by what the run is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dgc.tasks.tiny_data import write_fmnist

from dgc.repro import report

TINY = ["train.max_steps=2", "data.limit=64", "data.eval_limit=32", "train.batch_size=8", "train.eval_batch_size=32"]


def test_a_sweep_lists_its_run_dirs_and_the_report_names_them_by_what_they_are(tmp_path, capsys):
    data = write_fmnist(tmp_path / "fmnist", n_train=64, n_test=32)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "dgc.train", "-m", "task=fmnist_resnet20", "compression=none,dgc", *TINY,
           f"data.root={data}", "train.progress=false"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = tmp_path.glob("runs/multirun/*/run_dirs.txt")
    listed = [Path(line) for line in record.read_text().splitlines()]
    made = sorted(p.parent for p in tmp_path.glob("runs/fmnist_resnet20/*/*/summary.json"))
    assert len(listed) == 2 and sorted(listed) == made
    folder = record.parent.relative_to(tmp_path)
    last = done.stdout.strip().splitlines()[-1]
    assert last == (f"[multirun] {folder / 'run_dirs.txt'} lists the 2 run directories of this sweep; their table: "
                    f"python -m dgc.repro.report {folder}")  # fmt: skip

    code = 0
    try:
        report.main([str(record.parent), "--out", str(tmp_path / "o")])
    except SystemExit as exc:
        code = exc.code
    assert code in (0, None)
    table = (tmp_path / "o" / "report.md").read_text().split("\n\n")[1]
    rows = [line.split(" | ")[1] for line in table.splitlines()[2:]]
    assert rows == ["none", "dgc"]  # named by the compression, not by the directory's time stamp


def test_a_multirun_under_the_launcher_says_how_to_sweep_each_point_on_n_workers(tmp_path):
    for launcher, env, expected in (
        (["--nproc", "2"], {}, "error: --nproc 2 with -m: a Hydra multirun runs its points one after another"),
        ([], {"WORLD_SIZE": "2"}, "error: a Hydra multirun (-m) inside torchrun would run the whole sweep on every"),
    ):
        cmd = [sys.executable, "-m", "dgc.train", *launcher, "-m", "task=fmnist_resnet20", "compression=none,dgc"]
        out = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith(expected) and out.stderr.count("\n") == 1
        assert "per point" in out.stderr and list(tmp_path.iterdir()) == []
