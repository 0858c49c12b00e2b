"""python -m dgc.repro.report on run directories the tests write (summary.json, config.yaml, metrics.jsonl)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dgc.repro import plots, report
from dgc.repro.tables import SPEECH_CHOSEN, TABLES, get_table

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(
    run_dir: Path,
    task: str,
    compression: str,
    metrics: dict[str, float],
    kind: str = "image",
    world_size: int = 4,
    steps: int = 300,
    sent: float | None = 2400.0,
    dense: float = 1077736.0,
    evals: int = 3,
    local_steps: int = 0,
) -> Path:
    run_dir.mkdir(parents=True)
    headline = {"image": "top1", "language": "ppl", "speech": "wer", "causal_lm": "loss"}[kind]
    dense_run = compression == "none"
    summary = {
        "task": task,
        "compression": compression,
        "world_size": world_size,
        "local_steps": local_steps,
        "steps": steps,
        "metrics": metrics,
        "wire_ratio": 1.0 if dense_run else (dense / sent if sent else None),
        "bytes_per_step": dense if dense_run else sent,
        "dense_bytes_per_step": dense if (dense_run or sent) else None,
        "wire_ratio_all_steps": 1.0 if dense_run else 40.0,
        "wall_s": 12.5,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"task": {"name": task, "kind": kind}}))
    lines = [{"kind": "train", "step": 10, "loss": 2.0}]
    for i in range(1, evals + 1):
        value = metrics[headline] * i / evals
        lines.append({"kind": "eval", "step": steps * i // evals, "epoch": i, headline: value})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "ev')
    return run_dir


def fake_table(root: Path, name: str, skip: tuple[str, ...] = ()) -> None:
    table = get_table(name)
    kind = {"top1": "image", "ppl": "language", "wer": "speech", "loss": "causal_lm", "val_loss": "causal_lm"}
    for i, row in enumerate(table.rows):
        if row.key in skip:
            continue
        metrics = {m: 50.0 + i for m in table.metrics}
        fake_run(root / name / row.key, row.task, row.compression, metrics, kind[table.metrics[0]], row.world_size)


def run_report(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        report.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_table_report_puts_the_paper_beside_ours(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-fmnist")
    out = tmp_path / "results"
    code, stdout, _ = run_report(
        ["--table", "cpu-fmnist", "--runs-root", str(tmp_path / "runs"), "--out", str(out)], capsys
    )
    assert code == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu-fmnist-ratio.png", "cpu-fmnist-steps.png", "cpu-fmnist.csv", "cpu-fmnist.md"]
    md = (out / "cpu-fmnist.md").read_text()
    assert md == stdout.split("wrote ")[0].rstrip("\n") + "\n"
    # paper 93.75 / 92.75 / 93.87 and the paper's deltas; ours, two seeds each: 50 and 56 / 51 and 57 / 52 and 58
    # (53 and 59: the ablation without paper numbers), their means ± sample standard deviations, and the deltas
    # paired by seed; the second group (54 and 60 / 55 and 61) has its own baseline
    assert "| Gradient Dropping | 4 | 2 | 300 | 92.75 | 54.00 ± 4.24 | -1.00 | +1.00 |" in md
    assert "| DGC | 4 | 2 | 300 | 93.87 | 55.00 ± 4.24 | +0.12 | +2.00 |" in md
    assert "| DGC accumulating updates (ablation) | 4 | 2 | 300 | - | 56.00 ± 4.24 | - | +3.00 |" in md
    assert "| DGC | 4 | 2 | 300 | 93.87 | 58.00 ± 4.24 | +0.12 | +1.00 |" in md
    assert "1.03 → 0.00229" in md and "449x" in md
    assert "| DGC | 1 | 300 | 58.00 | 449x |" in md  # each run listed
    rows = list(csv.DictReader(io.StringIO((out / "cpu-fmnist.csv").read_text())))
    keys = ["none", "topk", "dgc", "dgc-updates", "none-e10", "dgc-e10"]
    assert [r["key"] for r in rows] == [f"{k}-s{s}" for s in (0, 1) for k in keys]
    assert [r["seed"] for r in rows] == ["0"] * 6 + ["1"] * 6
    assert float(rows[2]["paper_top1"]) == 93.87 and float(rows[2]["top1"]) == 52.0
    assert float(rows[2]["wire_ratio"]) == pytest.approx(1077736 / 2400)
    assert float(rows[0]["dense_mb"]) == pytest.approx(1077736 / 2**20)
    for png in ("cpu-fmnist-steps.png", "cpu-fmnist-ratio.png"):
        assert (out / png).read_bytes().startswith(PNG)
    assert not list(out.glob(".*.tmp"))


def test_a_table_without_paper_numbers_has_no_paper_columns(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-compact")
    out = tmp_path / "results"
    code, _, _ = run_report(
        ["--table", "cpu-compact", "--runs-root", str(tmp_path / "runs"), "--out", str(out)], capsys
    )
    assert code == 0
    md = (out / "cpu-compact.md").read_text()
    assert "paper" not in md.split("\n\n")[1].lower()  # the table itself
    assert "|  | method | N | seeds | steps | top-1 % | Δ | MB/step | ratio |" in md
    # seeds 0-3 of default, 1-bit, every tensor sparse: 50/53/56/59, 51/54/..., 52/55/...; Δ to the default
    assert "| 4 | 4 | 300 | 55.50 ± 3.87 | +1.00 | 1.03 → 0.00229 | 449x |" in md
    assert "(in every group: default format" in md


def test_full_scale_table_with_sizes_and_two_metrics(tmp_path, capsys):
    fake_table(tmp_path / "runs", "table4-librispeech")
    code, _, _ = run_report(
        ["--table", "table4-librispeech", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)], capsys
    )
    assert code == 0
    md = (tmp_path / "table4-librispeech.md").read_text()
    assert "| WER % paper | WER % ours |" in md and "WER % test-other paper" in md
    assert "| 9.06 | 51.00 | -0.39 | +1.00 | 27.04 | 51.00 | -0.03 | +1.00 | 488.08 → 0.74 |" in md
    assert "608x" in md and "lower is better" in md


def test_table2_groups_and_world_sizes(tmp_path, capsys):
    fake_table(tmp_path / "runs", "table2-cifar")
    code, _, _ = run_report(
        ["--table", "table2-cifar", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)], capsys
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "table2-cifar.csv").read_text())))
    assert [int(r["world_size"]) for r in rows] == [4] * 3 + [8] * 3 + [16] * 3 + [32] * 3
    paper = {(r["group"], r["method"]): float(r["paper_top1"]) for r in rows}
    assert paper[("32 GPUs (batch 1024)", "Gradient Dropping")] == 92.10
    assert paper[("8 GPUs (batch 256)", "DGC")] == 93.28
    # the deltas are taken within each group
    assert float(rows[5]["paper_delta_top1"]) == pytest.approx(93.28 - 92.92)
    assert float(rows[5]["delta_top1"]) == pytest.approx(2.0)


def test_missing_runs_are_shown_as_not_run_with_one_warning_line(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-ablation", skip=("dgc-no-mc", "dgc-no-warmup"))
    (tmp_path / "runs" / "cpu-ablation" / "dgc-no-mc").mkdir()  # started, never finished
    out = tmp_path / "results"
    argv = ["--table", "cpu-ablation", "--runs-root", str(tmp_path / "runs"), "--out", str(out)]
    code, stdout, err = run_report(argv, capsys)
    assert code == 0
    md = (out / "cpu-ablation.md").read_text()
    assert md == stdout.split("wrote ")[0].rstrip("\n") + "\n"
    assert "| DGC without momentum correction | 4 | not run | - | - | - | - |" in md
    assert "| DGC without warm-up | 4 | not run | - |" in md
    assert "| DGC without local clipping | 4 | 300 | 54.00 |" in md
    assert "- dgc-no-mc: not run" in md and "not run: its run directory had no summary.json" in md
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu-ablation-ratio.png", "cpu-ablation-steps.png", "cpu-ablation.csv", "cpu-ablation.md"]
    # one line: the rows, and the command that makes them (the finished runs kept)
    assert err.count("\n") == 1 and err.startswith("warning: table cpu-ablation: 2 of 6 runs not done yet")
    assert "dgc-no-mc, dgc-no-warmup" in err
    sweep = f"python -m dgc.repro.sweep cpu-ablation --skip-done --runs-root {tmp_path / 'runs'} --out {out}"
    assert f"make them with `{sweep}`" in err and "make cpu-ablation" not in err


def test_no_run_done_is_one_line_exit_1_and_nothing_written(tmp_path, capsys):
    (tmp_path / "runs" / "cpu-kjv" / "none-s0").mkdir(parents=True)
    out = tmp_path / "results"
    code, stdout, err = run_report(["--table", "cpu-kjv", "--runs-root", str(tmp_path / "runs"), "--out", str(out)],
                                   capsys)  # fmt: skip
    assert code == 1 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and err.startswith("error: table cpu-kjv: none of its 4 runs is done")
    assert "python -m dgc.repro.sweep cpu-kjv --skip-done" in err


def test_the_shipped_runs_report_into_results_other_runs_into_runs_reports(tmp_path, monkeypatch, capsys):
    """The defaults: --table with the runs under results/runs/ (the shipped layout, make's) writes results/
    and names `make <table>` for what is missing; run directories given as paths write runs/reports/."""
    monkeypatch.chdir(tmp_path)
    fake_table(Path("results/runs"), "cpu-kjv", skip=("dgc-s1",))
    code, stdout, err = run_report(["--table", "cpu-kjv"], capsys)
    assert code == 0 and (tmp_path / "results" / "cpu-kjv.md").is_file()
    assert "wrote results/cpu-kjv.md, results/cpu-kjv.csv" in stdout
    assert "make them with `make cpu-kjv SWEEP_ARGS=--skip-done` (or `python -m dgc.repro.sweep cpu-kjv " in err
    assert "--skip-done --runs-root results/runs --out results`)" in err
    code, _, _ = run_report(["results/runs/cpu-kjv/none-s0", "--name", "one"], capsys)
    assert code == 0 and (tmp_path / "runs" / "reports" / "one.md").is_file()
    assert not (tmp_path / "results" / "one.md").exists()


def test_make_report_runs_the_report_of_the_shipped_runs():
    if shutil.which("make") is None:
        pytest.skip("no make")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-n", "-o", "install", "report", "TABLE=cpu-fmnist"], cwd=root,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "-m dgc.repro.report --table cpu-fmnist --runs-root results/runs --out results" in out.stdout
    helped = subprocess.run(["make", "help"], cwd=root, capture_output=True, text=True).stdout
    assert any(line.split()[:1] == ["report"] and "TABLE=" in line for line in helped.splitlines())
    missing = subprocess.run(["make", "-o", "install", "report"], cwd=root, capture_output=True, text=True)
    assert missing.returncode != 0 and "make report TABLE=" in missing.stdout


def test_partial_marks_what_is_not_run(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-kjv", skip=("dgc-s0",))
    code, _, _ = run_report(
        ["--table", "cpu-kjv", "--partial", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)], capsys
    )
    assert code == 0
    md = (tmp_path / "cpu-kjv.md").read_text()
    assert "| DGC | 2 | 1 of 2 | 300 | 72.24 | 53.00 |" in md and "--partial" in md
    assert "| Baseline | 2 | 2 | 300 | 72.30 | 51.00 ± 1.41 |" in md


def test_a_run_of_the_wrong_task_is_an_error(tmp_path, capsys):
    fake_table(tmp_path / "runs", "cpu-kjv", skip=("dgc-s0",))
    fake_run(tmp_path / "runs" / "cpu-kjv" / "dgc-s0", "fmnist_resnet20", "dgc", {"top1": 1.0})
    code, _, err = run_report(
        ["--table", "cpu-kjv", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "o")], capsys
    )
    assert code != 0 and "task 'fmnist_resnet20', the table wants 'kjv_lstm'" in err
    assert not (tmp_path / "o").exists()


def test_unknown_table_names_the_valid_ones(tmp_path, capsys):
    code, _, err = run_report(["--table", "table9", "--out", str(tmp_path / "o")], capsys)
    assert code != 0 and "valid: table2-cifar" in err


def test_run_dirs_by_glob_headline_follows_the_kind(tmp_path, capsys):
    fake_run(tmp_path / "r" / "none", "kjv_lstm", "none", {"ppl": 150.0, "val_ppl": 160.0}, kind="language")
    fake_run(tmp_path / "r" / "dgc-a", "kjv_lstm", "dgc", {"ppl": 155.0}, kind="language", sent=None)
    code, _, _ = run_report([str(tmp_path / "r" / "*"), "--name", "lm", "--out", str(tmp_path / "o")], capsys)
    assert code == 0
    md = (tmp_path / "o" / "lm.md").read_text()
    # no paper numbers here: no paper columns
    assert "|  | method | N | steps | perplexity | Δ | MB/step | ratio |" in md and "Paper:" not in md
    # sorted glob: dgc-a first; its ratio covers all steps (it ended in the warm-up), flagged with †
    assert "| kjv_lstm | dgc | 4 | 300 | 155.00 | +5.00 |" in md and "40x†" in md
    assert "| none | 4 | 300 | 150.00 | +0.00 |" in md


def test_glob_without_match_and_unfinished_dir_are_errors(tmp_path, capsys):
    code, _, err = run_report([str(tmp_path / "nothing-*"), "--out", str(tmp_path / "o")], capsys)
    assert code != 0 and "no run directory matches" in err
    (tmp_path / "half").mkdir()
    code, _, err = run_report([str(tmp_path / "half"), "--out", str(tmp_path / "o")], capsys)
    assert code != 0 and "no summary.json" in err and str(tmp_path / "half") in err
    assert not (tmp_path / "o").exists()


def _configured_run(path: Path, compression: str, top1: float, **settings) -> Path:
    """A run directory with a config.yaml like dgc.train writes (the keys that matter here)."""
    fake_run(path, "fmnist_resnet20", compression, {"top1": top1})
    config = {"task": {"name": "fmnist_resnet20", "kind": "image"},
              "compression": {"name": compression, "density": settings.pop("density", 0.001)},
              "train": {"max_steps": settings.pop("max_steps", 300), "log_every": settings.pop("log_every", 10)},
              "run_dir": str(path), "seed": settings.pop("seed", 0)}  # fmt: skip
    assert not settings
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def test_run_dirs_are_labelled_by_what_sets_them_apart(tmp_path, capsys):
    """A -m sweep's directories are named by time and pid: the labels say the compression and the settings the
    runs differ in (compression.* among runs of one compression); seeds make one row, averaged."""
    sweep = tmp_path / "runs" / "fmnist_resnet20"
    _configured_run(sweep / "none" / "20261202-183532-11114", "none", 90.0, log_every=5)
    _configured_run(sweep / "dgc" / "20261202-183532-11114-1", "dgc", 89.0)
    _configured_run(sweep / "dgc" / "20261202-183532-11114-2", "dgc", 87.0, seed=1)
    _configured_run(sweep / "dgc" / "20261202-183532-11114-3", "dgc", 80.0, density=0.01)
    code, _, _ = run_report([str(sweep / "*" / "*"), "--out", str(tmp_path / "o")], capsys)
    assert code == 0
    md = (tmp_path / "o" / "report.md").read_text()
    table = md.split("\n\n")[1]
    assert "20261202" not in table and "log_every" not in table and "run_dir" not in table
    assert "|  | none | 4 | 1 | 300 | 90.00 | +0.00 |" in table
    assert "| dgc compression.density=0.001 | 4 | 2 | 300 | 88.00 ± 1.41 | -1.00 |" in table  # seeds 0 and 1
    assert "| dgc compression.density=0.01 | 4 | 1 | 300 | 80.00 | -10.00 |" in table
    labels = report.labels([(d, json.loads((d / "summary.json").read_text())) for d in sorted(sweep.glob("dgc/*"))[:2]])
    assert labels == [("dgc", 0), ("dgc", 1)]


def test_runs_alike_are_told_apart_by_their_directory(tmp_path):
    a = _configured_run(tmp_path / "a", "dgc", 1.0)
    b = _configured_run(tmp_path / "b", "dgc", 2.0)
    summaries = [(d, json.loads((d / "summary.json").read_text())) for d in (a, b)]
    assert report.labels(summaries) == [("dgc (a)", None), ("dgc (b)", None)]


def test_a_sweep_folder_stands_for_the_run_dirs_it_lists(tmp_path, capsys):
    """`python -m dgc.train -m` lists its run directories in <sweep folder>/run_dirs.txt: the folder (or the file)
    is a report's argument; an unfinished run is left out with one warning line."""
    runs = tmp_path / "runs"
    done = [_configured_run(runs / k, k, v) for k, v in (("none", 90.0), ("dgc", 89.0))]
    unfinished = runs / "topk"
    unfinished.mkdir()
    folder = tmp_path / "multirun" / "20261202-183532"
    folder.mkdir(parents=True)
    (folder / "run_dirs.txt").write_text("".join(f"{d}\n" for d in [*done, unfinished]))
    for arg in (folder, folder / "run_dirs.txt"):
        code, stdout, err = run_report([str(arg), "--name", "sweep", "--out", str(tmp_path / "o")], capsys)
        assert code == 0
        md = (tmp_path / "o" / "sweep.md").read_text()
        assert "| fmnist_resnet20 | none |" in md and "|  | dgc | 4 | 300 | 89.00 | -1.00 |" in md
        assert err.count("\n") == 1 and err.startswith("warning: left out 1 run directory without a summary.json")
        assert str(unfinished) in err


def test_list_names_every_table(capsys):
    code, out, _ = run_report(["--list"], capsys)
    assert code == 0
    for name in TABLES:
        assert f"{name}:" in out


def test_cli_wants_a_table_or_run_dirs(capsys):
    code, _, err = run_report([], capsys)
    assert code == 2 and "either --table NAME or run directories" in err


def test_the_papers_point_sits_at_its_ratio_or_is_left_out():
    rows = {r.key: r for r in get_table("cpu-fmnist").rows}
    assert plots.paper_ratio_of(rows["none-s0"]) == 1.0
    # the paper's Table 2 gives no ratio for its sparse rows: not drawn at 1x
    assert plots.paper_ratio_of(rows["dgc-s0"]) is None and plots.paper_ratio_of(rows["topk-s1"]) is None
    alexnet = {r.key: r for r in get_table("table3-imagenet").rows}
    assert plots.paper_ratio_of(alexnet["alexnet-dgc"]) == 597


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return fig, ax


@pytest.mark.parametrize("higher", [False, True])
def test_a_second_half_inset_where_the_early_evaluations_squash_the_curves(higher):
    import matplotlib.pyplot as plt

    steps = [1, 2, 3, 4, 5, 6]
    # a falling metric: 100 at the start, level near 40 from the middle on (a 2-point spread in 60)
    curves = [(steps, m, m, m, c) for m, c in (([100, 60, 45, 41, 40, 40], "C0"), ([100, 62, 46, 43, 42, 42], "C1"))]
    if higher:
        curves = [(s, [-v for v in m], [-v for v in m], [-v for v in m], c) for s, m, _, _, c in curves]
    fig, ax = _axes()
    plots._zoom_second_half(ax, curves, higher)
    (inset,) = ax.child_axes
    assert [list(line.get_xdata()) for line in inset.lines] == [[4, 5, 6], [4, 5, 6]]
    # upper right for a falling metric, lower right for a rising one (where the curves are not)
    assert (inset.get_position().y0 > ax.get_position().y0 + 0.3 * ax.get_position().height) is not higher
    plt.close(fig)
    # curves that part in the second half as much as in the first get no inset
    fig, ax = _axes()
    spread = [(steps, m, m, m, "C0") for m in ([10, 9, 8, 7, 6, 5], [10, 9, 8, 3, 2, 1])]
    plots._zoom_second_half(ax, spread, False)
    assert not ax.child_axes
    plt.close(fig)


def test_paired_differences_have_a_standard_error_and_a_t_interval(tmp_path, capsys):
    """Per-seed Δ to the reference of the same seed: mean, standard error and Student-t 95% interval by hand."""
    table = get_table("cpu-speech")
    base = {0: 45.0, 1: 46.0, 2: 47.0, 3: 45.0, 4: 46.0}
    gap = {0: 4.0, 1: 1.0, 2: 0.0, 3: 3.0, 4: 2.0}
    for row in table.rows:
        if row.key.startswith("none-") or row.key.startswith("dgc-w1-c400-updates-s"):
            wer = base[row.seed] + (0.0 if row.key.startswith("none-") else gap[row.seed])
            metrics = {m: wer for m in table.metrics}
            fake_run(tmp_path / "runs" / "cpu-speech" / row.key, row.task, row.compression, metrics, "speech")
    code, _, _ = run_report(
        ["--table", "cpu-speech", "--partial", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)], capsys
    )
    assert code == 0
    text = (tmp_path / "cpu-speech.md").read_text()
    # mean 2.0, sd = sqrt(10/4) = 1.581, se = 0.707, t(0.975, 4) = 2.776 -> half-width 1.963
    line = next(x for x in text.splitlines() if "0: +4.00, 1: +1.00, 2: +0.00, 3: +3.00, 4: +2.00" in x)
    assert "| +2.00 | 0.71 | [+0.04, +3.96] |" in line
    assert report.paired([1.0]) == (None, None)


