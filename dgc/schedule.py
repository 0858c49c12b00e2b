"""Warm-up density schedule: the density falls stage by stage during warm-up.

The paper's default (4 stages over the warm-up epochs) is 25%, 6.25%, 1.5625%,
0.4% and then the final density (0.1%). The stages are spread evenly over
``warmup_epochs``, which may be fractional or smaller than the number of stages
(PTB: 1 warm-up epoch), so the schedule is a function of a fractional epoch.

Stages can be given as an explicit list or as an exponential coefficient ``c``:
stage j (1-based) has density ``c**j`` for every j with ``c**j > density``
(c = 0.25 gives the paper's list; the authors' code used c = 10**-0.5, which
gives 31.6%, 10%, 3.16%, 1%, 0.316%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PAPER_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


def check_density(value: float, what: str = "density") -> float:
    """Return ``value`` as float if it is a number in (0, 1], else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number in (0, 1], got {value!r}")
    value = float(value)
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {value!r}")
    return value


class DensitySchedule:
    """Maps a (fractional) epoch to the density to use."""

    def __init__(
        self,
        density: float,
        warmup_epochs: float = 0.0,
        warmup_densities: Sequence[float] | None = None,
        warmup_coeff: float | None = None,
    ):
        self.density = check_density(density)
        if warmup_epochs is None or math.isnan(float(warmup_epochs)) or warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be a number >= 0, got {warmup_epochs!r}")
        self.warmup_epochs = float(warmup_epochs)
        if warmup_densities is not None and warmup_coeff is not None:
            raise ValueError("give warmup_densities or warmup_coeff, not both")
        if warmup_coeff is not None:
            coeff = float(warmup_coeff)
            if math.isnan(coeff) or not 0.0 < coeff < 1.0:
                raise ValueError(f"warmup_coeff must be a number in (0, 1), got {warmup_coeff!r}")
            stages, d = [], coeff
            # c**j is computed by repeated products: 10**-0.5 to the 6th gives 0.0010000000000000002,
            # which must not count as "above" a density of 0.001 (a spurious stage at the final density)
            while d > self.density * (1 + 1e-9) and len(stages) < 64:
                stages.append(d)
                d *= coeff
        else:
            stages = list(PAPER_WARMUP_DENSITIES if warmup_densities is None else warmup_densities)
            stages = [check_density(s, "warmup density") for s in stages]
            stages = [s for s in stages if s > self.density] if warmup_densities is None else stages
        self.stages = tuple(stages)

    def __call__(self, epoch: float) -> float:
        if epoch < self.warmup_epochs and self.stages:
            stage = int(epoch / self.warmup_epochs * len(self.stages))
            return self.stages[min(max(stage, 0), len(self.stages) - 1)]
        return self.density

    def __repr__(self) -> str:
        return f"DensitySchedule(density={self.density}, warmup_epochs={self.warmup_epochs}, stages={self.stages})"
