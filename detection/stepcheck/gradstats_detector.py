"""The per-step statistical tests of :mod:`detection.stepcheck.gradstats`, one engine per layout.

The scalar loop over dictionaries (:mod:`detection.stepcheck.gradstats`) is the tests'
definition and the faster engine on a small table; the array engine
(:mod:`detection.stepcheck.gradstats_arrays`) takes over on a large one. Both give the same
verdicts; :class:`GradStatsDetector` picks one per layout, at its first step, by the table's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from detection.stepcheck.gradstats import ScalarTests, StatFinding, StatsConfig
from detection.stepcheck.gradstats_arrays import ArrayTests, table_of

__all__ = ["ARRAY_MIN", "GradStatsDetector"]


#: A table of at most this many values (ranks times statistics) is tested by the loop, larger
#: ones by :class:`~detection.stepcheck.gradstats_arrays.ArrayTests` (the two agree value for
#: value).
ARRAY_MIN = 256


@dataclass
class GradStatsDetector:
    """The host-side tests over the all-gathered statistics; one per guard, same on every rank.

    ``values[r]`` per step (:meth:`test`, :meth:`learn`): name → value for rank ``r`` (``loss``,
    ``l2[b]``, ``amax[b]``); or the same as column names and a ``(world, n)`` array
    (:meth:`test_table`, :meth:`learn_table`), which is what a guard's decision passes. A
    layout's tests run as a loop over dictionaries when its table is small and over arrays when
    it is large (hundreds of buckets on many ranks, where the loop costs more than the step);
    the choice is made once per layout and both give the same findings and histories.
    """

    world_size: int
    config: StatsConfig = field(default_factory=StatsConfig)
    array_min: int = ARRAY_MIN  # tables of more values than this are tested over arrays
    _tests: ScalarTests | ArrayTests | None = None
    _layout: int = -1

    @property
    def steps_learnt(self) -> int:
        return self._tests.steps_learnt if self._tests is not None else 0

    @property
    def calibrated(self) -> bool:
        return self.steps_learnt >= self.config.warmup

    def history(self) -> dict[tuple[int, str], tuple[float, float, int]]:
        """The temporal test's reference per (rank, statistic): running mean and mean absolute
        deviation of its log, and the clean steps learnt."""
        return self._tests.history() if self._tests is not None else {}

    def reset_if_layout_changed(self, n_buckets: int) -> None:
        """DDP may rebuild its buckets after the first step: a new layout is a new history."""
        if n_buckets != self._layout:
            self._layout = n_buckets
            self._tests = None

    def _for(self, width: Callable[[], int]) -> ScalarTests | ArrayTests:
        """This layout's tests, chosen at its first step by the table's size (``width()``
        statistics a rank)."""
        if self._tests is None:
            if self.world_size * width() > self.array_min:
                self._tests = ArrayTests(self.world_size, self.config)
            else:
                self._tests = ScalarTests(self.world_size, self.config)
        return self._tests

    def test(self, values: Sequence[dict[str, float]]) -> list[StatFinding]:
        """The findings of this step (empty while calibrating), at most one per rank."""
        tests = self._for(lambda: len(set().union(*values)))
        if not self.calibrated:
            return []
        if isinstance(tests, ScalarTests):
            return tests.test(values)
        return tests.test_table(*_table_of(values))

    def learn(self, values: Sequence[dict[str, float]]) -> None:
        """Fold a clean step into the histories."""
        tests = self._for(lambda: len(set().union(*values)))
        if isinstance(tests, ScalarTests):
            tests.learn(values)
        else:
            tests.learn_table(*_table_of(values))

    def test_table(self, names: Sequence[str], raw: _Table) -> list[StatFinding]:
        """:meth:`test` of ``raw[r][j]``, the value of statistic ``names[j]`` on rank ``r``."""
        tests = self._for(lambda: len(names))
        if not self.calibrated:
            return []
        if isinstance(tests, ScalarTests):
            return tests.test(_mappings(names, raw))
        return tests.test_table(names, np.asarray(raw, dtype=np.float64))

    def test_learn_table(
        self, names: Sequence[str], raw: _Table, *, learn: bool
    ) -> list[StatFinding]:
        """:meth:`test_table` and then, when ``learn`` and nothing was found,
        :meth:`learn_table`: a guard's step, in one pass over a small table."""
        tests = self._for(lambda: len(names))
        if isinstance(tests, ScalarTests):
            rows = raw.tolist() if isinstance(raw, np.ndarray) else raw
            return tests.test_rows(names, rows, learn=learn)
        found = self.test_table(names, raw)
        if learn and not found:
            self.learn_table(names, raw)
        return found

    def learn_table(self, names: Sequence[str], raw: _Table) -> None:
        """:meth:`learn` of ``raw[r][j]``, the value of statistic ``names[j]`` on rank ``r``."""
        tests = self._for(lambda: len(names))
        if isinstance(tests, ScalarTests):
            tests.learn(_mappings(names, raw))
        else:
            tests.learn_table(names, np.asarray(raw, dtype=np.float64))


_Table = npt.NDArray[np.float64] | Sequence[Sequence[float]]


def _table_of(values: Sequence[dict[str, float]]) -> tuple[list[str], npt.NDArray[np.float64]]:
    return table_of(values)


def _mappings(names: Sequence[str], raw: _Table) -> list[dict[str, float]]:
    rows = raw.tolist() if isinstance(raw, np.ndarray) else raw
    return [dict(zip(names, row, strict=True)) for row in rows]
