"""The approval stage: the policy's decision on the strongest evidence, or a human's.

The form and the wait live in :mod:`flows.incident.approval.form`; this module gathers the evidence
the approver sees and records the decision, so an approver is never asked twice.

Invariants: the request (the nodes put to the approver and the deadline) is recorded in the
ledger before the wait, once; a re-entered run reuses it, so the clock never restarts and a
later alarm never widens what is being decided. The decision names exactly the nodes approved,
a subset of the request's; the fix stage replaces those and no other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from db import IncidentState, IncidentView
from db.evidence import APPROVAL, APPROVAL_REQUEST
from flows.incident.approval.form import (
    ApprovalChoice,
    Evidence,
    answered_by,
    ask_for_approval,
    flow_run_name,
)
from flows.incident.notify import NeedsHuman, needs_human
from flows.incident.policy import AlarmEvidence, IncidentPolicy, StormCheck, auto_approval
from flows.incident.stages._common import Stage, StageOutcome, record_stage
from flows.incident.stages._incident import (
    advance,
    implicated_nodes,
    nodes_to_fix,
    verdict_of,
    with_evidence,
)
from flows.incident.stages.containment import recheck_storm
from flows.incident.wiring import Backends, current_backends
from recovery.remediation import RemediationVerb

__all__ = ["AUTO_APPROVER", "EXPIRE", "Decision", "seek_approval", "withdraw_automatic"]

log = logging.getLogger(__name__)

AUTO_APPROVER = "policy:auto-approve"


@dataclass(frozen=True)
class Decision:
    """The approval outcome the flow branches on."""

    choice: str
    """``approve``, ``reject`` or ``expire``."""
    uncordon_on_reject: bool = False
    nodes: tuple[str, ...] = field(default=())
    """On approve, exactly the nodes approved for the fix."""
    automatic: bool = False
    """Approved by the policy, not a human: withdrawn if the storm guard trips before the fix."""

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
        request, fresh = _request(b, incident, policy)
        requested = list(request["nodes"])
        verdict = verdict_of(incident)
        if recheck_storm(b, incident_id, policy):  # alarms that arrived since triage count
            incident = b.ledger.get_incident(incident_id)
        storm = _storm_of(incident)
        auto = auto_approval(
            policy=policy,
            verdict=verdict.get("verdict"),
            verdict_node=verdict.get("node"),
            alarms=_alarm_evidence(incident),
            storm=storm,
        )
        if auto.approved and requested:  # culprit unknown: never approved without a human
            return _decide(
                b,
                incident_id,
                ApprovalChoice.APPROVE.value,
                AUTO_APPROVER,
                auto.reason,
                nodes=requested,
                identity={"identity_source": "policy"},
            )
        remediation = b.remediator()
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
            nodes_to_fix=requested,
            action=policy.action.value,
            remediation=remediation.kind.value,
            remediation_effect=remediation.describe(RemediationVerb(policy.action.value)),
        )
        if fresh:  # paged once per request, not again when a suspended run is re-entered
            _page(incident, requested)
        answer = ask_for_approval(
            evidence,
            policy,
            poll_interval_s=poll_interval_s,
            deadline=datetime.fromisoformat(str(request["deadline"])),
        )
        if answer is None:
            return _decide(
                b,
                incident_id,
                EXPIRE,
                None,
                f"no decision within {policy.approval_timeout_s} s",
            )
        choice, reason, approved = _bind(
            answer.decision.value, answer.reason, answer.nodes, requested
        )
        return _decide(
            b,
            incident_id,
            choice,
            answer.approver,
            reason,
            uncordon_on_reject=answer.uncordon_on_reject,
            nodes=approved,
            identity=answered_by(answer).as_record(),
        )

    outcome = record_stage(Stage.APPROVAL, incident_id, body)
    return Decision(
        choice=str(outcome["decision"]),
        uncordon_on_reject=bool(outcome.get("uncordon_on_reject", False)),
        nodes=tuple(outcome.get("nodes") or ()),
        automatic=outcome.get("approver") == AUTO_APPROVER,
    )


def withdraw_automatic(incident_id: str, policy: IncidentPolicy, decision: Decision) -> bool:
    """Just before the destructive stages: does an automatic approval still stand?

    The storm guard runs again with the alarms known now (they may have arrived after the
    approval, e.g. while waiting for the fleet-wide slot). If it trips, the policy's approval
    is withdrawn (:meth:`db.Ledger.withdraw_decision`: decision and request cleared, the
    approval stage reopened, the incident still awaiting approval) and True is returned: the
    caller asks a human. A human's
    decision is never withdrawn (later alarms are new evidence, never a silent change of what
    was approved), nor one whose fix already began (the incident left ``awaiting_approval``).
    """
    if not (decision.approved and decision.automatic):
        return False
    b = current_backends()
    if b.ledger.get_incident(incident_id).state is not IncidentState.AWAITING_APPROVAL:
        return False
    if not recheck_storm(b, incident_id, policy):
        return False
    storm = b.ledger.get_incident(incident_id).storm_reason or "alarm storm"
    reason = f"automatic approval withdrawn before the fix: {storm}"
    log.warning("%s", reason, extra={"incident": incident_id, "stage": Stage.APPROVAL.value})
    b.ledger.withdraw_decision(incident_id, by="storm guard", reason=reason)
    return True


def _page(incident: IncidentView, requested: list[str]) -> None:
    if requested:
        why, message = (
            NeedsHuman.APPROVAL,
            f"approve or reject {', '.join(requested)} for job {incident.job_id} in the "
            f"Prefect UI (flow run {flow_run_name(incident.id)})",
        )
    else:
        why, message = (
            NeedsHuman.CULPRIT_UNKNOWN,
            f"culprit unknown: no alarm of job {incident.job_id} names a suspect node; nothing "
            f"was cordoned; decide in the Prefect UI (flow run {flow_run_name(incident.id)})",
        )
    needs_human(incident.id, incident.job_id, why, message)


def _request(
    b: Backends, incident: IncidentView, policy: IncidentPolicy
) -> tuple[dict[str, Any], bool]:
    """The question put to the approver, recorded once: the nodes and the deadline.

    Returns it, and whether it was recorded just now."""
    recorded = (incident.evidence or {}).get(APPROVAL_REQUEST)
    if recorded:
        return dict(recorded), False
    deadline = datetime.now(UTC) + timedelta(seconds=policy.approval_timeout_s)
    request = {"nodes": nodes_to_fix(incident), "deadline": deadline.isoformat()}
    b.ledger.transition(
        incident.id,
        incident.state,
        evidence=with_evidence(incident, **{APPROVAL_REQUEST: request}),
    )
    return request, True


def _bind(
    choice: str, reason: str, answered: list[str], requested: list[str]
) -> tuple[str, str, list[str]]:
    """Bind an answer to the request: approve exactly the named nodes that were asked about.

    An empty node list approves every requested node. Names outside the request are never
    fixed; an approval that names none of the requested nodes approves nothing and is
    recorded as a rejection, with the reason.
    """
    if choice != ApprovalChoice.APPROVE.value:
        return choice, reason, []
    if not answered:
        return choice, reason, list(requested)
    approved = [n for n in requested if n in answered]
    unknown = sorted(set(answered) - set(requested))
    if unknown:
        reason += f" (not in the evidence, ignored: {', '.join(unknown)})"
    if not approved:
        return ApprovalChoice.REJECT.value, reason + "; no requested node approved", []
    return choice, reason, approved


def _decide(
    b: Backends,
    incident_id: str,
    choice: str,
    approver: str | None,
    reason: str,
    *,
    uncordon_on_reject: bool = False,
    nodes: list[str] | None = None,
    identity: dict[str, Any] | None = None,
) -> StageOutcome:
    """Record the decision; ``identity`` (a human's answer only) says who was authenticated."""
    record = {
        "decision": choice,
        "approver": approver,
        "reason": reason,
        "uncordon_on_reject": uncordon_on_reject if choice == ApprovalChoice.REJECT else False,
        "nodes": list(nodes or []) if choice == ApprovalChoice.APPROVE else [],
        **(identity or {}),
    }
    incident = b.ledger.get_incident(incident_id)
    b.ledger.transition(
        incident_id,
        incident.state,
        decision=choice,
        approver=approver,
        approval_reason=reason,
        evidence=with_evidence(incident, **{APPROVAL: record}),
    )
    by = f" by {approver}" if approver else ""
    return {"outcome": f"{choice}{by}: {reason}", **record}
