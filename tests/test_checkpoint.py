"""dgc.repro.checkpoint: rotation, the fallback to the previous file, safe loading, the settings a resume may change."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from dgc.repro import checkpoint
from dgc.repro.config import Config


def state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "counters": {"step": step},
            "last_eval": ({}, -1), "world_size": 1, "ranks": [{}], "config": {"seed": 0}}  # fmt: skip


def test_the_last_two_are_kept_and_the_newest_readable_one_is_chosen(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]
    path, got, warnings = checkpoint.choose(tmp_path)
    assert path.name == "checkpoint.pt" and got["counters"]["step"] == 3 and warnings == []
    (tmp_path / "checkpoint.pt").write_bytes((tmp_path / "checkpoint.pt").read_bytes()[:100])  # torn
    path, got, warnings = checkpoint.choose(tmp_path)
    assert path.name == "checkpoint.prev.pt" and got["counters"]["step"] == 2
    assert len(warnings) == 1 and "checkpoint.pt is unreadable" in warnings[0]


def test_a_failed_save_keeps_the_checkpoints_there_were(tmp_path):
    checkpoint.save(tmp_path, state(1))
    checkpoint.save(tmp_path, state(2))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(Exception):  # noqa: B017 - the write fails half way
        checkpoint.save(tmp_path, {"model": lambda: 0})  # not picklable
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


class Payload:
    def __reduce__(self):
        return (os.getpid, ())


#: a process that saves checkpoints of steps 1 and 2, then step 3 and SIGKILLs itself at ``where``
KILLED_SAVE = """
import os, signal, sys, torch
from pathlib import Path
from dgc import atomic
from dgc.repro import checkpoint
run_dir, where = Path(sys.argv[1]), sys.argv[2]
def state(step):
    return {"model": {"w": torch.full((1000,), float(step))}, "optimizer": {}, "counters": {"step": step},
            "last_eval": ({}, -1), "world_size": 1, "ranks": [{}], "config": {"seed": 0}}
checkpoint.save(run_dir, state(1))
checkpoint.save(run_dir, state(2))
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "writing":  # half the file written
    real = torch.save
    def half(obj, f):
        real(obj, f); f.flush(); f.truncate(f.tell() // 2); f.flush(); die()
    torch.save = half
else:  # between the two renames
    real_write_with = atomic.write_with
    def cut(path, write, before_replace=None):
        return real_write_with(path, write, before_replace=lambda: (before_replace(), die()))
    atomic.write_with = cut
checkpoint.save(run_dir, state(3))
"""


@pytest.mark.parametrize("where", ["writing", "between-renames"])
def test_a_save_killed_anywhere_is_recovered_at_the_next_start(where, tmp_path):
    """SIGKILL while the file is written leaves a half file: removed at the next start, steps 2 and 1 kept. SIGKILL
    between the two renames leaves step 3 complete under its temporary name: finished, not fallen back from."""
    out = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), where], capture_output=True, text=True)
    assert out.returncode == -9, out.stderr
    leftover = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftover) == 1
    warnings = checkpoint.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]
    steps = [checkpoint.load(tmp_path / n)["counters"]["step"] for n in ("checkpoint.pt", "checkpoint.prev.pt")]
    if where == "writing":
        assert steps == [2, 1]
        assert len(warnings) == 1 and warnings[0].startswith(f"removed 1 unfinished temporary file(s) of an earlier "
                                                             f"stop ({leftover[0]}; ")  # fmt: skip
    else:
        assert steps == [3, 2]
        assert warnings == [f"finished the checkpoint of step 3 that a stop left under {leftover[0]}"]
    assert checkpoint.recover(tmp_path) == []  # nothing left to do


def test_every_save_leaves_no_temporary_and_the_latest_always_exists(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, state(step))
        assert checkpoint.leftovers(tmp_path) == []
    assert checkpoint.load(tmp_path / "checkpoint.prev.pt")["counters"]["step"] == 2


def test_only_tensors_and_plain_containers_are_loaded(tmp_path):
    bad = state(1)
    bad["counters"]["step"] = Payload()
    torch.save(bad, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="holds objects other than tensors and plain containers.*refused"):
        checkpoint.load(tmp_path / "checkpoint.pt")
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a dgc checkpoint"):
        checkpoint.load(tmp_path / "other.pt")


def test_changed_settings_name_what_differs_unless_allowed_or_free():
    saved = {"seed": 0, "optim": {"lr": 0.1, "milestones": [2]}, "train": {"epochs": 4, "progress": True},
             "logger": {"wandb": False}, "resume": False}  # fmt: skip
    now = {"seed": 0, "optim": {"lr": 0.2, "milestones": [3]}, "train": {"epochs": 6, "progress": False},
           "logger": {"wandb": True}, "resume": "auto"}  # fmt: skip
    assert checkpoint.changed_settings(saved, now, []) == [
        "optim.lr: 0.1 -> 0.2",
        "optim.milestones: [2] -> [3]",
        "train.epochs: 4 -> 6",
    ]
    assert checkpoint.changed_settings(saved, now, ["train.epochs", "optim"]) == []
    assert checkpoint.changed_settings(saved, saved, []) == []


def test_an_option_added_since_the_checkpoint_is_no_change_at_its_default():
    """A checkpoint written before sync.local_bus existed resumes while the option keeps its default."""
    cfg = Config()
    now = asdict(cfg)
    saved = asdict(cfg)
    del saved["sync"]["local_bus"]
    assert checkpoint.changed_settings(saved, now, [], cfg=cfg) == []
    cfg.sync.local_bus = "group"
    assert checkpoint.changed_settings(saved, asdict(cfg), [], cfg=cfg) == ["sync.local_bus: '(absent)' -> 'group'"]
    # without the config, any absent setting counts as a change
    assert checkpoint.changed_settings(saved, now, []) == ["sync.local_bus: '(absent)' -> 'auto'"]