def test_a_frontier_table_sets_dgc_against_the_diloco_arm_nearest_its_bytes(tmp_path, capsys):
    """The DiLoCo arm compared is chosen by measured bytes (H = 256 here, not H = 16); Δ per seed by hand."""
    table = get_table("cpu-frontier")
    top1 = {"none": (91.0, 91.5), "dgc": (91.0, 90.5), "diloco-h16": (90.0, 90.0), "diloco-h256": (76.0, 77.0)}
    sent = {"none": None, "dgc": 4000.0, "diloco-h16": 68000.0, "diloco-h256": 4400.0}
    for row in table.rows:
        arm = row.key.rsplit("-s", 1)[0]
        if arm in top1:
            value = top1[arm][row.seed]
            fake_run(tmp_path / "runs" / "cpu-frontier" / row.key, row.task, row.compression,
                     {"top1": value, "val_top1": value}, sent=sent[arm],
                     local_steps=int(arm.split("-h")[1]) if arm.startswith("diloco") else 0)  # fmt: skip
    code, _, _ = run_report(
        ["--table", "cpu-frontier", "--partial", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)], capsys
    )
    assert code == 0
    line = next(x for x in (tmp_path / "cpu-frontier.md").read_text().splitlines() if x.startswith("At matched bytes"))
    assert "DiLoCo, H = 256" in line and "H = 16," not in line
    assert "(1.10x DGC's, the DiLoCo arm nearest it; its 300 steps at H = 256 are 1 outer step)" in line
    # deltas +15.0, +13.5: mean +14.25, sd 1.061, se 0.75, t(0.975, 1) = 12.706 -> half-width 9.53
    assert "seed 0: +15.00, seed 1: +13.50; mean +14.25; standard error 0.75, 95% interval [+4.72, +23.78]." in line
    assert report.matched_bytes(table, []) == []


