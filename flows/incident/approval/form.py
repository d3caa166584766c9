"""Approval in the Prefect UI: the form an approver fills in, and the evidence shown beside it.

The flow waits with ``wait_for_input=ApprovalDecision``; Prefect renders the model as a form
on the paused run ("Resume" in the UI) and hands the filled-in model back to the flow.

How it waits depends on where it runs. A run of a deployment *suspends*
(:func:`prefect.flow_runs.suspend_flow_run`): the process exits, the worker's infrastructure is
released, and nothing is held across the wait — no process, no concurrency lease — so the wait
survives a worker restart and a Prefect server restart. Answering the form reschedules the run;
the worker starts it again, the flow is re-entered from the top (the ledger skips every stage
already done), and the second call with the same pause key returns the answer. A run without a
deployment (the demo, tests in one process) cannot suspend; it pauses in-process instead. The
evidence an approver needs — verdict, rerun mismatches, telemetry, suspect nodes, steps to roll
back — is both the form's description and a markdown artifact on the run, so it stays readable
after the decision.

Invariants: the form has no default decision (an approver must choose), names the approver and
a reason (both land in the ledger; the name as a *claim*, beside the identity an authenticating
proxy vouched for, if any: :mod:`flows.incident.approval.identity`), and a wait past its deadline
returns ``None`` — the caller
turns that into ``expired``, never into an approval. The deadline is fixed once, by the
caller, and kept in the ledger: a re-entered or retried run never restarts the clock.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.context import FlowRunContext
from prefect.exceptions import FlowPauseTimeout, NotPausedError
from prefect.flow_runs import pause_flow_run, resume_flow_run, suspend_flow_run
from prefect.input import RunInput
from pydantic import Field

from flows.incident.approval.identity import ApproverIdentity, resolve_identity
from flows.incident.policy import IncidentPolicy, StormCheck
from flows.settings import ApprovalIdentitySettings

__all__ = [
    "APPROVAL_PAUSE_KEY",
    "ApprovalChoice",
    "ApprovalDecision",
    "Evidence",
    "answered_by",
    "artifact_key",
    "ask_for_approval",
    "evidence_markdown",
    "flow_run_name",
    "submit_decision",
]

log = logging.getLogger(__name__)

APPROVAL_PAUSE_KEY = "approval"


class ApprovalChoice(StrEnum):
    """What the approver decided."""

    APPROVE = "approve"
    """Go ahead: replace (or reboot) the faulty node and resume training."""
    REJECT = "reject"
    """Do not touch the node; the incident ends ``rejected``."""


class ApprovalDecision(RunInput):
    """The approval form on the paused incident run."""

    decision: ApprovalChoice = Field(
        title="Decision",
        description="approve: replace or reboot the node and resume; reject: leave it alone.",
    )
    approver: str = Field(
        min_length=1,
        max_length=200,
        description="Who decides (name or e-mail); recorded in the ledger.",
    )
    reason: str = Field(
        min_length=1,
        max_length=2000,
        description="Why; recorded in the ledger next to the decision.",
    )
    uncordon_on_reject: bool = Field(
        default=False,
        description="On reject, uncordon the suspect nodes (only what this incident cordoned).",
    )
    nodes: list[str] = Field(
        default_factory=list,
        description=(
            "On approve, the nodes to replace: the form starts with every node the evidence "
            "names; remove those you do not approve. Empty approves all of them."
        ),
    )
    identity: str = Field(
        default="",
        max_length=4096,
        description=(
            "Leave empty: filled in by the sdcguard identity gate in front of the Prefect API "
            "from the signed-in user. Anything else here is recorded as unverified."
        ),
    )


def answered_by(decision: ApprovalDecision) -> ApproverIdentity:
    """Who answered ``decision``: the claimed name, and the identity the gate signed for this
    flow run if it verifies under ``SDCGUARD_APPROVAL_IDENTITY_SECRET``; else unauthenticated."""
    context = FlowRunContext.get()
    run_id = str(context.flow_run.id) if context and context.flow_run else None
    secret = ApprovalIdentitySettings().secret
    return resolve_identity(
        decision.approver,
        decision.identity or None,
        run_id,
        None if secret is None else secret.get_secret_value(),
    )


@dataclass(frozen=True)
class Evidence:
    """Everything the approver sees, gathered from the ledger by the flow."""

    incident_id: str
    job_id: str
    suspect_nodes: Sequence[str]
    suspect_range: tuple[int, int]
    verdict: Mapping[str, Any] | None
    telemetry: Mapping[str, Any]
    storm: StormCheck
    auto_approval: str
    rollback_checkpoint_step: int | None
    alarm_count: int
    nodes_to_fix: Sequence[str]
    action: str
    """``replace`` or ``reboot``: what approving does to ``nodes_to_fix``."""
    remediation: str
    """Which backend acts (``hyperpod``, ``kubernetes``, ``nvsentinel``, ``isolate``)."""
    remediation_effect: str
    """What that backend does to the node, in one sentence (``Remediation.describe``)."""


def artifact_key(incident_id: str, what: str) -> str:
    """Artifact keys allow only lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", f"incident-{incident_id}-{what}".lower())
    return re.sub(r"-{2,}", "-", slug).strip("-")


