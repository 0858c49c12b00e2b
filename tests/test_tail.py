"""dgc.repro.tail: the end of a run from its metrics.jsonl, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from dgc.repro import tail


def write_run(path, summary: bool = True) -> None:
    path.mkdir(parents=True)
    lines = [{"kind": "train", "step": s, "train_loss": float(s)} for s in range(10, 101, 10)]
    # evaluations every 25 steps: dev_wer 50, 40, 30, 20; the last one also carries the test metrics
    lines += [{"kind": "eval", "step": 25 * i, "dev_wer": 60.0 - 10 * i} for i in range(1, 4)]
    lines.append({"kind": "eval", "step": 100, "dev_wer": 20.0, "wer": 25.0, "loss": 3.0})
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"kind": "train", "st'  # a line cut by a crash
    (path / "metrics.jsonl").write_text(text)
    if summary:
        (path / "summary.json").write_text(json.dumps({"metrics": {"wer": 25.0, "loss": 3.0}}))


def test_means_over_the_last_steps_and_evaluations(tmp_path):
    write_run(tmp_path / "run")
    out = tail.summarize(tmp_path / "run", train_steps=30, evals=2)
    # steps 80, 90 and 100 are within 30 of the last; the test metrics of the last evaluation are not averaged
    assert out["steps"] == 100 and out["train_loss"] == pytest.approx(90.0)
    assert out["dev_wer@last2"] == pytest.approx(25.0) and "wer@last2" not in out
    assert out["final"] == {"wer": 25.0, "loss": 3.0}
    # fewer evaluations than asked: the key says how many were averaged
    assert tail.summarize(tmp_path / "run", evals=10)["dev_wer@last4"] == pytest.approx(35.0)


def test_cli_lines_and_errors(tmp_path, capsys):
    write_run(tmp_path / "done")
    write_run(tmp_path / "running", summary=False)
    tail.main([str(tmp_path / "done"), str(tmp_path / "running"), "--train-steps", "10", "--evals", "1"])
    done, running = capsys.readouterr().out.splitlines()
    assert "train_loss 100" in done and "dev_wer@last1 20" in done and "final wer 25" in done
    assert running.endswith("no summary.json yet")
    tail.main([str(tmp_path / "done"), "--json"])
    assert json.loads(capsys.readouterr().out)["final"]["wer"] == 25.0
    with pytest.raises(SystemExit) as exc:
        tail.main([str(tmp_path / "missing")])
    assert str(exc.value).startswith("error: cannot read") and "\n" not in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        tail.main([str(tmp_path / "done"), "--evals", "0"])
    assert str(exc.value) == "error: --train-steps and --evals must be at least 1 (got 1000 and 0)"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="logs no training step"):
        tail.main([str(tmp_path / "empty")])
