"""The per-step statistical tests of :mod:`detection.stepcheck.gradstats`, one engine per layout.

The scalar loop over dictionaries (:mod:`detection.stepcheck.gradstats`) is the tests'
definition and the faster engine on a small table; the array engine
(:mod:`detection.stepcheck.gradstats_arrays`) takes over on a large one. Both give the same
verdicts; :class:`GradStatsDetector` picks one per layout, at its first step, by the table's size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from detection.stepcheck.gradstats import ScalarTests, StatFinding, StatsConfig
from detection.stepcheck.gradstats_arrays import ArrayTests, table_of
from detection.stepcheck.headroom import Headroom

__all__ = ["ARRAY_MIN", "GradStatsDetector"]

_logger = logging.getLogger(__name__)
_KEPT_LAYOUTS = 3  # bucket layouts whose histories are kept besides the current one


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
    _layout: int | tuple[int, ...] = -1
    _kept: dict[int | tuple[int, ...], ScalarTests | ArrayTests] = field(default_factory=dict)
    headroom: Headroom = field(default_factory=Headroom)
    """How close this process's clean steps came to the floor, over every bucket layout
    (:mod:`detection.stepcheck.headroom`): a measurement, not part of :meth:`state_dict`."""

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

    def reset_if_layout_changed(self, layout: int | tuple[int, ...]) -> None:
        """DDP may rebuild its buckets after the first step: a new layout (the bucket count, or
        the buckets' sizes) has its own history. The last few layouts' histories are kept, so a
        resumed job, whose first step DDP buckets by parameter order before it rebuilds the
        buckets it had learnt, finds its learnt history again at its second step."""
        if layout == self._layout:
            return
        if self._tests is not None:
            self._kept[self._layout] = self._tests
            while len(self._kept) > _KEPT_LAYOUTS:
                del self._kept[next(iter(self._kept))]
        self._tests = self._kept.pop(layout, None)
        if self._tests is None and self._kept:
            _logger.info("gradient buckets now %s: the statistics learn them afresh", layout)
        self._layout = layout

    def state_dict(self) -> dict[str, Any]:
        """What the tests learnt, as plain lists, floats and ints (``torch.save`` and
        ``weights_only`` loading keep every bit): per bucket layout (the current one first),
        the clean steps learnt, each (rank, statistic)'s running mean, deviation and count,
        and each statistic's cross-rank spread. The same on every rank (every rank learns from
        the same gathered table)."""
        layouts = [(self._layout, self._tests), *reversed(self._kept.items())]
        return {
            "world_size": self.world_size,
            "layouts": [
                {"layout": list(k) if isinstance(k, tuple) else k, "tests": t.export()}
                for k, t in layouts
                if t is not None
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a :meth:`state_dict` of the same world size (``ValueError`` otherwise):
        the next step of a learnt bucket layout is tested against it at once."""
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"the statistics were learnt by {state['world_size']} ranks, this job has "
                f"{self.world_size}: each rank's history is of its own share of the batch"
            )
        restored: list[tuple[int | tuple[int, ...], ScalarTests | ArrayTests]] = []
        for entry in state["layouts"]:
            body = entry["tests"]
            _validate(body, self.world_size)
            layout = entry["layout"]
            key = tuple(int(n) for n in layout) if isinstance(layout, list) else int(layout)
            self._tests = None
            width = len(body["names"])
            tests = self._for(lambda: width)  # noqa: B023 - called at once
            tests.restore(body)
            restored.append((key, tests))
        self._kept = dict(reversed(restored[1:]))
        self._layout, self._tests = restored[0] if restored else (-1, None)

    def _for(self, width: Callable[[], int]) -> ScalarTests | ArrayTests:
        """This layout's tests, chosen at its first step by the table's size (``width()``
        statistics a rank)."""
        if self._tests is None:
            if self.world_size * width() > self.array_min:
                self._tests = ArrayTests(self.world_size, self.config, headroom=self.headroom)
            else:
                self._tests = ScalarTests(self.world_size, self.config, headroom=self.headroom)
        return self._tests

    def test(self, values: Sequence[dict[str, float]]) -> list[StatFinding]:
        """The findings of this step (empty while calibrating), at most one per rank."""
        tests = self._for(lambda: len(set().union(*values)))
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


def _validate(body: dict[str, Any], world_size: int) -> None:
    """A learnt state that could disarm a test is refused: every count a non-negative int,
    every mean finite, every spread finite and non-negative, every rank in the world."""
    names = set(body["names"])
    for r, name, mean, dev, n in body["temporal"]:
        if not (0 <= int(r) < world_size) or name not in names:
            raise ValueError(f"statistics state: rank {r} / {name!r} outside the layout")
        _check_history(f"{name} of rank {r}", mean, dev, n)
    for name, mean, dev, n in body["spread"]:
        if name not in names:
            raise ValueError(f"statistics state: spread of {name!r} outside the layout")
        _check_history(f"spread of {name}", mean, dev, n)
    if int(body["steps_learnt"]) < 0:
        raise ValueError("statistics state: negative steps_learnt")


def _check_history(what: str, mean: float, dev: float, n: int) -> None:
    if not (math.isfinite(mean) and math.isfinite(dev) and dev >= 0 and int(n) >= 0):
        raise ValueError(f"statistics state: {what} holds {mean}, {dev}, {n}")


def _table_of(values: Sequence[dict[str, float]]) -> tuple[list[str], npt.NDArray[np.float64]]:
    return table_of(values)


def _mappings(names: Sequence[str], raw: _Table) -> list[dict[str, float]]:
    rows = raw.tolist() if isinstance(raw, np.ndarray) else raw
    return [dict(zip(names, row, strict=True)) for row in rows]
