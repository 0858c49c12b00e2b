"""Warm-up density schedule."""

from __future__ import annotations

import math

import pytest

from dgc.schedule import PAPER_WARMUP_DENSITIES, DensitySchedule, check_density

PAPER = [0.25, 0.0625, 0.015625, 0.004]


def test_paper_defaults_step_once_per_epoch():
    s = DensitySchedule(0.001, warmup_epochs=4)
    assert list(PAPER_WARMUP_DENSITIES) == PAPER
    assert list(s.stages) == PAPER
    assert [s(e) for e in range(7)] == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001, 0.001]
    # within an epoch the density does not change
    assert [s(e + 0.999) for e in range(4)] == PAPER
    assert s(3.9999) == 0.004
    assert s(4.0) == 0.001
    assert s(164.0) == 0.001


def test_stretched_over_one_fractional_epoch():
    s = DensitySchedule(0.001, warmup_epochs=1)
    assert [s(e) for e in (0.0, 0.1, 0.2499)] == [0.25] * 3
    assert [s(e) for e in (0.25, 0.3, 0.4999)] == [0.0625] * 3
    assert [s(e) for e in (0.5, 0.7499)] == [0.015625] * 2
    assert [s(e) for e in (0.75, 0.9999)] == [0.004] * 2
    assert [s(e) for e in (1.0, 1.5, 40.0)] == [0.001] * 3


def test_no_warmup_and_warmup_over_fewer_epochs_than_stages():
    assert DensitySchedule(0.001)(0.0) == 0.001
    assert DensitySchedule(0.001, warmup_epochs=0)(0.0) == 0.001
    s = DensitySchedule(0.001, warmup_epochs=2)  # 4 stages in 2 epochs: two per epoch
    assert [s(e) for e in (0.0, 0.5, 1.0, 1.5, 2.0)] == [0.25, 0.0625, 0.015625, 0.004, 0.001]
    assert s(-1.0) == 0.25  # before the start: the first stage


def test_default_stages_are_filtered_by_final_density():
    # stages at or below the final density make no sense and are dropped
    assert list(DensitySchedule(0.01, warmup_epochs=4).stages) == [0.25, 0.0625, 0.015625]
    assert list(DensitySchedule(0.1, warmup_epochs=4).stages) == [0.25]
    s = DensitySchedule(0.5, warmup_epochs=4)
    assert s.stages == ()
    assert s(0.0) == 0.5
    # with 3 stages over 3 epochs
    s = DensitySchedule(0.01, warmup_epochs=3)
    assert [s(e) for e in range(5)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]


def test_warmup_coeff_quarter_is_the_papers_list():
    s = DensitySchedule(0.001, warmup_epochs=4, warmup_coeff=0.25)
    assert list(s.stages) == [0.25, 0.0625, 0.015625, 0.00390625]
    # the paper's "0.4%" (sparsity 99.6%) is 0.25**4 = 0.390625% rounded
    assert s.stages == pytest.approx(PAPER, abs=1e-4)
    assert [s(e) for e in range(5)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001]


def test_authors_coeff_gives_their_five_stages():
    s = DensitySchedule(0.001, warmup_epochs=5, warmup_coeff=10**-0.5)
    expected = [10**-0.5, 0.1, 10**-1.5, 0.01, 10**-2.5]
    # exactly five stages: 10**-3 equals the final density and is no stage, whatever the float rounding
    assert len(s.stages) == 5
    assert list(s.stages) == pytest.approx(expected, rel=1e-12)
    assert s(0.0) == pytest.approx(0.31622776601683794)
    assert s(4.5) == pytest.approx(0.00316227766016838)
    assert s(5.0) == 0.001


@pytest.mark.parametrize("coeff,density,count", [(0.1, 0.001, 2), (0.1, 0.01, 1), (0.5, 0.125, 2), (0.5, 0.1, 3)])
def test_coeff_stops_strictly_above_density(coeff, density, count):
    s = DensitySchedule(density, warmup_epochs=1, warmup_coeff=coeff)
    assert len(s.stages) == count
    assert all(st > density for st in s.stages)
    assert list(s.stages) == pytest.approx([coeff ** (j + 1) for j in range(count)])


def test_explicit_list():
    s = DensitySchedule(0.001, warmup_epochs=2, warmup_densities=[0.5, 0.05])
    assert s.stages == (0.5, 0.05)
    assert [s(e) for e in (0.0, 0.99, 1.0, 1.99, 2.0)] == [0.5, 0.5, 0.05, 0.05, 0.001]
    # an explicit list is used as given
    s = DensitySchedule(0.01, warmup_epochs=3, warmup_densities=[0.1, 0.2, 1.0])
    assert s.stages == (0.1, 0.2, 1.0)
    assert [s(e) for e in range(4)] == [0.1, 0.2, 1.0, 0.01]
    # an empty list means no warm-up
    assert DensitySchedule(0.01, warmup_epochs=3, warmup_densities=[])(0.0) == 0.01


@pytest.mark.parametrize("density", [0, 0.0, -0.1, 1.5, 1.0000001, float("nan"), float("inf"), "abc", None, [0.1]])
def test_bad_density(density):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        DensitySchedule(density)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        check_density(density)


def test_density_bounds_inclusive():
    assert DensitySchedule(1.0).density == 1.0
    assert DensitySchedule(1e-9).density == 1e-9
    assert check_density(1) == 1.0 and isinstance(check_density(1), float)


@pytest.mark.parametrize("bad", [[0.1, 0.0], [1.5], [float("nan")], ["x"]])
def test_bad_warmup_list(bad):
    with pytest.raises(ValueError, match=r"warmup density must be a number in \(0, 1\]"):
        DensitySchedule(0.001, warmup_epochs=1, warmup_densities=bad)


@pytest.mark.parametrize("coeff", [0.0, 1.0, 1.5, -0.25, float("nan")])
def test_bad_warmup_coeff(coeff):
    with pytest.raises(ValueError, match=r"warmup_coeff must be a number in \(0, 1\)"):
        DensitySchedule(0.001, warmup_epochs=1, warmup_coeff=coeff)


def test_list_and_coeff_together():
    with pytest.raises(ValueError) as err:
        DensitySchedule(0.001, warmup_epochs=1, warmup_densities=[0.1], warmup_coeff=0.25)
    assert "warmup_densities" in str(err.value) and "warmup_coeff" in str(err.value)


@pytest.mark.parametrize("epochs", [-1, float("nan"), None])
def test_bad_warmup_epochs(epochs):
    with pytest.raises(ValueError, match=">= 0"):
        DensitySchedule(0.001, warmup_epochs=epochs)


def test_schedule_is_monotone_non_increasing():
    for kwargs in ({}, {"warmup_coeff": 10**-0.5}, {"warmup_coeff": 0.25}):
        s = DensitySchedule(0.001, warmup_epochs=1.7, **kwargs)
        values = [s(i / 1000) for i in range(3000)]
        assert all(a >= b for a, b in zip(values, values[1:]))
        assert values[0] == s.stages[0] and values[-1] == 0.001
        assert not any(math.isnan(v) for v in values)
