"""The incident report: a summary dict for the demo's report JSON and a markdown artifact.

Both are derived from the ledger alone — never from Prefect state — so a re-run, a replay of a
recorded incident and ``sdcguard incident ID`` tell the same story. Each stage of the flow is a
ledger action of kind ``stage`` whose target is the stage's name (idempotency key
``<incident>:stage:<name>``) and whose detail holds the stage's outcome; the report reads those
rows back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from db import STAGE_KIND, IncidentState
from db.evidence import APPROVAL
from db.views import ActionView, IncidentView

__all__ = [
    "incident_renderables",
    "incident_summary",
    "incidents_table",
    "report_markdown",
    "stage_actions",
]


def stage_actions(incident: IncidentView) -> list[ActionView]:
    """The stage rows of an incident, in the order the flow first reached them."""
    return [a for a in incident.actions if a.kind == STAGE_KIND]


def _stage_outcome(incident: IncidentView, name: str) -> Mapping[str, Any]:
    for action in stage_actions(incident):
        if action.target == name and action.detail:
            return action.detail
    return {}


def answered_as(approval: Mapping[str, Any]) -> str:
    """How far the approver is known: ``claimed; authenticated as X (source)`` or
    ``claimed; unauthenticated`` — a typed name is never shown as an identity."""
    who = approval.get("approver_authenticated")
    source = approval.get("identity_source") or "unauthenticated"
    if who:
        return f"claimed; authenticated as {who} via {source}"
    return f"claimed; {source}" if source != "policy" else "the policy"


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None


# A stage's status in the report speaks Prefect's language (DESIGN: name, status, start, end);
# the ledger's action statuses say the same thing about the stage's claim.
_STAGE_STATUS = {"claimed": "running", "succeeded": "completed", "failed": "failed"}


def incident_summary(incident: IncidentView) -> dict[str, Any]:
    """What the demo puts in its report JSON (DESIGN, ``sdcguard demo --report``)."""
    replace = _stage_outcome(incident, "replace")
    resume = _stage_outcome(incident, "resume")
    approval: dict[str, Any] | None = None
    if incident.decision is not None:
        recorded = (incident.evidence or {}).get(APPROVAL) or {}
        approval = {
            "decision": incident.decision,
            "approver": incident.approver,
            "reason": incident.approval_reason,
            "at": _iso(incident.decided_at),
            # the approver name is what the form said; who was authenticated is separate
            "approver_authenticated": recorded.get("approver_authenticated"),
            "identity_source": recorded.get(
                "identity_source", "unauthenticated" if incident.approver else None
            ),
        }
    return {
        "incident_id": incident.id,
        "job_id": incident.job_id,
        "state": incident.state.value,
        "reason": incident.reason,
        "suspect_range": [incident.suspect_start, incident.suspect_end],
        "suspect_nodes": list(incident.suspect_nodes),
        "verdict": incident.verdict.value if incident.verdict is not None else None,
        "storm": {"tripped": incident.storm, "reason": incident.storm_reason},
        "approval": approval,
        "replaced": list(replace.get("replaced", [])),
        "rebooted": list(replace.get("rebooted", [])),
        "remediation": replace.get("remediation"),
        "restored": list(replace.get("restored", [])),
        "isolated": list(replace.get("isolated", [])),
        "resumed_from_step": resume.get("checkpoint_step"),
        "resumed_checkpoint": resume.get("checkpoint_uri"),
        "resumed_nodes": resume.get("nodes"),
        "corrupt_checkpoints": list(resume.get("corrupt", [])),
        "stages": [
            {
                "name": a.target,
                "status": _STAGE_STATUS[a.status.value],
                "start": _iso(a.started_at),
                "end": _iso(a.finished_at),
                "outcome": (a.detail or {}).get("outcome"),
            }
            for a in stage_actions(incident)
        ],
    }


def report_markdown(incident: IncidentView) -> str:
    """The incident report an operator reads after the fact: timeline, evidence, decision."""
    summary = incident_summary(incident)
    start, end = summary["suspect_range"]
    lines = [
        f"# Incident {incident.id}: {incident.state.value}",
        "",
        f"**Job** `{incident.job_id}` · **suspect steps** {start}..{end} · **suspect nodes** "
        + (", ".join(f"`{n}`" for n in incident.suspect_nodes) or "none named")
        + f" · **alarms** {len(incident.alarms)}",
    ]
    if incident.reason:
        lines += ["", f"**Reason:** {incident.reason}"]
    lines += ["", "## Timeline", "", "| stage | status | start | duration | outcome |"]
    lines.append("|---|---|---|---|---|")
    for action in stage_actions(incident):
        duration = (
            f"{(action.finished_at - action.started_at).total_seconds():.1f} s"
            if action.finished_at is not None
            else "—"
        )
        outcome = str((action.detail or {}).get("outcome", "")).replace("|", "/")
        lines.append(
            f"| {action.target} | {action.status.value} | "
            f"{action.started_at:%H:%M:%S} | {duration} | {outcome} |"
        )
    side_effects = [a for a in incident.actions if a.kind != STAGE_KIND]
    if side_effects:
        lines += [
            "",
            "## Actions",
            "",
            "| action | target | status | attempts |",
            "|---|---|---|---|",
        ]
        for action in side_effects:
            lines.append(
                f"| {action.kind} | `{action.target}` | {action.status.value} | {action.attempts} |"
            )
    verdict = (incident.evidence or {}).get("verdict") or {}
    telemetry_nodes = ", ".join(sorted((incident.evidence or {}).get("telemetry", {}))) or "none"
    lines += [
        "",
        "## Evidence",
        f"- Verdict: **{summary['verdict'] or 'none'}**"
        + (f" — {verdict.get('reason')}" if verdict.get("reason") else ""),
        f"- Storm guard: {'tripped' if incident.storm else 'clear'}"
        + (f" — {incident.storm_reason}" if incident.storm_reason else ""),
        f"- Telemetry from: {telemetry_nodes}",
        "",
        "## Decision",
    ]
    approval = summary["approval"]
    if approval:
        lines.append(
            f"**{approval['decision']}** by {approval['approver']} ({answered_as(approval)}): "
            f"{approval['reason'] or ''}"
        )
    else:
        lines.append("No decision recorded.")
    lines += ["", "## Recovery"]
    for item in summary["replaced"]:
        lines.append(
            f"- Replaced `{item.get('node')}` ({item.get('instance_id')}) by "
            f"`{item.get('new_node')}` ({item.get('new_instance_id')})"
        )
    for item in summary["rebooted"]:
        lines.append(f"- Rebooted `{item.get('node')}` ({item.get('instance_id')})")
    for node in summary["restored"]:
        lines.append(f"- Remediated `{node}` in place ({summary['remediation']})")
    for node in summary["isolated"]:
        lines.append(f"- Isolated `{node}` for investigation; handed to a human, not resumed")
    for item in summary["corrupt_checkpoints"]:
        lines.append(f"- Checkpoint at step {item.get('step')} failed its sha256: marked corrupt")
    if summary["resumed_from_step"] is not None:
        rolled_back = end - int(summary["resumed_from_step"])
        lines.append(
            f"- Resumed from the verified checkpoint at step {summary['resumed_from_step']} "
            f"(`{summary['resumed_checkpoint']}`): {rolled_back} step(s) rolled back"
        )
    else:
        lines.append("- Training not resumed.")
    return "\n".join(lines)


WIDE_LIST = 132
"""Terminal width from which ``sdcguard incidents`` shows verdict, decision and opening time."""


def incidents_table(incidents: Sequence[IncidentView], width: int | None = None) -> Table:
    """``sdcguard incidents``: one row per incident, newest first.

    ``width`` is the terminal's (80 when piped): below :data:`WIDE_LIST` only the id, job,
    state, suspect steps and nodes are shown, so none of them is squeezed to nothing. The id,
    state and steps never wrap (ids are copied from here); job and node names fold.
    """
    wide = width is None or width >= WIDE_LIST
    table = Table(
        title="Incidents",
        header_style="bold",
        caption=None if incidents else "no incidents",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("incident", no_wrap=True, min_width=36)
    table.add_column("job", overflow="fold", min_width=8)
    table.add_column("state", no_wrap=True, min_width=8)
    table.add_column("steps", no_wrap=True, min_width=5)
    table.add_column("nodes", overflow="fold", min_width=6)
    if wide:
        table.add_column("verdict", no_wrap=True)
        table.add_column("decision", no_wrap=True)
        table.add_column("opened", no_wrap=True)
    for incident in incidents:
        row: list[str | Text] = [
            incident.id,
            incident.job_id,
            _state_text(incident),
            f"{incident.suspect_start}..{incident.suspect_end}",
            ", ".join(incident.suspect_nodes) or "—",
        ]
        if wide:
            row += [
                incident.verdict.value if incident.verdict is not None else "—",
                incident.decision or "—",
                f"{incident.opened_at:%Y-%m-%d %H:%M:%S}",
            ]
        table.add_row(*row)
    return table


def incident_renderables(incident: IncidentView) -> list[RenderableType]:
    """``sdcguard incident ID``: the incident, its stages, its actions and its alarms."""
    summary = incident_summary(incident)
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
    approval = summary["approval"] or {}
    for name, value in (
        ("incident", incident.id),
        ("job", incident.job_id),
        ("state", _state_text(incident)),
        ("reason", incident.reason or "—"),
        ("suspect steps", f"{incident.suspect_start}..{incident.suspect_end}"),
        ("suspect nodes", ", ".join(incident.suspect_nodes) or "—"),
        ("verdict", summary["verdict"] or "—"),
        ("storm", incident.storm_reason if incident.storm else "no"),
        (
            "decision",
            f"{approval.get('decision')} by {approval.get('approver')} "
            f"({answered_as(approval)}): {approval.get('reason')}"
            if approval
            else "—",
        ),
        (
            "replaced",
            ", ".join(f"{r['node']} → {r['new_node']}" for r in summary["replaced"]) or "—",
        ),
        ("resumed from step", str(summary["resumed_from_step"] or "—")),
    ):
        facts.add_row(name, str(value))
    stages = Table(title="Stages", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("stage", "status", "start", "end"):
        stages.add_column(column, no_wrap=True)
    stages.add_column("outcome", overflow="fold", ratio=1)
    for action in stage_actions(incident):
        stages.add_row(
            action.target,
            action.status.value,
            f"{action.started_at:%H:%M:%S}",
            f"{action.finished_at:%H:%M:%S}" if action.finished_at else "—",
            str((action.detail or {}).get("outcome", "")),
        )
    actions = Table(title="Actions", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    actions.add_column("action", no_wrap=True)
    actions.add_column("target", overflow="fold", min_width=8)
    for column in ("status", "attempts"):
        actions.add_column(column, no_wrap=True)
    for action in incident.actions:
        if action.kind != STAGE_KIND:
            actions.add_row(action.kind, action.target, action.status.value, str(action.attempts))
    alarms = Table(title="Alarms", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("step", "layer", "phase"):
        alarms.add_column(column, no_wrap=True)
    alarms.add_column("suspect nodes", overflow="fold", min_width=6)
    alarms.add_column("received", no_wrap=True)
    for alarm in incident.alarms:
        alarms.add_row(
            str(alarm.step),
            alarm.layer,
            alarm.phase,
            ", ".join(alarm.suspect_nodes),
            f"{alarm.received_at:%H:%M:%S}",
        )
    return [facts, stages, actions, alarms]


def _state_text(incident: IncidentView) -> Text:
    style = {
        IncidentState.RESOLVED: "green",
        IncidentState.FAILED: "red",
        IncidentState.EXPIRED: "yellow",
        IncidentState.REJECTED: "yellow",
    }.get(incident.state, "cyan")
    return Text(incident.state.value, style=style)
