"""The stages of the incident flow: Prefect tasks whose record of truth is the ledger.

Two rules make the flow safe to retry and to re-run after a crash at any point:

1. **Every stage is a ledger action** of kind ``stage`` with the stage's name as target (key
   ``<incident>:stage:<name>``), claimed when the stage starts and finished with its outcome.
   A re-run skips a succeeded stage and returns the outcome it recorded; a stage left
   ``claimed`` by a crashed run is continued. Prefect's own state is not consulted: a flow
   retry re-runs finished tasks, and pause keys are cleared on retry.
2. **Every side effect is its own ledger action** (key ``<incident>:<kind>:<target>``,
   :func:`perform`), claimed before the call. Succeeded actions are never performed again. An
   action left ``claimed`` (the process died between the call and the record) or ``failed``
   (an earlier attempt raised, perhaps after the outside system acted) is performed with
   ``first=False``: the action looks at the outside system before acting again, and the
   outside calls themselves are idempotent (``recovery.jobs``, ``recovery.nodes``) or refuse a
   repeat (``HyperPod.replace`` raises ``AlreadyReplacing``).

Retries: a task is retried (policy ``task_retries``, exponential backoff) only for a
:class:`recovery.errors.TemporaryError` or a :class:`db.LedgerTemporaryError`; anything else
fails the stage at once, and the flow records the incident ``failed`` with the reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from db import (
    ActionStatus,
    CheckpointStatus,
    CheckpointView,
    IncidentState,
    IncidentView,
    LedgerTemporaryError,
    Verdict,
    can_transition,
)
from flows.approval import ApprovalChoice, Evidence, ask_for_approval
from flows.policy import (
    AlarmEvidence,
    IncidentPolicy,
    NodeAction,
    StormCheck,
    auto_approval,
    storm_guard,
)
from flows.report import STAGE_KIND
from flows.wiring import Backends, current_backends
from recovery.errors import NotFoundError, PermanentError, TemporaryError
from recovery.hyperpod import INSTANCE_ID_LABEL, AlreadyReplacing, NodeStatus
from recovery.nodes import ANNOTATION_CORDONED_BY, TAINT_KEY
from recovery.replay import ReplayRequest, diagnose

__all__ = [
    "AUTO_APPROVER",
    "Action",
    "Decision",
    "Stage",
    "StageTask",
    "choose_checkpoint",
    "close",
    "collect_telemetry",
    "cordon_suspects",
    "diagnostic_replay",
    "fix_nodes",
    "implicated_nodes",
    "nodes_to_fix",
    "perform",
    "quarantine_suspect_checkpoints",
    "record_stage",
    "release_nodes",
    "resume_training",
    "retry_on_temporary",
    "seek_approval",
    "stop_training",
    "triage",
]

log = logging.getLogger(__name__)

AUTO_APPROVER = "policy:auto-approve"

StageOutcome = dict[str, Any]
StageTask = Task[[str, IncidentPolicy], StageOutcome]


class Stage(StrEnum):
    """The runbook's stages, in the order the flow reaches them."""

    TRIAGE = "triage"
    STOP = "stop"
    CORDON = "cordon"
    TELEMETRY = "telemetry"
    REPLAY = "replay"
    APPROVAL = "approval"
    REPLACE = "replace"
    QUARANTINE = "quarantine"
    RESUME = "resume"
    RELEASE = "release"


class Action(StrEnum):
    """Side effects on outside systems; each is a ledger action of this kind per target."""

    STOP_JOB = "stop-job"
    CORDON = "cordon"
    TAINT = "taint"
    UNCORDON = "uncordon"
    REPLACE = "replace"
    REBOOT = "reboot"
    RESUME = "resume"


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


# -- recording ---------------------------------------------------------------------------


