"""The log line of a training step says that its ratio is the step's, and when the step is inside the
compression warm-up (the run's ratio, in summary.json, leaves the warm-up out)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from dgc.repro.rundir import MetricsLog, RunFiles


def _files(tmp_path, warmup_epochs: float) -> RunFiles:
    files = RunFiles.__new__(RunFiles)  # only what log_step uses
    files.cfg = SimpleNamespace(compression=SimpleNamespace(name="dgc", warmup_epochs=warmup_epochs))
    files.main, files.progress, files.wandb = True, None, None
    files.metrics = MetricsLog(tmp_path / "metrics.jsonl")
    return files


def _record(step: int, epoch: float, sent: int, ratio: float) -> dict:
    return {"kind": "train", "step": step, "epoch": epoch, "train_loss": 2.2048, "lr": 0.02489, "density": 0.004,
            "sent_bytes": sent, "wire_ratio": ratio, "compute_s": 0.489, "compress_s": 0.0335,
            "communicate_s": 0.0, "step_s": 0.5, "skipped": 0}  # fmt: skip


def test_the_step_line_says_its_ratio_is_the_steps_and_the_warmup(tmp_path, capsys):
    files = _files(tmp_path, warmup_epochs=1.0)
    files.log_step(_record(30, 0.91, 9216, 116.9))
    line = capsys.readouterr().out.strip()
    assert line == ("step 30 epoch 0.91 loss 2.2048 lr 0.02489 density 0.004 sent 9.0KB (ratio 117x this step, in "
                    "the compression warm-up to epoch 1) compute 489ms compress 33.5ms comm 0.0ms")  # fmt: skip
    files.log_step(_record(500, 1.07, 4056, 265.7))
    line = capsys.readouterr().out.strip()
    assert "sent 4.0KB (ratio 266x this step) compute" in line and "warm-up" not in line


def test_a_dense_run_has_no_warmup(tmp_path, capsys):
    files = _files(tmp_path, warmup_epochs=0.0)
    files.cfg = SimpleNamespace(compression=SimpleNamespace(name="none"))  # no warmup_epochs at all
    files.log_step(_record(10, 0.1, 1077736, 1.0))
    assert "(ratio 1x this step) compute" in capsys.readouterr().out


def test_a_step_that_sent_nothing_shows_no_ratio(tmp_path, capsys):
    """A skipped step (a non-finite gradient somewhere) sends nothing: no made-up ratio of the dense size to 1 byte."""
    files = _files(tmp_path, warmup_epochs=0.0)
    files.log_step({**_record(7, 0.2, 0, 1077736.0), "skipped": 1})
    line = capsys.readouterr().out.strip()
    assert "sent 0B (nothing sent this step) compute" in line and line.endswith("skipped 1 (non-finite)")
    assert "1077736x" not in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_logging_names_the_log_and_how_to_continue():
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    from dgc.repro.config import ConfigError

    with pytest.raises(ConfigError) as err:
        MetricsLog("/dev/full").write({"kind": "train", "step": 7})
    want = ("no space left on the device of /dev/full while logging step 7: free space there, then run the same "
            "command with resume=auto (it continues from the last checkpoint)")  # fmt: skip
    assert str(err.value) == want
