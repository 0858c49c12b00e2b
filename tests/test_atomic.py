"""dgc.atomic's figure writer (the file writes themselves: tests/test_checkpoint.py, killed mid-save)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dgc import atomic  # noqa: E402


def test_a_figure_is_written_whole_and_closed_saved_or_not(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    out = atomic.save_figure(tmp_path / "a.png", fig, dpi=50)
    assert out.read_bytes().startswith(b"\x89PNG") and not plt.fignum_exists(fig.number)
    fig, _ = plt.subplots()
    (tmp_path / "b.png").mkdir()  # a folder where the image should go: the save fails
    with pytest.raises(OSError):
        atomic.save_figure(tmp_path / "b.png", fig)
    assert not plt.fignum_exists(fig.number) and [p.name for p in tmp_path.iterdir()] == ["a.png", "b.png"]
