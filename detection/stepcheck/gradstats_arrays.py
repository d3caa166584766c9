"""The per-step statistical tests of :mod:`detection.stepcheck.gradstats` over arrays, for large
tables.

The tests and their calibration are the module docstring of :mod:`detection.stepcheck.gradstats`,
whose
scalar loop over dictionaries is their definition. Here they run over arrays, one column a
statistic (``loss``, ``l2[b]``, ``amax[b]``) and one row a rank: a job of 560 buckets on 64 ranks
has 71,680 values a step, which the loop took 131 ms to test and learn, on every rank, every
step, and this takes 21. On a small table the loop is faster (a few dozen numpy calls cost
~50 µs where the loop takes 14), so
:class:`~detection.stepcheck.gradstats_detector.GradStatsDetector` picks one
per layout by the table's size.

The arrays keep every rank's verdict identical: apart from the logarithm (``math.log``, the
same function the loop uses), the tests take only elementwise IEEE operations and medians
(selections, and the mean of the two middle values for an even count, as ``statistics.median``),
whose results do not depend on the vector unit of the host that computes them.

Invariant: for the same sequence of steps, the findings and the histories equal those of the
scalar definition, value for value: a history ``(mean, dev, n)`` of one statistic of one rank
is updated only on steps where that value is finite, with weight ``1/(n + 1)`` for the first
``warmup`` updates and ``alpha`` after, ``dev`` before ``mean``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from detection.stepcheck.gradstats import (
    MAD_TO_SIGMA,
    TINY,
    StatFinding,
    StatsConfig,
    stat_finding,
    worst_per_rank,
)
from detection.stepcheck.headroom import Headroom, TestPeak

__all__ = ["ArrayTests", "table_of"]

_Array = npt.NDArray[np.float64]


def _logs(raw: _Array) -> _Array:
    """``log(max(|v|, 1e-30))`` of every finite value, NaN for the others (left out)."""
    finite = np.isfinite(raw)
    magnitude = np.maximum(np.abs(np.where(finite, raw, 1.0)), TINY)
    logs = np.fromiter(map(math.log, magnitude.ravel().tolist()), np.float64, magnitude.size)
    return np.where(finite, logs.reshape(raw.shape), np.nan)


def _median(x: _Array) -> _Array:
    """The median of each column over its non-NaN values (``np.nanmedian``'s result; its
    per-column path is slow on small arrays, so it only takes the columns holding a NaN)."""
    holes = np.isnan(x).any(axis=0)
    if not holes.any():
        return np.asarray(np.median(x, axis=0), dtype=np.float64)
    out = np.asarray(np.median(np.where(holes, 0.0, x), axis=0), dtype=np.float64)
    out[holes] = np.nanmedian(x[:, holes], axis=0)
    return out


def _update(
    mean: _Array, dev: _Array, n: npt.NDArray[np.int64], x: _Array, alpha: float, warmup: int
) -> None:
    """The running mean and mean absolute deviation of every finite ``x``, in place."""
    seen = ~np.isnan(x)
    weight = np.where(n < warmup, 1.0 / (n + 1), alpha)
    new_dev = dev + weight * (np.abs(x - mean) - dev)
    new_mean = mean + weight * (x - mean)
    np.copyto(dev, new_dev, where=seen & (n > 0))
    np.copyto(mean, new_mean, where=seen)
    n += seen


@dataclass
class ArrayTests:
    """The tests of one layout over ``(world, n)`` arrays of raw statistics (see the module)."""

    world_size: int
    config: StatsConfig = field(default_factory=StatsConfig)
    steps_learnt: int = 0
    _cols: dict[str, int] = field(default_factory=dict)
    _names: list[str] = field(default_factory=list)
    _t_mean: _Array = field(default_factory=lambda: np.zeros((0, 0)))
    _t_dev: _Array = field(default_factory=lambda: np.zeros((0, 0)))
    _t_n: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    _s_mean: _Array = field(default_factory=lambda: np.zeros(0))
    _s_dev: _Array = field(default_factory=lambda: np.zeros(0))
    _s_n: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    _seen: tuple[_Array, _Array] | None = None  # the last table and its logs
    _mature: bool = False  # every reference holds ``warmup`` steps: no young-value gate
    headroom: Headroom = field(default_factory=Headroom)  # clean excesses (measurement only)

    def history(self) -> dict[tuple[int, str], tuple[float, float, int]]:
        """The temporal test's reference per (rank, statistic): running mean and mean absolute
        deviation of its log, and the clean steps learnt."""
        out: dict[tuple[int, str], tuple[float, float, int]] = {}
        for name, c in self._cols.items():
            for r in range(self._t_n.shape[0]):
                if self._t_n[r, c]:
                    out[(r, name)] = (
                        float(self._t_mean[r, c]),
                        float(self._t_dev[r, c]),
                        int(self._t_n[r, c]),
                    )
        return dict(sorted(out.items()))

    def export(self) -> dict[str, Any]:
        """What was learnt, as plain lists, in the loop's format (``_ScalarTests.export``)."""
        temporal = [
            [r, name, float(self._t_mean[r, c]), float(self._t_dev[r, c]), int(self._t_n[r, c])]
            for r in range(self._t_n.shape[0])
            for name, c in self._cols.items()
            if self._t_n[r, c]
        ]
        spread = [
            [name, float(self._s_mean[c]), float(self._s_dev[c]), int(self._s_n[c])]
            for name, c in self._cols.items()
            if self._s_n[c]
        ]
        return {
            "steps_learnt": self.steps_learnt,
            "names": list(self._names),
            "temporal": temporal,
            "spread": spread,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.steps_learnt = int(state["steps_learnt"])
        self._columns([str(n) for n in state["names"]])
        for r, name, mean, dev, n in state["temporal"]:
            c = self._cols[str(name)]
            self._t_mean[int(r), c], self._t_dev[int(r), c], self._t_n[int(r), c] = mean, dev, n
        for name, mean, dev, n in state["spread"]:
            c = self._cols[str(name)]
            self._s_mean[c], self._s_dev[c], self._s_n[c] = mean, dev, n
        self._seen = None
        self._mature = False

    def test_table(self, names: Sequence[str], raw: _Array) -> list[StatFinding]:
        """The findings of this step, at most one per rank; ``raw[r, j]`` is the value of
        statistic ``names[j]`` on rank ``r``."""
        cfg = self.config
        cols = self._columns(names)
        logs = self._logs(raw)
        floor, early = math.log(cfg.floor_factor), math.log(cfg.early_factor)
        cross: list[StatFinding] = []

        if self.world_size >= 3:
            counted = (~np.isnan(logs)).sum(axis=0) >= 3
            if counted.any():
                median = np.full(len(names), np.nan)
                median[counted] = _median(logs[:, counted])
                scale = np.where(self._s_n[cols] > 0, self._s_mean[cols], 0.0)
                base = np.where(self._s_n[cols] >= cfg.warmup, floor, early)
                threshold = np.maximum(cfg.k * scale, base)
                hits = counted & (logs - median > threshold)
                # names in sorted order, then ranks: the loop's order (it breaks ties)
                for j in sorted(set(np.nonzero(hits)[1].tolist()), key=lambda j: names[j]):
                    for r in np.nonzero(hits[:, j])[0].tolist():
                        cross.append(
                            stat_finding(
                                r,
                                names[j],
                                "cross-rank",
                                float(logs[r, j]),
                                float(median[j]),
                                float(threshold[j]),
                                float(scale[j]),
                            )
                        )
        mean, dev, n = self._t_mean[:, cols], self._t_dev[:, cols], self._t_n[:, cols]
        threshold = np.maximum(cfg.k * dev, np.where(n >= cfg.warmup, floor, early))
        hits = (n > 0) & (logs - mean > threshold)
        temporal = [
            stat_finding(
                r,
                names[j],
                "temporal",
                float(logs[r, j]),
                float(mean[r, j]),
                float(threshold[r, j]),
                float(dev[r, j]),
            )
            for r, j in np.argwhere(hits).tolist()  # Python ints: ranks go into alarms
        ]
        return worst_per_rank(cross, temporal, self.world_size)

    def learn_table(self, names: Sequence[str], raw: _Array) -> None:
        """Fold a clean step into the histories (``raw`` as for :meth:`test_table`)."""
        cfg = self.config
        cols = self._columns(names)
        logs = self._logs(raw)
        mean, dev, n = self._t_mean[:, cols], self._t_dev[:, cols], self._t_n[:, cols]
        kept_cols = np.zeros(len(cols), dtype=bool)
        learnt = logs
        if not self._mature:
            kept, kept_cols = self._outliers(logs, mean, dev, n, cols)
            if kept.any():
                learnt = np.where(kept, np.nan, logs)
        self._note(self.headroom.temporal, names, np.where(n >= cfg.warmup, learnt - mean, np.nan))
        _update(mean, dev, n, learnt, cfg.alpha, cfg.warmup)
        self._t_mean[:, cols], self._t_dev[:, cols], self._t_n[:, cols] = mean, dev, n
        if self.world_size >= 3:
            counted = ((~np.isnan(logs)).sum(axis=0) >= 3) & ~kept_cols
            if counted.any():
                part = logs[:, counted]
                median = _median(part)
                mad = MAD_TO_SIGMA * _median(np.abs(part - median))
                where = np.asarray(cols)[counted]
                s_mean, s_dev, s_n = self._s_mean[where], self._s_dev[where], self._s_n[where]
                top = np.where(s_n >= cfg.warmup, np.nanmax(part, axis=0) - median, np.nan)
                self._note(
                    self.headroom.cross, [n for n, c in zip(names, counted, strict=True) if c], top
                )
                _update(s_mean, s_dev, s_n, mad, cfg.alpha, cfg.warmup)
                self._s_mean[where], self._s_dev[where], self._s_n[where] = s_mean, s_dev, s_n
        self.steps_learnt += 1
        if self.steps_learnt >= cfg.warmup and not self._mature:
            self._mature = bool(
                (self._t_n >= cfg.warmup).all()
                and (self.world_size < 3 or (self._s_n >= cfg.warmup).all())
            )

    @staticmethod
    def _note(peak: TestPeak, names: Sequence[str], excess: _Array) -> None:
        """The loop's headroom record of one learnt step: the largest non-NaN ``excess``
        (a row per rank, or one value per column) and its column's name."""
        if np.isnan(excess).all():
            return
        index = int(np.nanargmax(excess))
        peak.note(float(excess.flat[index]), names[index % len(names)])

    def _outliers(
        self, logs: _Array, mean: _Array, dev: _Array, n: npt.NDArray[np.int64], cols: list[int]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """The loop's ``_outliers`` over arrays: the values a young reference does not learn
        (a ``(world, n)`` mask), and the columns whose spread it does not learn."""
        cfg = self.config
        floor, k = math.log(cfg.floor_factor), cfg.k
        with np.errstate(invalid="ignore"):
            temporal = (n > 0) & (n < cfg.warmup) & (logs - mean > np.maximum(k * dev, floor))
        ranks = int(temporal.any(axis=1).sum())
        if not (ranks < self.world_size and ranks <= max(1, self.world_size // 2)):
            temporal[:] = False
        cross = np.zeros_like(temporal)
        if self.world_size >= 3:
            s_n = self._s_n[cols]
            young = ((~np.isnan(logs)).sum(axis=0) >= 3) & (s_n < cfg.warmup)
            if young.any():
                part = logs[:, young]
                scale = np.where(s_n[young] > 0, self._s_mean[cols][young], 0.0)
                with np.errstate(invalid="ignore"):
                    cross[:, young] = part - _median(part) > np.maximum(k * scale, floor)
        return temporal | cross, np.asarray(cross.any(axis=0), dtype=bool)

    def _logs(self, raw: _Array) -> _Array:
        """:func:`_logs` of ``raw``, reused when the table is the last one asked for: a clean
        step is tested, then learnt, and the logs (one ``math.log`` a value) are most of the
        cost of either. Compared by value, so a table changed in place is computed afresh."""
        if self._seen is not None and np.array_equal(self._seen[0], raw, equal_nan=True):
            return self._seen[1]
        logs = _logs(raw)
        logs.flags.writeable = False  # shared by the step's test and learning
        self._seen = (raw.copy(), logs)
        return logs

    # -- columns ---------------------------------------------------------------------------------
    def _columns(self, names: Sequence[str]) -> list[int]:
        """The history columns of ``names``, new ones added with empty histories."""
        fresh = [name for name in names if name not in self._cols]
        if fresh:
            for name in fresh:
                self._cols[name] = len(self._names)
                self._names.append(name)
            self._grow(len(self._names))
        return [self._cols[name] for name in names]

    def _grow(self, width: int) -> None:
        """Histories for ``width`` statistics, one row a rank: the new ones zero (empty)."""
        ranks, more = self.world_size - self._t_n.shape[0], width - self._t_n.shape[1]
        self._t_mean = np.pad(self._t_mean, ((0, ranks), (0, more)))
        self._t_dev = np.pad(self._t_dev, ((0, ranks), (0, more)))
        self._t_n = np.pad(self._t_n, ((0, ranks), (0, more)))
        self._s_mean = np.pad(self._s_mean, (0, more))
        self._s_dev = np.pad(self._s_dev, (0, more))
        self._s_n = np.pad(self._s_n, (0, more))


def table_of(values: Sequence[dict[str, float]]) -> tuple[list[str], _Array]:
    """Column names (in order of first appearance) and the ``(world, n)`` array of a mapping
    per rank; a statistic a rank did not report is NaN there (left out, as non-finite)."""
    names = list(dict.fromkeys(name for per in values for name in per))
    raw = np.full((len(values), len(names)), np.nan)
    for r, per in enumerate(values):
        for j, name in enumerate(names):
            if name in per:
                raw[r, j] = per[name]
    return names, raw
