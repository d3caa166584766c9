"""The incident-response flow: the SDC runbook, top to bottom.

Read :func:`incident_response` as the runbook an operator would follow by hand. Each step is a
stage in :mod:`flows.incident.stages`; the ledger, not Prefect, records what has been done, so this
flow can be retried or re-run for the same incident at any time and continues where it stopped —
it never cordons, replaces or resumes twice (see :mod:`flows.incident.stages` for how).

States (DESIGN): ``open → stopping → cordoned → diagnosing → awaiting_approval → replacing →
resuming → resolved``, or ``rejected`` / ``expired`` / ``failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from db import ClaimLost, IncidentState
from flows.incident.approval.form import artifact_key
from flows.incident.coordination import destructive_slot
from flows.incident.notify import NeedsHuman, needs_human
from flows.incident.policy import IncidentPolicy, within_limits
from flows.incident.report import incident_summary, report_markdown
from flows.incident.stages import (
    Decision,
    StageTask,
    close,
    collect_telemetry,
    cordon_suspects,
    diagnostic_rerun,
    fix_nodes,
    hand_over,
    quarantine_suspect_checkpoints,
    release_nodes,
    release_remediations,
    resume_training,
    seek_approval,
    stop_training,
    triage,
    withdraw_automatic,
)
from flows.incident.wiring import current_backends
from flows.settings import FlowSettings

__all__ = ["IncidentFailed", "fix_and_resume", "incident_response", "publish_report", "respond"]

log = logging.getLogger(__name__)


class IncidentFailed(RuntimeError):
    """The incident ended ``failed``: an action failed after its retries (reason attached).

    Raised so the Prefect run shows failed too; ``summary`` is what the report JSON needs.
    """

    def __init__(self, incident_id: str, reason: str, summary: dict[str, Any]) -> None:
        super().__init__(f"incident {incident_id} failed: {reason}")
        self.incident_id = incident_id
        self.reason = reason
        self.summary = summary


@flow(
    name="incident-response",
    flow_run_name="incident-{incident_id}",
    persist_result=False,
    validate_parameters=True,
)
def incident_response(
    incident_id: str, policy: IncidentPolicy = IncidentPolicy(), retry: bool = False
) -> dict[str, Any]:
    """Walk one silent-data-corruption incident to a safe end.

    1. Triage: the storm guard — alarms on too many nodes at once mean software, and a human.
    2. Stop training, and with it checkpoint publication; quarantine the suspect range.
    3. Cordon and taint the suspect nodes.
    4. Collect telemetry (DCGM, dcgmi diag, Xid, nvidia-smi) as evidence.
    5. Replay the suspect steps on the suspects and on spares: hardware, software or
       inconclusive.
    6. Approval: a human in the Prefect UI form (or the policy, on the strongest evidence).
       Reject → ``rejected`` (uncordon if asked); no answer in time → ``expired`` (stays
       cordoned, nothing replaced).
    7. Remediate the approved nodes through the cluster's remediation (HyperPod replace or
       reboot, the autoscaler's replacement, NVSentinel, or isolation) — from here to the
       resume, one incident at a time fleet-wide (:mod:`flows.incident.coordination`). Just
       before, the storm guard runs again: if later alarms make it a storm, the policy's own
       approval is withdrawn and a human decides.
    8. Quarantine the checkpoints of the suspect range once more (late arrivals included).
    9. Resume from the newest verified checkpoint before the range, sha256 checked in storage,
       and remove what the remediation left for the incident (an NVSentinel ExternalFault).
       An isolated node is not replaced: training stays stopped and a human takes over.
    10. Resolved. The incident report is published as an artifact and returned as a dict.

    ``retry``: a ``failed`` or ``expired`` incident is reopened first and continued (the
    Prefect UI's way to move one forward; ``sdcguard incident retry`` does the same).

    ``policy`` is bounded first by this process's ``SDCGUARD_POLICY_…`` limits: a run's
    parameter can make auto-approval and the storm guard stricter, never looser.
    """
    backends = current_backends()
    ledger = backends.ledger
    policy, refused = within_limits(policy, backends.policy_limits)
    for line in refused:
        log.warning("policy parameter bounded: %s", line, extra={"incident": incident_id})
    current = ledger.get_incident(incident_id)
    if retry and current.state in (IncidentState.FAILED, IncidentState.EXPIRED):
        ledger.retry_incident(
            incident_id, by=_run_name(), reason="retry requested on the incident flow run"
        )
    elif current.state.terminal:
        log.info("incident already closed; reporting only", extra={"incident": incident_id})
        return publish_report(incident_id)

    def run(stage: StageTask) -> dict[str, Any]:
        retrying = stage.with_options(
            retries=policy.task_retries, retry_delay_seconds=policy.retry_delays() or 0
        )
        return retrying(incident_id, policy)

    try:
        run(triage)
        run(stop_training)
        run(cordon_suspects)
        run(collect_telemetry)
        run(diagnostic_rerun)
        poll_s = FlowSettings().approval_poll_s
        decision = seek_approval(incident_id, policy, poll_interval_s=poll_s)
        outcome = fix_and_resume(incident_id, policy, decision, run) if decision.approved else None
        if decision.approved and outcome is None:
            # the storm guard, run again before the fix, withdrew the policy's approval
            decision = seek_approval(incident_id, policy, poll_interval_s=poll_s)
            if decision.approved:
                outcome = fix_and_resume(incident_id, policy, decision, run)
        if decision.approved:
            close(incident_id, IncidentState.RESOLVED, outcome or RESUMED)
        elif decision.rejected:
            if decision.uncordon_on_reject:
                run(release_nodes)
            close(
                incident_id,
                IncidentState.REJECTED,
                "rejected by the approver; "
                + (
                    "our cordons were lifted"
                    if decision.uncordon_on_reject
                    else "nodes stay cordoned"
                )
                + ", nothing replaced, training stays stopped",
            )
        else:
            expired = close(
                incident_id,
                IncidentState.EXPIRED,
                f"no decision within {policy.approval_timeout_s} s: nodes stay cordoned, "
                "nothing replaced, training stays stopped",
            )
            needs_human(
                incident_id,
                expired.job_id,
                NeedsHuman.EXPIRED,
                f"{expired.reason}; `sdcguard incident retry {incident_id}` asks again",
            )
    except ClaimLost as err:
        # another run took this incident's claim over (ours had expired): it owns the incident
        # now, so this run records nothing and stops — no destructive call was made after.
        log.warning("claim lost, this run stops: %s", err, extra={"incident": incident_id})
        raise
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        log.error("incident failed: %s", reason, extra={"incident": incident_id})
        if not ledger.get_incident(incident_id).state.terminal:
            failed = ledger.transition(incident_id, IncidentState.FAILED, reason=reason)
            needs_human(
                incident_id,
                failed.job_id,
                NeedsHuman.FAILED,
                f"{reason}; fix the cause, then `sdcguard incident retry {incident_id}`",
            )
        raise IncidentFailed(incident_id, reason, publish_report(incident_id)) from err
    return publish_report(incident_id)


RESUMED = "training resumed from a verified checkpoint"


def fix_and_resume(
    incident_id: str,
    policy: IncidentPolicy,
    decision: Decision,
    run: Callable[[StageTask], dict[str, Any]],
) -> str | None:
    """Steps 7-9 — the only stages that wait for other incidents: one fleet change at a time.

    First, inside the slot, the storm guard runs again with the alarms known now: an automatic
    approval it trips is withdrawn (None: nothing was done, a human must decide). Otherwise
    the reason the incident resolves with.
    """
    with destructive_slot(incident_id):
        if withdraw_automatic(incident_id, policy, decision):
            return None
        fixed = run(fix_nodes)
        run(quarantine_suspect_checkpoints)
        if fixed.get("isolated"):
            handed = run(hand_over)
            return f"handed to a human: {handed['outcome']}"
        run(resume_training)
        if current_backends().remediator().releases_on_resolve:
            run(release_remediations)  # e.g. NVSentinel's ExternalFault
    return RESUMED


def _run_name() -> str:
    from prefect.runtime import flow_run

    return f"prefect flow run {flow_run.name or flow_run.id or 'unknown'}"


def publish_report(incident_id: str) -> dict[str, Any]:
    """Publish the incident report artifact and return the summary for the report JSON."""
    incident = current_backends().ledger.get_incident(incident_id)
    create_markdown_artifact(
        markdown=report_markdown(incident),
        key=artifact_key(incident_id, "report"),
        description=f"Incident {incident_id}: {incident.state.value}",
    )
    return incident_summary(incident)


def respond(incident_id: str, policy: IncidentPolicy | None = None) -> dict[str, Any]:
    """Run the flow in this process and return the ledger's summary, whatever the outcome.

    For callers that need the summary even when the Prefect run ends failed — an ``expired``
    incident (Prefect fails a pause that times out) or a ``failed`` one: the demo and the
    webhook's local trigger.
    """
    state = incident_response(incident_id, policy or IncidentPolicy(), return_state=True)
    log.info("incident flow ended %s", state.type.value, extra={"incident": incident_id})
    return incident_summary(current_backends().ledger.get_incident(incident_id))