def test_the_language_model_frontier_sets_each_dgc_against_diloco_at_its_bytes(tmp_path, capsys):
    """cpu-lm-frontier: DGC as published (momentum SGD) and DGC feeding AdamW each against the DiLoCo arm nearest its
    bytes (the bf16 one at H = 256); test loss, lower is better, Δ per seed by hand."""
    table = get_table("cpu-lm-frontier")
    loss = {"none": (1.10, 1.12), "dgc-sgd": (1.30, 1.28), "dgc-adamw": (1.15, 1.16), "diloco-h16": (1.12, 1.13),
            "diloco-h256": (1.25, 1.24)}  # fmt: skip
    sent = {"none": None, "dgc-sgd": 5500.0, "dgc-adamw": 5600.0, "diloco-h16": 202400.0, "diloco-h256": 6300.0}
    for row in table.rows:
        arm = row.key.rsplit("-s", 1)[0]
        if arm in loss:
            value = loss[arm][row.seed]
            every = int(arm.split("-h")[1]) if arm.startswith("diloco") else 0
            fake_run(tmp_path / "runs" / "cpu-lm-frontier" / row.key, row.task, row.compression,
                     {"loss": value, "bpc": value / 0.693, "val_loss": value}, kind="causal_lm", sent=sent[arm],
                     dense=3238400.0, steps=7773, local_steps=every)  # fmt: skip
            (tmp_path / "runs" / "cpu-lm-frontier" / row.key / "config.yaml").write_text(yaml.safe_dump(
                {"task": {"name": row.task, "kind": "causal_lm"}, "model": {"args": {"block_size": 64}},
                 "train": {"batch_size": 6, "accumulate": 1}}))  # fmt: skip
    code, _, err = run_report(["--table", "cpu-lm-frontier", "--partial", "--runs-root", str(tmp_path / "runs"),
                               "--out", str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    # loss against tokens (4 workers x 6 windows x 64 characters a step) and against bytes sent
    assert (tmp_path / "cpu-lm-frontier-tokens.png").read_bytes().startswith(PNG)
    runs = [report.load_run(r, tmp_path / "runs" / "cpu-lm-frontier" / r.key) for r in table.rows
            if (tmp_path / "runs" / "cpu-lm-frontier" / r.key).is_dir()]  # fmt: skip
    assert {plots.tokens_per_step(run) for run in runs} == {4 * 6 * 64}
    md = (tmp_path / "cpu-lm-frontier.md").read_text()
    lines = [x for x in md.splitlines() if x.startswith("At matched bytes")]
    assert len(lines) == 2 and all("DiLoCo, H = 256, bf16 (DGC's bytes)" in x for x in lines)
    assert lines[0].startswith("At matched bytes: DGC (a) as published, momentum SGD")
    assert "its 7773 steps at H = 256 are 30 outer steps" in lines[0]
    assert "Difference in test loss (nats/token), DGC minus DiLoCo: seed 0: +0.05, seed 1: +0.04" in lines[0]
    assert lines[1].startswith("At matched bytes: DGC (b) sparse + error feedback, AdamW")
    assert "seed 0: -0.10, seed 1: -0.08" in lines[1]


def test_a_longer_run_of_the_same_rows_is_set_beside_the_standard_ones_seed_by_seed(tmp_path, capsys):
    """cpu-speech-long's Δ per seed beside cpu-speech's, same row and seed; a seed done in one only is left out."""
    standard = {"none-s0": 45.0, "none-s1": 46.0, f"{SPEECH_CHOSEN}-s0": 49.5, f"{SPEECH_CHOSEN}-s1": 47.5}
    long = {"none-long-s0": 44.0, "none-long-s1": 45.0, f"{SPEECH_CHOSEN}-long-s0": 45.0}
    for name, values in (("cpu-speech", standard), ("cpu-speech-long", long)):
        for row in get_table(name).rows:
            if row.key in values:
                fake_run(tmp_path / "runs" / name / row.key, row.task, row.compression,
                         dict.fromkeys(get_table(name).metrics, values[row.key]), "speech")  # fmt: skip
    code, _, _ = run_report(
        ["--table", "cpu-speech-long", "--partial", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path)],
        capsys,
    )
    assert code == 0
    text = (tmp_path / "cpu-speech-long.md").read_text()
    assert "Beside cpu-speech (the same rows and seeds, its own length)" in text
    method = next(r.method for r in get_table("cpu-speech-long").rows if r.key.startswith(SPEECH_CHOSEN))
    assert f"| {method} | 1 | 0: +1.00 / +4.50 | +1.00 | +4.50 |" in text
    # without the standard runs there is nothing to set beside: no such section
    shutil.rmtree(tmp_path / "runs" / "cpu-speech")
    run_report(["--table", "cpu-speech-long", "--partial", "--runs-root", str(tmp_path / "runs"), "--out",
                str(tmp_path)], capsys)  # fmt: skip
    assert "Beside cpu-speech" not in (tmp_path / "cpu-speech-long.md").read_text()


def test_a_frontier_arm_without_its_test_metric_gets_a_bar_and_no_point(tmp_path, capsys):
    """A run that never read the test split (train.test_eval=never) in a frontier table: priced, not plotted."""
    table = get_table("cpu-lm-frontier")
    runs = tmp_path / "runs" / "cpu-lm-frontier"
    fake_run(runs / "none-s0", "kjv_gpt", "none", {"val_loss": 1.06}, kind="causal_lm", dense=3238400.0, evals=0)
    fake_run(runs / "dgc-adamw-s0", "kjv_gpt", "dgc", {"loss": 1.1, "bpc": 1.6, "val_loss": 1.08}, kind="causal_lm",
             sent=5600.0, dense=3238400.0)  # fmt: skip
    code, _, err = run_report(["--table", table.name, "--partial", "--runs-root", str(tmp_path / "runs"), "--out",
                               str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "cpu-lm-frontier-bytes.png").read_bytes().startswith(PNG)
    projection = (tmp_path / "cpu-lm-frontier-projection.md").read_text()
    assert "| dense fp32 allreduce, AdamW, lr x1 (not chosen yet) | - |" in projection