def evidence_markdown(evidence: Evidence) -> str:
    """The evidence as markdown: short enough to read before deciding, complete enough to act."""
    start, end = evidence.suspect_range
    lines = [
        f"# Incident {evidence.incident_id} — approval needed",
        "",
    ]
    if not evidence.suspect_nodes:
        lines += [
            "**Culprit unknown**: no alarm names a suspect node (replicas that disagree cannot "
            "say which one is wrong). Nothing was cordoned. Approving replaces nothing and "
            "resumes training; reject to keep it stopped while you investigate.",
            "",
        ]
    lines += [
        f"**Job** `{evidence.job_id}` · **suspect nodes** "
        + (", ".join(f"`{n}`" for n in evidence.suspect_nodes) or "none named")
        + f" · **suspect steps** {start}..{end} · **alarms** {evidence.alarm_count}",
        "",
        "## Verdict",
    ]
    verdict = evidence.verdict or {}
    if verdict:
        lines += [
            f"**{verdict.get('verdict', 'unknown')}**"
            + (f" on `{verdict['node']}`" if verdict.get("node") else "")
            + (
                f", first differing step {verdict['first_step']}"
                if verdict.get("first_step") is not None
                else ""
            ),
            "",
            str(verdict.get("reason") or ""),
        ]
        if verdict.get("submodule"):
            lines.append(
                f"First differing submodule: `{verdict['submodule']}` ({verdict.get('op_kind')})"
            )
        reruns = (verdict.get("detail") or {}).get("replays") or {}
        if reruns:
            lines += ["", "| rerun on | steps | final weight fingerprint |", "|---|---|---|"]
            for node, summary in sorted(reruns.items()):
                lines.append(
                    f"| `{node}` | {summary.get('steps')} | "
                    f"`{summary.get('final_weight_fingerprint')}` |"
                )
    else:
        lines.append("No rerun verdict.")
    lines += ["", "## Telemetry"]
    if evidence.telemetry:
        lines += ["| node | summary |", "|---|---|"]
        for node, snap in sorted(evidence.telemetry.items()):
            lines.append(f"| `{node}` | {_telemetry_summary(snap)} |")
    else:
        lines.append("No telemetry collected.")
    rollback = (
        f"resume from the newest verified checkpoint before step {start} "
        f"(currently step {evidence.rollback_checkpoint_step}): steps "
        f"{evidence.rollback_checkpoint_step + 1}..{end} are recomputed"
        if evidence.rollback_checkpoint_step is not None
        else f"no verified checkpoint before step {start}: resuming will fail"
    )
    lines += [
        "",
        "## Roll-back",
        f"Checkpoints in steps {start}..{end} are quarantined; {rollback}.",
        "",
        "## What approving does",
        f"**Remediation backend: `{evidence.remediation}`.** {evidence.action.capitalize()} "
        + (", ".join(f"`{n}`" for n in evidence.nodes_to_fix) or "no node")
        + f": {evidence.remediation_effect}.",
        "",
        "## Guards",
        f"- Storm guard: {evidence.storm.reason}",
        f"- Auto-approval: {evidence.auto_approval}",
        "",
        "Approve to let the remediation above act on the node; reject to leave it. "
        "No answer before the timeout expires the incident: the node stays cordoned.",
    ]
    return "\n".join(lines)


