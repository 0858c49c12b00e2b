"""A table's rows: each one training run, ``python -m dgc.train task=<task> compression=<compression> <overrides>``
on ``world_size`` ranks, with what the paper reports for it (:mod:`dgc.repro.tables` lists them per table;
:mod:`dgc.repro.frontier` builds the frontier's)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Paper:
    """What the paper reports for one row (None: not reported)."""

    metrics: dict[str, float] = field(default_factory=dict)
    dense_mb: float | None = None
    sent_mb: float | None = None
    ratio: float | None = None


@dataclass(frozen=True)
class Row:
    #: run directory name under results/runs/<table>/
    key: str
    #: rows of one group share a baseline (Δ columns) and a plot panel
    group: str
    #: what the row is called in the table
    method: str
    task: str
    compression: str
    world_size: int
    #: further dgc.train overrides
    overrides: tuple[str, ...] = ()
    paper: Paper = field(default_factory=Paper)
    #: the group's reference for the Δ columns (the dense baseline, unless the paper compares otherwise)
    baseline: bool = False
    #: the run's seed (None: the config's); rows that differ only in the seed are one method, averaged
    seed: int | None = None

    def train_overrides(self) -> list[str]:
        seed = [] if self.seed is None else [f"seed={self.seed}"]
        return [f"task={self.task}", f"compression={self.compression}", *self.overrides, *seed]


def seeded(rows: tuple[Row, ...], seeds: tuple[int, ...]) -> tuple[Row, ...]:
    """Each row once per seed, keyed ``<key>-s<seed>``, seeds outermost (a sweep finishes one seed first)."""
    return tuple(replace(r, key=f"{r.key}-s{seed}", seed=seed) for seed in seeds for r in rows)


__all__ = ["Paper", "Row", "seeded"]
