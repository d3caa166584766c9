"""Diagnosis: telemetry of each suspect, then the rerun that gives the verdict.

Both stages only add evidence to the incident; neither touches a node or the job.
"""

from __future__ import annotations

from typing import Any

from db import IncidentState, Verdict
from flows.incident.policy import IncidentPolicy
from flows.incident.stages._common import Stage, StageOutcome, stage
from flows.incident.stages._incident import advance, implicated_nodes, with_evidence
from flows.incident.stages.resume import choose_checkpoint
from flows.incident.wiring import current_backends
from recovery.diagnosis.rerun import RerunRequest
from recovery.diagnosis.verdict import diagnose
from recovery.errors import PermanentError

__all__ = ["collect_telemetry", "diagnostic_rerun"]


@stage(Stage.TELEMETRY)
def collect_telemetry(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """DCGM counters, dcgmi diag, Xid events and nvidia-smi of each suspect, as evidence.

    Telemetry is evidence *against* a node, never for it: SDC leaves all of it green.
    """
    b = current_backends()
    incident = advance(b, incident_id, IncidentState.DIAGNOSING, reason="collecting evidence")
    snapshots: dict[str, Any] = {}
    for node in implicated_nodes(incident):
        try:
            snapshots[node] = b.telemetry.collect(node).to_dict()
        except PermanentError as err:
            snapshots[node] = {"error": str(err)}
    b.ledger.transition(
        incident_id,
        incident.state,
        evidence=with_evidence(b.ledger.get_incident(incident_id), telemetry=snapshots),
    )
    summary = "; ".join(
        f"{node}: {snap.get('health', 'not collected')}" for node, snap in snapshots.items()
    )
    return {"outcome": summary or "no suspect node", "nodes": sorted(snapshots)}


@stage(Stage.REPLAY)
def diagnostic_rerun(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Recompute the suspect steps on the suspects and on spares: does the mismatch follow a
    node (hardware), every node (software), or none (inconclusive)?

    A rerun that cannot run is no evidence against anyone: it ends ``inconclusive`` with the
    reason, and a human decides.
    """
    b = current_backends()
    incident = advance(b, incident_id, IncidentState.DIAGNOSING)
    suspects = implicated_nodes(incident)
    spares = b.directory.spares(suspects)[: policy.spare_nodes]
    rerun: dict[str, Any] = {"spares": spares, "end": incident.suspect_end}
    try:
        plan = b.catalog.rerun_plan(incident.job_id)
        checkpoint, _ = choose_checkpoint(b, incident)
        if checkpoint is None:
            raise PermanentError(
                "replay",
                "plan",
                f"job/{incident.job_id}",
                f"no verified checkpoint before step {incident.suspect_start} to rerun from",
            )
        rerun["checkpoint_step"] = checkpoint.step
        base = RerunRequest(
            job_id=incident.job_id,
            checkpoint_uri=checkpoint.uri,
            checkpoint_step=checkpoint.step,
            end=incident.suspect_end,
            node=spares[0] if spares else "",
            spec=plan.spec,
        )
        alarm_step = min((a.step for a in incident.alarms), default=None)
        verdict = diagnose(
            b.rerunner, base, suspects, spares, reference=plan.reference, alarm_step=alarm_step
        ).to_dict()
    except PermanentError as err:
        verdict = {
            "verdict": Verdict.INCONCLUSIVE.value,
            "node": None,
            "first_step": None,
            "submodule": None,
            "op_kind": None,
            "reason": f"no rerun evidence: {err}",
            "detail": {},
        }
    b.ledger.transition(
        incident_id,
        b.ledger.get_incident(incident_id).state,
        verdict=Verdict(verdict["verdict"]),
        # "replay" is the evidence key incidents have always been recorded under
        evidence=with_evidence(b.ledger.get_incident(incident_id), verdict=verdict, replay=rerun),
    )
    return {
        "outcome": f"{verdict['verdict']}: {verdict['reason']}",
        "verdict": verdict["verdict"],
        "node": verdict["node"],
    }