def retry_on_temporary(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect retry condition: retry only what the same call may get right later."""
    try:
        state.result()
    except (TemporaryError, LedgerTemporaryError):
        return True
    except Exception:
        return False
    return False


def _extra(incident_id: str, stage: Stage | str, **more: Any) -> dict[str, Any]:
    return {"incident": incident_id, "stage": str(stage), **more}


def record_stage(stage: Stage, incident_id: str, body: Callable[[], StageOutcome]) -> StageOutcome:
    """Run ``body`` as the ledger action ``<incident>:stage:<stage>``; skip it once succeeded."""
    ledger = current_backends().ledger
    claim = ledger.claim_action(incident_id, STAGE_KIND, stage.value)
    extra = _extra(incident_id, stage)
    if not claim.won and claim.action.status is ActionStatus.SUCCEEDED:
        log.info("stage %s already done; not repeated", stage, extra=extra)
        return dict(claim.action.detail or {})
    if not claim.won:
        log.warning("stage %s was interrupted in an earlier run; continuing", stage, extra=extra)
    log.info("stage %s started", stage, extra=extra)
    try:
        outcome = body()
    except Exception as err:
        ledger.finish_action(
            claim.action.key,
            ActionStatus.FAILED,
            {"outcome": f"failed: {err}", "error": f"{type(err).__name__}: {err}"},
        )
        log.error("stage %s failed: %s", stage, err, extra=extra)
        raise
    ledger.finish_action(claim.action.key, ActionStatus.SUCCEEDED, {**outcome, "error": None})
    log.info("stage %s done: %s", stage, outcome.get("outcome"), extra=extra)
    return outcome


def perform(
    incident_id: str,
    kind: Action,
    target: str,
    act: Callable[[bool], dict[str, Any]],
    *,
    detail: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Do one side effect at most once per incident; return what it recorded.

    ``act(first)`` performs it; ``first`` is False when an earlier attempt was claimed and may
    have reached the outside system, so ``act`` must look before it acts again. ``detail`` is
    stored with the claim — *before* the call — so a later run knows what was about to happen.
    """
    ledger = current_backends().ledger
    claim = ledger.claim_action(incident_id, kind.value, target, detail)
    action = claim.action
    on_job = kind in (Action.STOP_JOB, Action.RESUME)
    extra = _extra(incident_id, kind.value, **{"job" if on_job else "node": target})
    if not claim.won and action.status is ActionStatus.SUCCEEDED:
        log.info("%s %s already done; not repeated", kind, target, extra=extra)
        return dict(action.detail or {})
    first = claim.won and action.attempts == 1
    if not first:
        log.warning(
            "%s %s: an earlier attempt may have acted; checking first", kind, target, extra=extra
        )
    try:
        result = act(first)
    except Exception as err:
        ledger.finish_action(action.key, ActionStatus.FAILED, {"error": f"{err}"})
        raise
    ledger.finish_action(action.key, ActionStatus.SUCCEEDED, {**result, "error": None})
    log.info("%s %s done", kind, target, extra=extra)
    return {**(action.detail or {}), **result}


def stage(name: Stage) -> Callable[[Callable[[str, IncidentPolicy], StageOutcome]], StageTask]:
    """Make ``fn(incident_id, policy)`` a Prefect task recorded as the ledger stage ``name``.

    No Prefect caching (the ledger decides what is done) and no persisted results; retries are
    set per run from the policy (:func:`flows.incident.incident_response`).
    """

    def wrap(fn: Callable[[str, IncidentPolicy], StageOutcome]) -> StageTask:
        @functools.wraps(fn)
        def run(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
            return record_stage(name, incident_id, lambda: fn(incident_id, policy))

        decorate = task(
            name=name.value,
            task_run_name=f"{name.value}-{{incident_id}}",
            cache_policy=NO_CACHE,
            persist_result=False,
            retry_condition_fn=retry_on_temporary,
        )
        return decorate(run)

    return wrap


# -- ledger helpers ----------------------------------------------------------------------


def _advance(
    backends: Backends, incident_id: str, to: IncidentState, **fields: Any
) -> IncidentView:
    """Move forward to ``to`` — or stay where a re-run finds the incident already is."""
    current = backends.ledger.get_incident(incident_id)
    target = to if can_transition(current.state, to) else current.state
    given = {k: v for k, v in fields.items() if v is not None}
    if target == current.state and not {k: v for k, v in given.items() if k != "reason"}:
        return current
    return backends.ledger.transition(incident_id, target, **given)


def _with_evidence(incident: IncidentView, **items: Any) -> dict[str, Any]:
    return {**(incident.evidence or {}), **items}


def implicated_nodes(incident: IncidentView) -> list[str]:
    """Every node the incident or its alarms name."""
    names = set(incident.suspect_nodes)
    for alarm in incident.alarms:
        names.update(alarm.suspect_nodes)
    return sorted(names)


def _verdict(incident: IncidentView) -> dict[str, Any]:
    return dict((incident.evidence or {}).get("verdict") or {})


def nodes_to_fix(incident: IncidentView) -> list[str]:
    """The node a hardware verdict names; otherwise every suspect (a human approved that)."""
    verdict = _verdict(incident)
    if verdict.get("verdict") == Verdict.HARDWARE.value and verdict.get("node"):
        return [str(verdict["node"])]
    return implicated_nodes(incident)


def choose_checkpoint(
    backends: Backends, incident: IncidentView
) -> tuple[CheckpointView | None, list[dict[str, Any]]]:
    """The newest verified checkpoint strictly before the suspect range whose bytes in storage
    still match its sha256; every newer one that does not is marked corrupt on the way."""
    corrupt: list[dict[str, Any]] = []
    for candidate in backends.ledger.resume_candidates(incident.job_id, incident.suspect_start):
        try:
            intact = backends.checkpoints.verify(candidate.uri, candidate.sha256)
            why = "sha256 in storage does not match the ledger"
        except NotFoundError as err:
            intact, why = False, f"missing in storage ({err})"
        if intact:
            return candidate, corrupt
        reason = f"{why}; found by incident {incident.id}"
        backends.ledger.mark_checkpoint_corrupt(
            incident.job_id, candidate.step, reason, uri=candidate.uri
        )
        log.warning(
            "checkpoint at step %d is corrupt: %s",
            candidate.step,
            why,
            extra={"incident": incident.id, "job": incident.job_id, "step": candidate.step},
        )
        corrupt.append({"step": candidate.step, "uri": candidate.uri, "reason": why})
    return None, corrupt


# -- stages ------------------------------------------------------------------------------


@stage(Stage.TRIAGE)
def triage(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Storm guard: alarms on too many nodes at once look like software, not one bad GPU."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    now = datetime.now(UTC)
    since = now - timedelta(seconds=policy.storm_window_s)
    recent = [
        (node, alarm.received_at)
        for other in b.ledger.list_incidents()
        if other.updated_at >= since
        for alarm in other.alarms
        for node in alarm.suspect_nodes
    ]
    check = storm_guard(
        implicated=implicated_nodes(incident),
        job_nodes={r.node for r in b.ledger.rank_map(incident.job_id).values()},
        recent=recent,
        now=now,
        policy=policy,
    )
    evidence = _with_evidence(incident, storm=check.to_dict())
    if check.tripped:
        log.warning("%s", check.reason, extra=_extra(incident_id, Stage.TRIAGE))
        b.ledger.transition(
            incident_id, incident.state, storm=True, reason=check.reason, evidence=evidence
        )
    else:
        b.ledger.transition(incident_id, incident.state, evidence=evidence)
    return {"outcome": check.reason, "storm": check.tripped}


@stage(Stage.STOP)
def stop_training(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Stop the job, and with it checkpoint publication; quarantine what it wrote since the
    suspect range began (and anything still arriving later is quarantined again before resume)."""
    b = current_backends()
    incident = _advance(b, incident_id, IncidentState.STOPPING, reason="stopping training")
    job = b.catalog.ref(incident.job_id)

    def act(first: bool) -> dict[str, Any]:
        try:
            result = b.jobs.stop(job)
        except NotFoundError as err:
            # Nothing runs under that name here: the goal — no more training writes — holds.
            return {"stop": "not-found", "detail": str(err)}
        return {"stop": result.outcome.value, "detail": result.detail}

    stopped = perform(incident_id, Action.STOP_JOB, incident.job_id, act)
    quarantined = b.ledger.quarantine_range(incident.job_id, incident.suspect_start, None)
    return {
        "outcome": f"job {incident.job_id}: {stopped['stop']}; checkpoints from step "
        f"{incident.suspect_start} on quarantined: {quarantined or 'none new'}",
        "quarantined": quarantined,
    }


def _cordon(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    if not first and b.nodes.get(node).annotations.get(ANNOTATION_CORDONED_BY) == incident_id:
        return {"cordoned": True, "observed": True}
    return {"cordoned": b.nodes.cordon(node, incident_id)}


def _taint(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    if not first and any(
        t.key == TAINT_KEY and t.value == incident_id for t in b.nodes.get(node).taints
    ):
        return {"tainted": True, "observed": True}
    return {"tainted": b.nodes.taint(node, incident_id)}


@stage(Stage.CORDON)
def cordon_suspects(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Cordon and taint the suspect nodes, so nothing new lands on them while we diagnose."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    nodes = implicated_nodes(incident)
    if incident.storm and not policy.cordon_in_storm:
        return {
            "outcome": f"not cordoned during an alarm storm: {', '.join(nodes)} stay schedulable",
            "cordoned": [],
        }
    outcomes = {}
    for node in nodes:
        cordon = perform(
            incident_id, Action.CORDON, node, functools.partial(_cordon, b, incident_id, node)
        )
        perform(incident_id, Action.TAINT, node, functools.partial(_taint, b, incident_id, node))
        outcomes[node] = "cordoned" if cordon.get("cordoned") else "was already cordoned"
    _advance(b, incident_id, IncidentState.CORDONED, reason=f"cordoned {', '.join(nodes)}")
    return {
        "outcome": "; ".join(f"{n} {o}" for n, o in outcomes.items()),
        "cordoned": nodes,
    }


@stage(Stage.TELEMETRY)
def collect_telemetry(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """DCGM counters, dcgmi diag, Xid events and nvidia-smi of each suspect, as evidence.

    Telemetry is evidence *against* a node, never for it: SDC leaves all of it green.
    """
    b = current_backends()
    incident = _advance(b, incident_id, IncidentState.DIAGNOSING, reason="collecting evidence")
    snapshots: dict[str, Any] = {}
    for node in implicated_nodes(incident):
        try:
            snapshots[node] = b.telemetry.collect(node).to_dict()
        except PermanentError as err:
            snapshots[node] = {"error": str(err)}
    b.ledger.transition(
        incident_id,
        incident.state,
        evidence=_with_evidence(b.ledger.get_incident(incident_id), telemetry=snapshots),
    )
    summary = "; ".join(
        f"{node}: {snap.get('health', 'not collected')}" for node, snap in snapshots.items()
    )
    return {"outcome": summary or "no suspect node", "nodes": sorted(snapshots)}


@stage(Stage.REPLAY)
def diagnostic_replay(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Recompute the suspect steps on the suspects and on spares: does the mismatch follow a
    node (hardware), every node (software), or none (inconclusive)?

    A replay that cannot run is no evidence against anyone: it ends ``inconclusive`` with the
    reason, and a human decides.
    """
    b = current_backends()
    incident = _advance(b, incident_id, IncidentState.DIAGNOSING)
    suspects = implicated_nodes(incident)
    spares = b.directory.spares(suspects)[: policy.spare_nodes]
    replay: dict[str, Any] = {"spares": spares, "end": incident.suspect_end}
    try:
        plan = b.catalog.replay_plan(incident.job_id)
        checkpoint, _ = choose_checkpoint(b, incident)
        if checkpoint is None:
            raise PermanentError(
                "replay",
                "plan",
                f"job/{incident.job_id}",
                f"no verified checkpoint before step {incident.suspect_start} to replay from",
            )
        replay["checkpoint_step"] = checkpoint.step
        base = ReplayRequest(
            job_id=incident.job_id,
            checkpoint_uri=checkpoint.uri,
            checkpoint_step=checkpoint.step,
            end=incident.suspect_end,
            node=spares[0] if spares else "",
            spec=plan.spec,
        )
        alarm_step = min((a.step for a in incident.alarms), default=None)
        verdict = diagnose(
            b.replay, base, suspects, spares, reference=plan.reference, alarm_step=alarm_step
        ).to_dict()
    except PermanentError as err:
        verdict = {
            "verdict": Verdict.INCONCLUSIVE.value,
            "node": None,
            "first_step": None,
            "submodule": None,
            "op_kind": None,
            "reason": f"no replay evidence: {err}",
            "detail": {},
        }
    b.ledger.transition(
        incident_id,
        b.ledger.get_incident(incident_id).state,
        verdict=Verdict(verdict["verdict"]),
        evidence=_with_evidence(b.ledger.get_incident(incident_id), verdict=verdict, replay=replay),
    )
    return {
        "outcome": f"{verdict['verdict']}: {verdict['reason']}",
        "verdict": verdict["verdict"],
        "node": verdict["node"],
    }


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
        incident = _advance(
            b, incident_id, IncidentState.AWAITING_APPROVAL, reason="waiting for a decision"
        )
        verdict = _verdict(incident)
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
        evidence=_with_evidence(incident, approval=record),
    )
    by = f" by {approver}" if approver else ""
    return {"outcome": f"{choice}{by}: {reason}", **record}


def _replacement_plan(b: Backends, incident_id: str, node: str) -> dict[str, Any]:
    """Which instance backs ``node`` and who its group's members are, before any replace.

    Kept with the claim, because after the replacement the node is gone and the new instance
    is recognised only as "a member that was not there before".
    """
    key = f"{incident_id}:{Action.REPLACE.value}:{node}"
    prior = next((a for a in b.ledger.actions(incident_id) if a.key == key), None)
    if prior is not None and prior.detail and prior.detail.get("instance_id"):
        return dict(prior.detail)
    info = b.nodes.get(node)
    labels = dict(info.labels)
    if info.instance_id:
        labels.setdefault(INSTANCE_ID_LABEL, info.instance_id)
    instance_id = b.hyperpod.instance_for(node, labels)
    group = b.hyperpod.describe(instance_id).group
    members = sorted(n.instance_id for n in b.hyperpod.list_nodes(group))
    return {"node": node, "instance_id": instance_id, "group": group, "members_before": members}


def _status(b: Backends, instance_id: str) -> str:
    try:
        return b.hyperpod.describe(instance_id).status
    except NotFoundError:
        return NodeStatus.NOT_FOUND.value


def _replace(b: Backends, plan: dict[str, Any], first: bool) -> dict[str, Any]:
    node, instance_id, group = plan["node"], plan["instance_id"], plan["group"]
    leaving = (NodeStatus.SHUTTING_DOWN.value, NodeStatus.NOT_FOUND.value)
    if first or _status(b, instance_id) not in leaving:
        try:
            b.hyperpod.replace(instance_id).raise_for_failures()
        except AlreadyReplacing:
            log.warning("%s is already being replaced; waiting for it", node, extra={"node": node})
    new_instance = b.hyperpod.wait_replaced(
        instance_id, group, known_ids=frozenset(plan["members_before"])
    )
    new_node = b.directory.joined(node, new_instance)
    return {"new_instance_id": new_instance, "new_node": new_node}


def _reboot(b: Backends, node: str, instance_id: str, first: bool) -> dict[str, Any]:
    # A stale claim with the node Running cannot tell "rebooted" from "never asked": reboot
    # again — a second reboot costs minutes, a skipped one leaves a bad node in service.
    if first or _status(b, instance_id) != NodeStatus.PENDING.value:
        b.hyperpod.reboot(instance_id).raise_for_failures()
    b.hyperpod.wait_running(instance_id)
    return {"rebooted": True}


def _uncordon(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    return {"uncordoned": b.nodes.uncordon(node, incident_id)}


@stage(Stage.REPLACE)
def fix_nodes(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Replace the faulty node through HyperPod (or reboot it), as the policy says."""
    b = current_backends()
    incident = _advance(
        b, incident_id, IncidentState.REPLACING, reason=f"{policy.action.value} approved"
    )
    replaced: list[dict[str, Any]] = []
    rebooted: list[dict[str, Any]] = []
    for node in nodes_to_fix(incident):
        plan = _replacement_plan(b, incident_id, node)
        if policy.action is NodeAction.REPLACE:
            done = perform(
                incident_id,
                Action.REPLACE,
                node,
                functools.partial(_replace, b, plan),
                detail=plan,
            )
            replaced.append(
                {
                    "node": node,
                    "instance_id": plan["instance_id"],
                    "new_instance_id": done["new_instance_id"],
                    "new_node": done["new_node"],
                }
            )
        else:
            perform(
                incident_id,
                Action.REBOOT,
                node,
                functools.partial(_reboot, b, node, plan["instance_id"]),
                detail={"node": node, "instance_id": plan["instance_id"]},
            )
            perform(
                incident_id,
                Action.UNCORDON,
                node,
                functools.partial(_uncordon, b, incident_id, node),
            )
            rebooted.append({"node": node, "instance_id": plan["instance_id"]})
    # Suspects the replay cleared (a hardware verdict named another node) go back to work:
    # the job resumes on them, and a cordoned node cannot take its pods.
    cleared = [n for n in implicated_nodes(incident) if n not in nodes_to_fix(incident)]
    for node in cleared:
        perform(
            incident_id, Action.UNCORDON, node, functools.partial(_uncordon, b, incident_id, node)
        )
    parts = [f"{r['node']} → {r['new_node']} ({r['new_instance_id']})" for r in replaced]
    parts += [f"{r['node']} rebooted" for r in rebooted]
    parts += [f"{n} cleared by the replay and uncordoned" for n in cleared]
    return {
        "outcome": "; ".join(parts),
        "replaced": replaced,
        "rebooted": rebooted,
        "cleared": cleared,
    }


@stage(Stage.QUARANTINE)
def quarantine_suspect_checkpoints(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Quarantine every checkpoint from the suspect range on, including any recorded late."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    b.ledger.quarantine_range(incident.job_id, incident.suspect_start, None)
    held = [
        c.step
        for c in b.ledger.list_checkpoints(incident.job_id)
        if c.status is CheckpointStatus.QUARANTINED and c.step >= incident.suspect_start
    ]
    return {
        "outcome": f"quarantined steps {held or 'none'} (from step {incident.suspect_start} on)",
        "quarantined": held,
    }


def _resume_nodes(b: Backends, incident: IncidentView) -> list[str] | None:
    """One node per rank, the replaced nodes swapped for their replacements."""
    ranks = b.ledger.rank_map(incident.job_id)
    if not ranks:
        return None
    swap: dict[str, str] = {}
    for action in incident.actions:
        if action.kind == Action.REPLACE.value and action.status is ActionStatus.SUCCEEDED:
            detail = action.detail or {}
            swap[str(detail["node"])] = str(detail["new_node"])
    return [swap.get(ranks[r].node, ranks[r].node) for r in sorted(ranks)]


@stage(Stage.RESUME)
def resume_training(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Resume from the newest verified checkpoint strictly before the suspect range.

    Never a pending, quarantined or corrupt one: only ``verified`` rows are candidates, and
    each is re-read from storage against its sha256 first. The resumed job checks the weight
    fingerprint after load against the one recorded with the checkpoint.
    """
    b = current_backends()
    incident = _advance(
        b, incident_id, IncidentState.RESUMING, reason="resuming from a verified checkpoint"
    )
    checkpoint, corrupt = choose_checkpoint(b, incident)
    if checkpoint is None:
        raise PermanentError(
            "checkpoints",
            "choose",
            f"job/{incident.job_id}",
            f"no verified checkpoint before step {incident.suspect_start} is intact in storage",
        )
    nodes = _resume_nodes(b, b.ledger.get_incident(incident_id))
    job = b.catalog.ref(incident.job_id)

    def act(first: bool) -> dict[str, Any]:
        result = b.jobs.resume(job, checkpoint.uri, checkpoint.step, nodes)
        return {"resume": result.outcome.value, "pid": result.pid}

    done = perform(
        incident_id,
        Action.RESUME,
        incident.job_id,
        act,
        detail={
            "checkpoint_uri": checkpoint.uri,
            "checkpoint_step": checkpoint.step,
            "fingerprint": checkpoint.fingerprint,
            "nodes": nodes,
        },
    )
    step = int(done.get("checkpoint_step", checkpoint.step))
    return {
        "outcome": f"{done.get('resume')} from the checkpoint at step {step}"
        + (f" on {', '.join(nodes)}" if nodes else "")
        + f": steps {step + 1}..{incident.suspect_end} are recomputed",
        "checkpoint_step": step,
        "checkpoint_uri": done.get("checkpoint_uri", checkpoint.uri),
        "fingerprint": done.get("fingerprint", checkpoint.fingerprint),
        "nodes": done.get("nodes", nodes),
        "corrupt": corrupt,
    }


@stage(Stage.RELEASE)
def release_nodes(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """On reject, when the approver asks: undo our cordon and taint (never anyone else's)."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    results = {}
    for node in implicated_nodes(incident):
        try:
            done = perform(
                incident_id,
                Action.UNCORDON,
                node,
                functools.partial(_uncordon, b, incident_id, node),
            )
            results[node] = "uncordoned" if done.get("uncordoned") else "left as it was"
        except NotFoundError:
            results[node] = "gone"
    return {
        "outcome": "; ".join(f"{n} {r}" for n, r in results.items()),
        "uncordoned": sorted(n for n, r in results.items() if r == "uncordoned"),
    }


def close(incident_id: str, to: IncidentState, reason: str) -> IncidentView:
    """End the incident in a terminal state (a no-op when a re-run finds it there already)."""
    b = current_backends()
    current = b.ledger.get_incident(incident_id)
    if current.state == to:
        return current
    return b.ledger.transition(incident_id, to, reason=reason)
