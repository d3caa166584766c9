"""How close clean steps came to the statistics' floor: the measurement the floor is set from.

The floor ``F`` of the statistical tests (:mod:`detection.stepcheck.gradstats`) is the one
threshold not scaled by a measured spread, so it must sit above what clean training does on its
own — a clean step past it is a false alarm. What clean training does is measured, not assumed:
on every step the tests *learn* (a step with no finding of any layer), each test records the
largest excess a mature reference saw — ``x_r - median`` for the cross-rank test once its
column's spread holds ``warmup`` clean steps, ``x_r - μ_r`` for the temporal test once the
rank's history does — with the statistic that showed it, and counts the steps whose largest
excess passed a few reference factors. ``benchmarks/soak.py`` prints it per job; the floor's
margin over the largest clean excess of the soak is in ``docs/detection-design.md``.

A measurement of this process only: it is not part of the learnt state carried by a checkpoint,
and it changes no verdict. Invariant: both engines of the tests (the loop and the arrays) record
the same values for the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FACTORS", "Headroom", "TestPeak"]

#: Reference factors: a step counts under each one its largest clean excess reached.
FACTORS = (2.0, 4.0, 8.0, 16.0)
_LOG_FACTORS = tuple(math.log(f) for f in FACTORS)


@dataclass
class TestPeak:
    """One test's record: the largest clean excess (log units) and its statistic, the steps
    measured, and per factor of :data:`FACTORS` the steps whose largest excess reached it."""

    excess: float = -math.inf
    statistic: str = ""
    steps: int = 0
    reached: list[int] = field(default_factory=lambda: [0] * len(FACTORS))

    def note(self, excess: float, statistic: str) -> None:
        """One learnt step's largest excess of this test (``-inf``: nothing mature to test)."""
        if excess == -math.inf:
            return
        self.steps += 1
        if excess > self.excess:
            self.excess, self.statistic = excess, statistic
        for i, level in enumerate(_LOG_FACTORS):
            if excess >= level:
                self.reached[i] += 1

    def to_dict(self) -> dict[str, Any]:
        measured = self.steps > 0
        return {
            "steps": self.steps,
            "max_log_excess": round(self.excess, 6) if measured else None,
            "max_factor": round(math.exp(self.excess), 4) if measured else None,
            "statistic": self.statistic or None,
            "steps_reaching": {f"x{f:g}": n for f, n in zip(FACTORS, self.reached, strict=True)},
        }


@dataclass
class Headroom:
    """The cross-rank and the temporal test's :class:`TestPeak` (see the module)."""

    cross: TestPeak = field(default_factory=TestPeak)
    temporal: TestPeak = field(default_factory=TestPeak)

    def to_dict(self, floor_factor: float) -> dict[str, Any]:
        """Both records and the floor they are read against."""
        return {
            "floor_factor": floor_factor,
            "cross-rank": self.cross.to_dict(),
            "temporal": self.temporal.to_dict(),
        }
