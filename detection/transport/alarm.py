"""Alarms: what a detection layer found, in the two shapes the outside world reads.

One detected event is one :class:`Alarm`: every rank decides it from the same all-gathered
evidence, so every rank holds an identical copy, and exactly one rank — the lowest rank that is
not a suspect (:meth:`Alarm.reporting_rank`) — turns it into a webhook body. An alarm's ``step``
is the step whose computation was found wrong, not the step at which someone noticed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

__all__ = ["Alarm", "Layer", "Phase", "event_alarm_id", "rfc3339_now"]


class Layer(StrEnum):
    """Which detection layer raised the alarm (DESIGN: report ``layer``)."""

    NONFINITE = "nonfinite"
    AUDIT = "audit"
    FINGERPRINT = "fingerprint"
    # The per-step layer (detection.stepcheck.checks): statistical and algebraic evidence on every
    # step.
    GRADSTATS = "gradstats"
    ALLREDUCE = "allreduce"
    OPTSTATE = "optstate"
    ABFT = "abft"


class Phase(StrEnum):
    """Where in the step the wrong value was seen (DESIGN: report ``phase``)."""

    PRE_ALLREDUCE = "pre-allreduce"
    POST_ALLREDUCE = "post-allreduce"
    LOSS = "loss"
    GRADIENT = "gradient"
    WEIGHTS = "weights"
    OPTIMIZER_STATE = "optimizer-state"
    FORWARD = "forward"
    BACKWARD = "backward"


def rfc3339_now() -> str:
    """UTC now as RFC 3339 with millisecond precision and a ``Z`` suffix."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Alarm:
    """One detected event.

    Invariants: ``suspect_ranks`` is sorted and unique; ``suspect_nodes`` are the sorted unique
    nodes of those ranks; ``detail`` holds only JSON values (it is posted as is).
    """

    step: int
    layer: Layer
    phase: Phase
    suspect_ranks: tuple[int, ...] = ()
    suspect_nodes: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def for_ranks(
        cls,
        step: int,
        layer: Layer,
        phase: Phase,
        suspect_ranks: Sequence[int],
        nodes: Sequence[str],
        detail: Mapping[str, Any],
    ) -> Alarm:
        """Build an alarm whose suspect nodes are derived from ``nodes[rank]``."""
        ranks = tuple(sorted(set(suspect_ranks)))
        return cls(
            step=step,
            layer=layer,
            phase=phase,
            suspect_ranks=ranks,
            suspect_nodes=tuple(sorted({nodes[r] for r in ranks})),
            detail=dict(detail),
        )

    def reporting_rank(self, world_size: int) -> int:
        """The rank that sends this alarm: the lowest rank not among the suspects.

        A suspect rank may be the broken one, so it never speaks for the job; when every rank is
        a suspect, rank 0 reports (someone has to).
        """
        suspects = set(self.suspect_ranks)
        for rank in range(world_size):
            if rank not in suspects:
                return rank
        return 0

    def to_report(self) -> dict[str, Any]:
        """The DESIGN report entry (``sdcguard train --report``), field for field."""
        return {
            "step": self.step,
            "layer": str(self.layer),
            "phase": str(self.phase),
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": list(self.suspect_nodes),
            "detail": dict(self.detail),
        }

    def to_webhook(self, job_id: str, rank: int, node: str) -> dict[str, Any]:
        """The DESIGN ``POST /v1/alarms`` body, sent by ``rank`` on ``node``.

        ``alarm_id`` is :func:`event_alarm_id`: the same for the same event whichever rank
        reports it and however often the job runs that step, so the webhook records it once.
        """
        body: dict[str, Any] = {
            "job_id": job_id,
            "step": self.step,
            "rank": rank,
            "node": node,
            "layer": str(self.layer),
            "phase": str(self.phase),
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": list(self.suspect_nodes),
            "detail": dict(self.detail),
            "sent_at": rfc3339_now(),
        }
        return {"alarm_id": event_alarm_id(body), **body}


# uuid5 namespace of alarm ids: the same event gives the same id in every run and reporter.
_ALARM_NAMESPACE = uuid.UUID("6f1d2c3e-5b0a-4c8e-9d21-7a4e0b9c1f35")


def event_alarm_id(body: dict[str, Any]) -> str:
    """The ``alarm_id`` of one detected event: a uuid5 of what identifies it — job, step,
    layer, phase and suspect ranks — and nothing that differs between a run and its re-run
    (the reporting rank, the time). Two reporters of one event, or a job that runs a step
    again after a restart, send the same id and the webhook records the event once."""
    key = json.dumps(
        [
            body.get("job_id"),
            body.get("step"),
            body.get("layer"),
            body.get("phase"),
            sorted(body.get("suspect_ranks") or []),
        ],
        separators=(",", ":"),
    )
    return str(uuid.uuid5(_ALARM_NAMESPACE, key))