def _telemetry_summary(snapshot: Any) -> str:
    """One cell per node: the snapshot's health and its reasons, or the collection error."""
    if not isinstance(snapshot, Mapping):
        return str(snapshot)
    if "error" in snapshot:
        return f"not collected: {snapshot['error']}".replace("|", "/")
    reasons = snapshot.get("reasons") or []
    text = f"**{snapshot.get('health', 'unknown')}**"
    if reasons:
        text += ": " + "; ".join(str(r) for r in reasons)
    return text.replace("|", "/").replace("\n", " ")


def ask_for_approval(
    evidence: Evidence, policy: IncidentPolicy, *, poll_interval_s: int, deadline: datetime
) -> ApprovalDecision | None:
    """Publish the evidence, wait for the form until ``deadline``, and return the decision.

    Returns ``None`` when nobody answered in time. A run of a deployment suspends (raising
    Prefect's ``Pause`` signal, a ``BaseException``, out of this call: the process ends and the
    run is re-entered once answered); any other run pauses in-process, and Prefect's
    :class:`FlowPauseTimeout` is turned into ``None`` here, since the flow itself must go on to
    record ``expired`` in the ledger.
    """
    extra = {"incident": evidence.incident_id, "job": evidence.job_id, "stage": "approval"}
    left_s = int((deadline - datetime.now(UTC)).total_seconds())
    if left_s < 1:
        log.warning("no decision before the deadline %s", deadline.isoformat(), extra=extra)
        return None
    markdown = evidence_markdown(evidence)
    create_markdown_artifact(
        markdown=markdown,
        key=artifact_key(evidence.incident_id, "evidence"),
        description=f"Evidence for approving incident {evidence.incident_id}",
    )
    form = ApprovalDecision.with_initial_data(
        description=markdown,
        uncordon_on_reject=policy.uncordon_on_reject,
        nodes=list(evidence.nodes_to_fix),
    )
    if _in_deployment():
        log.info("suspending for approval until %s", deadline.isoformat(), extra=extra)
        decision = suspend_flow_run(wait_for_input=form, timeout=left_s, key=APPROVAL_PAUSE_KEY)
    else:
        log.info("waiting up to %d s for approval", left_s, extra=extra)
        try:
            decision = pause_flow_run(
                wait_for_input=form,
                timeout=left_s,
                poll_interval=max(1, min(poll_interval_s, left_s)),
                key=APPROVAL_PAUSE_KEY,
            )
        except FlowPauseTimeout:
            log.warning("no decision within %d s", left_s, extra=extra)
            return None
    log.info("decision %s by %s", decision.decision.value, decision.approver, extra=extra)
    return decision


def _in_deployment() -> bool:
    """Whether this flow run belongs to a deployment (only those can suspend)."""
    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.deployment_id)


def flow_run_name(incident_id: str) -> str:
    """The name of an incident's flow runs (``flow_run_name`` of the flow)."""
    return f"incident-{incident_id}"


def submit_decision(
    incident_id: str,
    decision: ApprovalDecision,
    *,
    timeout_s: float = 300.0,
    poll_s: float = 0.5,
) -> str:
    """Answer the approval form of the incident's paused flow run, exactly as the UI does.

    The UI's "Resume" button posts the filled-in form as ``run_input`` to the flow run's
    resume endpoint; so does this, through the Prefect API at ``PREFECT_API_URL``. Blocks until
    a run of the incident is paused and accepts the answer; returns the flow run id. The form's
    schema is saved just after the run pauses, so a resume refused in that instant is retried.
    """
    name = flow_run_name(incident_id)
    deadline = time.monotonic() + timeout_s
    run_input = decision.model_dump(mode="json")
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
            )
            for run in runs:
                if run.state is not None and run.state.is_paused():
                    try:
                        resume_flow_run(run.id, run_input=run_input)
                    except (RuntimeError, NotPausedError) as err:
                        extra = {"incident": incident_id, "stage": "approval"}
                        log.info("resume refused, retrying: %s", err, extra=extra)
                        break
                    log.info(
                        "decision %s by %s submitted",
                        decision.decision.value,
                        decision.approver,
                        extra={"incident": incident_id, "stage": "approval"},
                    )
                    return str(run.id)
            time.sleep(poll_s)
    raise TimeoutError(f"no paused flow run {name} within {timeout_s:g} s")
