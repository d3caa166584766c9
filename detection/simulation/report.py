"""What a ``sdcguard train`` rank reports: the DESIGN report JSON, as of its last complete step.

Rank 0 writes it itself (atomically, before the webhook flush): a launcher stopped meanwhile
would lose it. A stopped run reports the weights after its last complete step.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from detection.gate import CheckpointGate
from detection.guard import SDCGuard
from detection.simulation.config import TrainConfig
from detection.weights.fingerprint import Fingerprint, weight_fingerprint
from detection.weights.state import model_state_tensors

__all__ = ["Progress", "build_report", "step_ms", "write_report"]


@dataclass
class Progress:
    """How far the loop got: step times, the last step whose update finished, and whether the
    loop ended on a stop."""

    durations: list[float] = field(default_factory=list)
    completed: int | None = None
    completed_fp: Fingerprint | None = None
    terminating: bool = False


def build_report(
    config: TrainConfig,
    nodes: Sequence[str],
    model: nn.Module,
    guard: SDCGuard | None,
    gate: CheckpointGate | None,
    progress: Progress,
    *,
    final: Fingerprint | None = None,
) -> dict[str, Any]:
    """The DESIGN report. A stopped run reports the weights after its last complete step: the
    signal may have landed inside an update, so the live tensors are not a state any step
    produced. ``final``, where given, is reported instead: a sharded job's rank holds a part
    of the model, so the job sums the fingerprint over its ranks."""
    if final is None and progress.terminating:
        final = progress.completed_fp
    if final is None:
        final = weight_fingerprint(model_state_tensors(model))
    alarms = guard.alarms if guard is not None else []
    report: dict[str, Any] = {
        "world_size": config.world_size,
        "steps": config.steps,
        "nodes": {str(r): n for r, n in enumerate(nodes)},
        "alarms": [a.to_report() for a in alarms],
        "checkpoints": [r.to_report() for r in gate.records] if gate is not None else [],
        "final_fingerprint": final.hex(),
        "step_ms": step_ms(progress.durations),
    }
    if progress.terminating:
        # Stopped (the incident flow stops training): rank 0 still reports what the job did up
        # to its last complete step — its alarms and checkpoints are the incident's evidence.
        report["stopped_after_step"] = progress.completed
    return report


def step_ms(durations: Sequence[float]) -> dict[str, float]:
    if not durations:
        return {"median": 0.0, "p90": 0.0}
    ordered = sorted(d * 1000.0 for d in durations)
    p90 = ordered[min(len(ordered) - 1, max(0, round(0.9 * len(ordered)) - 1))]
    return {"median": round(statistics.median(ordered), 3), "p90": round(p90, 3)}


def write_report(config: TrainConfig, report: dict[str, Any]) -> None:
    if config.report is None:
        return
    config.report.parent.mkdir(parents=True, exist_ok=True)
    temp = config.report.with_name(config.report.name + ".tmp")
    temp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(temp, config.report)
