"""The approval stage: the policy's decision on the strongest evidence, or a human's.

The form and the pause live in :mod:`flows.approval`; this module gathers the evidence the
approver sees and records the decision, so an approver is never asked twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from db import IncidentState, IncidentView
from flows.approval import ApprovalChoice, Evidence, ask_for_approval
from flows.policy import AlarmEvidence, IncidentPolicy, StormCheck, auto_approval
from flows.stages._common import (
    Stage,
    StageOutcome,
    advance,
    implicated_nodes,
    nodes_to_fix,
    record_stage,
    verdict_of,
    with_evidence,
)
from flows.wiring import Backends, current_backends

__all__ = ["AUTO_APPROVER", "EXPIRE", "Decision", "seek_approval"]

AUTO_APPROVER = "policy:auto-approve"


@dataclass(frozen=True)
class Decision:
    """The approval outcome the flow branches on."""

    choice: str
    """``approve``, ``reject`` or ``expire``."""
    uncordon_on_reject: bool = False

    @property
    def approved(self) -> bool:
        return self.choice == ApprovalChoice.APPROVE.value

    @property
    def rejected(self) -> bool:
        return self.choice == ApprovalChoice.REJECT.value


EXPIRE = "expire"


def _alarm_evidence(incident: IncidentView) -> list[AlarmEvidence]:
    return [
        AlarmEvidence(
            layer=a.layer,
            suspect_nodes=tuple(a.suspect_nodes),
            at=a.received_at,
            detail=a.detail,
            phase=a.phase,
        )
        for a in incident.alarms
    ]


def _storm_of(incident: IncidentView) -> StormCheck:
    recorded = (incident.evidence or {}).get("storm") or {}
    return StormCheck(
        tripped=incident.storm,
        reason=incident.storm_reason or str(recorded.get("reason") or "storm guard not run"),
        implicated=tuple(recorded.get("implicated") or ()),
        job_nodes=int(recorded.get("job_nodes") or 0),
        share=recorded.get("share"),
        recent_nodes=tuple(recorded.get("recent_nodes") or ()),
    )


def _rollback_step(backends: Backends, incident: IncidentView) -> int | None:
    candidates = backends.ledger.resume_candidates(incident.job_id, incident.suspect_start)
    return candidates[0].step if candidates else None


def seek_approval(incident_id: str, policy: IncidentPolicy, *, poll_interval_s: int) -> Decision:
    """Record a decision: the policy's (only on the strongest evidence) or a human's, through
    the form on the paused flow run. Runs in the flow itself, since only a flow can pause.

    A decision already in the ledger (an earlier run got it) is used as is: an approver is
    never asked twice.
    """

    def body() -> StageOutcome:
        b = current_backends()
        incident = b.ledger.get_incident(incident_id)
        recorded = (incident.evidence or {}).get("approval")
        if incident.decision is not None and recorded:
            return {"outcome": f"{incident.decision} (recorded earlier)", **recorded}
        incident = advance(
            b, incident_id, IncidentState.AWAITING_APPROVAL, reason="waiting for a decision"
        )
        verdict = verdict_of(incident)
        storm = _storm_of(incident)
        auto = auto_approval(
            policy=policy,
            verdict=verdict.get("verdict"),
            verdict_node=verdict.get("node"),
            alarms=_alarm_evidence(incident),
            storm=storm,
        )
        if auto.approved:
            return _decide(b, incident_id, ApprovalChoice.APPROVE.value, AUTO_APPROVER, auto.reason)
        evidence = Evidence(
            incident_id=incident_id,
            job_id=incident.job_id,
            suspect_nodes=implicated_nodes(incident),
            suspect_range=(incident.suspect_start, incident.suspect_end),
            verdict=verdict,
            telemetry=(incident.evidence or {}).get("telemetry") or {},
            storm=storm,
            auto_approval=auto.reason,
            rollback_checkpoint_step=_rollback_step(b, incident),
            alarm_count=len(incident.alarms),
            nodes_to_fix=nodes_to_fix(incident),
            action=policy.action.value,
        )
        answer = ask_for_approval(evidence, policy, poll_interval_s=poll_interval_s)
        if answer is None:
            return _decide(
                b,
                incident_id,
                EXPIRE,
                None,
                f"no decision within {policy.approval_timeout_s} s",
            )
        return _decide(
            b,
            incident_id,
            answer.decision.value,
            answer.approver,
            answer.reason,
            uncordon_on_reject=answer.uncordon_on_reject,
        )

    outcome = record_stage(Stage.APPROVAL, incident_id, body)
    return Decision(
        choice=str(outcome["decision"]),
        uncordon_on_reject=bool(outcome.get("uncordon_on_reject", False)),
    )


def _decide(
    b: Backends,
    incident_id: str,
    choice: str,
    approver: str | None,
    reason: str,
    *,
    uncordon_on_reject: bool = False,
) -> StageOutcome:
    record = {
        "decision": choice,
        "approver": approver,
        "reason": reason,
        "uncordon_on_reject": uncordon_on_reject if choice == ApprovalChoice.REJECT else False,
    }
    incident = b.ledger.get_incident(incident_id)
    b.ledger.transition(
        incident_id,
        incident.state,
        decision=choice,
        approver=approver,
        approval_reason=reason,
        evidence=with_evidence(incident, approval=record),
    )
    by = f" by {approver}" if approver else ""
    return {"outcome": f"{choice}{by}: {reason}", **record}
