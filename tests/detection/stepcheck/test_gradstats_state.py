"""The statistics armed from the first step, never poisoned, and their learnt state carried:
as pure functions of the gathered tables
(:class:`~detection.stepcheck.gradstats_detector.GradStatsDetector`).

* from step 0 a flip far beyond the early floor (x64) names its rank, and is not learnt;
* while the references are young, a value beyond the mature threshold (x16 here) but below the
  early floor is neither named nor learnt: a fault in the first steps widens no threshold;
* the learnt state round-trips exactly, through both engines (the loop and the arrays), and a
  copy decides every later step as the original does; a state that could disarm a test, or of
  another world size, is refused;
* the headroom (what the floor is set from) is the largest excess of the clean, mature steps,
  the same from both engines, and a step with a finding is not measured.
"""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from detection.stepcheck.gradstats import StatsConfig
from detection.stepcheck.gradstats_detector import GradStatsDetector

NAMES = ["loss", "l2[0]", "l2[1]", "amax[0]", "amax[1]"]


def _table(rng: random.Random, world: int) -> list[list[float]]:
    return [
        [
            math.exp(rng.gauss(0.5, 0.05)),
            *(math.exp(rng.gauss(-2, 0.1)) for _ in range(2)),
            *(math.exp(rng.gauss(-5, 0.2)) for _ in range(2)),
        ]
        for _ in range(world)
    ]


@pytest.mark.parametrize("array_min", [1 << 30, 0], ids=["loop", "arrays"])
@pytest.mark.parametrize("world", [2, 4])
def test_an_early_flip_is_named_or_kept_out_and_widens_no_threshold(
    world: int, array_min: int
) -> None:
    rng = random.Random(world)
    detector = GradStatsDetector(world, StatsConfig(), array_min=array_min)
    for _ in range(3):
        assert detector.test_learn_table(NAMES, _table(rng, world), learn=True) == []
    before = detector.history()
    # step 3: one element x2^20 of rank 1's bucket 0 (its norm and peak x~1e6): named
    table = _table(rng, world)
    table[1][1] *= 2.0**20
    table[1][3] *= 2.0**20
    found = detector.test_learn_table(NAMES, table, learn=True)
    assert [f.rank for f in found] == [1]
    assert found[0].threshold >= math.log(64.0)
    assert detector.history() == before  # a step with a finding is not learnt
    # step 4: rank 1's bucket 0 x20: past the mature threshold (x16), short of the early floor
    table = _table(rng, world)
    table[1][1] *= 20.0
    assert detector.test_learn_table(NAMES, table, learn=True) == []
    after = detector.history()
    assert after[(1, "l2[0]")] == before[(1, "l2[0]")]  # not learnt
    assert after[(0, "l2[0]")][2] == before[(0, "l2[0]")][2] + 1  # the rest is
    # 40 clean steps later the reference is the clean one: a x20 is named now
    for _ in range(40):
        assert detector.test_learn_table(NAMES, _table(rng, world), learn=True) == []
    mean, _dev, n = detector.history()[(1, "l2[0]")]
    assert n == 43  # every clean step but the two kept out
    assert abs(mean + 2.0) < 0.1
    table = _table(rng, world)
    table[1][1] *= 20.0
    assert [f.rank for f in detector.test_learn_table(NAMES, table, learn=True)] == [1]


def _trained(world: int, array_min: int) -> GradStatsDetector:
    """30 steps (two of them with a finding) in two bucket layouts, the second the current."""
    detector = GradStatsDetector(world, StatsConfig(warmup=5), array_min=array_min)
    rng = random.Random(7)
    for step in range(30):
        detector.reset_if_layout_changed((10, 20) if step < 12 else (30,))
        table = _table(rng, world)
        if step in (2, 21):
            table[step % world][2] *= 1e4
        detector.test_learn_table(NAMES, table, learn=True)
    return detector


