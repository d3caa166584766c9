"""The per-step statistics of a sharded model's gradients, before the reduce-scatter.

Under DDP the comm hook hands each bucket's local statistics to
:mod:`detection.stepcheck.gradstats`; under FSDP2 the checked reduce-scatter
(:mod:`detection.guard.sharded_hook`) records, per call, the L2 norm and the L∞ of this rank's
own gradient of one FSDP module, and this module runs the same tests over them: every rank's
statistics against the others' on the same step (cross-rank) and against its own history
(temporal), after ``StatsConfig.warmup`` clean steps. A finding names the ranks whose
gradient (or loss) stands out — statistical evidence, weaker than a vote, which the alarm's
detail says. Under a GradScaler the statistics are divided by the step's scale first, so a
change of scale is not a change of gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from detection.stepcheck.checks import WEAKER
from detection.stepcheck.gradstats import StatsConfig
from detection.stepcheck.gradstats_detector import GradStatsDetector
from detection.transport.alarm import Alarm, Layer, Phase

__all__ = ["ShardedStats"]

_COLLECTIVE = "reduce-scatter"


class ShardedStats:
    """The tests over one step's table (``rows[r]``: rank ``r``'s loss, then each
    reduce-scatter's L2, then each one's L∞), the same on every rank."""

    def __init__(self, world_size: int, config: StatsConfig, nodes: Sequence[str]) -> None:
        self.config = config
        self.nodes = tuple(nodes)
        self.detector = GradStatsDetector(world_size, config)
        self.tested = 0

    def state_dict(self) -> dict[str, Any]:
        """What the tests learnt (:mod:`detection.guard.state` carries it with a checkpoint),
        marked as a reduce-scatter's statistics: a DDP guard's (of gradient buckets) is not
        taken for them, nor the reverse."""
        return {
            "collective": _COLLECTIVE,
            "gradstats": self.detector.state_dict(),
            "tested_steps": self.tested,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a :meth:`state_dict` (``ValueError`` for another kind or world size): the
        next step is tested against what was learnt."""
        if state.get("collective") != _COLLECTIVE:
            raise ValueError(
                "not a sharded guard's statistics (a DDP guard's are of gradient buckets, not "
                "of a sharded model's reduce-scatters)"
            )
        self.detector.load_state_dict(state["gradstats"])
        self.tested = int(state["tested_steps"])

    def decide(self, step: int, rows: Sequence[Sequence[float]], *, learn: bool) -> Alarm | None:
        """The step's finding (``None`` while calibrating or when nothing stands out); a
        clean step is learnt when ``learn`` (no other layer found anything)."""
        if not rows or not all(math.isfinite(v) for r in rows for v in r):
            return None  # non-finite: the non-finite check's (or the scaler's) to judge
        calls = (len(rows[0]) - 1) // 2
        self.detector.reset_if_layout_changed(calls)
        names = ("loss", *(f"l2[{b}]" for b in range(calls)), *(f"amax[{b}]" for b in range(calls)))
        self.tested += 1
        found = self.detector.test_learn_table(names, [list(r) for r in rows], learn=learn)
        if not found:
            return None
        lead = max(found, key=lambda f: f.deviation / f.threshold)
        return Alarm.for_ranks(
            step,
            Layer.GRADSTATS,
            Phase.LOSS if lead.statistic == "loss" else Phase.PRE_ALLREDUCE,
            sorted(f.rank for f in found),
            self.nodes,
            {
                "test": lead.test,
                "statistic": f"log {lead.statistic}",
                "bucket": lead.bucket,
                "deviation": round(lead.deviation, 6),
                "threshold": round(lead.threshold, 6),
                "k": self.config.k,
                "floor_factor": self.config.floor_factor,
                "warmup": self.config.warmup,
                "per_rank": [f.to_detail() for f in found],
                "evidence": WEAKER,
                "collective": "reduce-scatter",
            },
        )
