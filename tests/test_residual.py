"""dgc.repro.residual: the norms of DGC's velocity and residual in a checkpoint, and its one-line errors."""

from __future__ import annotations

import pytest
import torch

from dgc.repro import checkpoint, residual


def dgc_state(lr: float = 0.5) -> dict:
    # two ranks; tensor "a": |w| = 5, |u| = 1 on both ranks, |v| = 3 and 5 (mean 4); "b" is sent dense (no state)
    ranks = [
        {"compression": {"compressor": {"tensors": {"a": {"u": torch.tensor([1.0, 0, 0, 0]), "v": v}}}}}
        for v in (torch.tensor([3.0, 0, 0, 0]), torch.tensor([3.0, 4.0, 0, 0]))
    ]
    return {"model": {"a": torch.tensor([[3.0, 4.0], [0, 0]]), "b": torch.ones(2)}, "ranks": ranks,
            "optimizer": {"param_groups": [{"lr": lr}]}, "counters": {"step": 7}, "last_eval": ({}, -1),
            "world_size": 2, "config": {}}  # fmt: skip


def test_norms_are_averaged_over_the_ranks():
    rows, total = residual.summarize(dgc_state())
    assert [r["tensor"] for r in rows] == ["a"]
    (a,) = rows
    assert a["numel"] == 4 and a["w"] == 5 and a["u"] == 1 and a["v"] == 4 and a["v_over_u"] == 4
    # max / median of |v| per rank: 3 / 0 is clamped, so compare the second rank alone through a one-rank state
    one = dgc_state()
    one["ranks"] = one["ranks"][1:]
    one["ranks"][0]["compression"]["compressor"]["tensors"]["a"]["v"] = torch.tensor([1.0, 2.0, 2.0, 6.0])
    (b,), _ = residual.summarize(one)
    assert b["max_over_median"] == pytest.approx(6 / 2)
    assert total["ranks"] == 2 and total["step"] == 7 and total["lr"] == 0.5
    assert total["lr_v_over_w"] == pytest.approx(0.5 * 4 / 5)


def test_cli_prints_the_table_and_fails_in_one_line(tmp_path, capsys):
    checkpoint.save(tmp_path / "run", dgc_state())
    residual.main([str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "step 7, 2 ranks, lr 0.5" in out and "|v|/|u| 4.0" in out
    with pytest.raises(SystemExit, match="no usable checkpoint.pt"):
        residual.main([str(tmp_path / "empty")])
    dense = dgc_state()
    for r in dense["ranks"]:
        r["compression"]["compressor"]["tensors"] = {}
    checkpoint.save(tmp_path / "dense", dense)
    with pytest.raises(SystemExit, match="no DGC velocity and residual"):
        residual.main([str(tmp_path / "dense")])