def _canonical(state: dict) -> list:
    """A state's content whichever engine wrote it (each lists histories in its own order)."""
    return [
        (e["layout"], e["tests"]["steps_learnt"], sorted(map(str, e["tests"]["temporal"])))
        for e in state["layouts"]
    ]


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("source", [1 << 30, 0], ids=["from-loop", "from-arrays"])
@pytest.mark.parametrize("target", [1 << 30, 0], ids=["to-loop", "to-arrays"])
def test_the_learnt_state_round_trips_and_the_copy_decides_as_the_original(
    world: int, source: int, target: int
) -> None:
    state = _trained(world, source).state_dict()
    assert _canonical(state) == _canonical(_trained(world, 1 << 30 if source else 0).state_dict())
    assert [e["layout"] for e in state["layouts"]] == [[30], [10, 20]]
    copy = GradStatsDetector(world, StatsConfig(warmup=5), array_min=target)
    copy.load_state_dict(state)
    assert _canonical(copy.state_dict()) == _canonical(state)
    original = _trained(world, target)
    later = random.Random(world)
    for step in range(20):
        layout = (10, 20) if step >= 10 else (30,)  # back to the older layout: kept too
        copy.reset_if_layout_changed(layout)
        original.reset_if_layout_changed(layout)
        table = _table(later, world)
        if step in (5, 15):
            table[1][4] *= 1e6
        found = original.test_learn_table(NAMES, table, learn=True)
        assert copy.test_learn_table(NAMES, table, learn=True) == found
        assert bool(found) is (step in (5, 15))
        assert copy.history() == original.history()


def test_a_state_that_could_disarm_a_test_or_of_another_world_is_refused() -> None:
    detector = GradStatsDetector(4, StatsConfig())
    rng = random.Random(1)
    for _ in range(3):
        detector.test_learn_table(NAMES, np.asarray(_table(rng, 4)), learn=True)
    state = detector.state_dict()
    with pytest.raises(ValueError, match="learnt by 4 ranks"):
        GradStatsDetector(3, StatsConfig()).load_state_dict(state)
    for index, value in ((3, -1.0), (2, math.nan), (0, 7)):  # a negative spread, NaN, rank 7
        tests = dict(state["layouts"][0]["tests"])
        temporal = [list(t) for t in tests["temporal"]]
        temporal[0][index] = value
        bad = {
            **state,
            "layouts": [{**state["layouts"][0], "tests": {**tests, "temporal": temporal}}],
        }
        with pytest.raises(ValueError, match="statistics state"):
            GradStatsDetector(4, StatsConfig()).load_state_dict(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_the_headroom_is_the_largest_clean_excess_and_both_engines_record_it(world: int) -> None:
    """What the floor is set from (:mod:`detection.stepcheck.headroom`): on every learnt step
    past its reference's warm-up, the largest excess over the cross-rank median (3+ ranks) and
    over a rank's running mean; a step with a finding is not measured (it is not clean)."""
    warmup = 5
    rng = random.Random(11)
    tables = [_table(rng, world) for _ in range(40)]
    loop, arrays = (
        GradStatsDetector(world, StatsConfig(warmup=warmup), array_min=m) for m in (1 << 30, 0)
    )
    for table in tables:
        assert loop.test_learn_table(NAMES, table, learn=True) == []
        assert arrays.test_learn_table(NAMES, np.asarray(table), learn=True) == []
    assert loop.headroom == arrays.headroom
    temporal = loop.headroom.temporal
    assert temporal.steps == len(tables) - warmup
    assert 0 < temporal.excess < math.log(StatsConfig().floor_factor)
    cross = loop.headroom.cross
    if world < 3:
        assert (cross.steps, cross.excess) == (0, -math.inf)
    else:
        by_hand = max(
            (max(column) - statistics.median(column), name)
            for table in tables[warmup:]
            for name, column in zip(NAMES, zip(*map(_logs, table), strict=True), strict=True)
        )
        assert (cross.steps, (cross.excess, cross.statistic)) == (len(tables) - warmup, by_hand)
        largest = [_largest_excess(t) for t in tables[warmup:]]
        assert cross.reached[0] == sum(e >= math.log(2) for e in largest)  # steps past x2
    before = (loop.headroom.cross.steps, loop.headroom.temporal.steps)
    table = _table(rng, world)
    table[1][1] *= 2.0**20  # a flip: named, not learnt, not measured
    assert [f.rank for f in loop.test_learn_table(NAMES, table, learn=True)] == [1]
    assert (loop.headroom.cross.steps, loop.headroom.temporal.steps) == before


def _logs(row: list[float]) -> list[float]:
    return [math.log(v) for v in row]


def _largest_excess(table: list[list[float]]) -> float:
    columns = zip(*map(_logs, table), strict=True)
    return max(max(c) - statistics.median(c) for c in columns)
