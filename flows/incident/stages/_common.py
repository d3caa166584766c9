"""What every stage shares: the stage and action kinds, the two ledger records, the decorator.

:func:`record_stage` makes a stage one ledger action and :func:`perform` makes each side effect
one (the two rules in :mod:`flows.incident.stages`); :func:`stage` turns a stage body into the
Prefect task the runbook calls. How a stage reads and moves the incident is
:mod:`flows.incident.stages._incident`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.exceptions import Pause
from prefect.states import State

from db import (
    STAGE_KIND,
    ActionClaim,
    ActionStatus,
    ActionView,
    ClaimLost,
    LedgerTemporaryError,
)
from flows.incident.coordination import claim_owner, dead_owner_reason
from flows.incident.policy import IncidentPolicy
from flows.incident.stages._heartbeat import ClaimHeartbeat, current_heartbeat
from flows.incident.wiring import current_backends
from flows.settings import CoordinationSettings
from recovery.errors import TemporaryError

__all__ = [
    "Action",
    "Stage",
    "StageOutcome",
    "StageTask",
    "log_extra",
    "perform",
    "record_stage",
    "retry_on_temporary",
    "stage",
]

log = logging.getLogger(__name__)

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
    CLEAR = "clear"
    """After the resume: what a remediation left for the incident is removed."""
    HAND_OVER = "hand-over"
    """Instead of the resume, when the node was isolated: a human takes over."""
    RELEASE = "release"


class Action(StrEnum):
    """Side effects on outside systems; each is a ledger action of this kind per target."""

    STOP_JOB = "stop-job"
    CORDON = "cordon"
    TAINT = "taint"
    UNCORDON = "uncordon"
    REPLACE = "replace"
    REBOOT = "reboot"
    ISOLATE = "isolate"
    CLEAR = "clear-remediation"
    RESUME = "resume"


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


def log_extra(incident_id: str, stage: Stage | str, **more: Any) -> dict[str, Any]:
    return {"incident": incident_id, "stage": str(stage), **more}


def record_stage(stage: Stage, incident_id: str, body: Callable[[], StageOutcome]) -> StageOutcome:
    """Run ``body`` as the ledger action ``<incident>:stage:<stage>``; skip it once succeeded.

    The claim is this flow run's, leased (:func:`flows.incident.coordination.claim_owner`): a
    stage another live run holds raises :class:`db.ClaimLost` here, before anything is done.
    While ``body`` runs, a :class:`ClaimHeartbeat` renews the lease (the lease is short; a stage
    may wait for an hour); it is stopped before the outcome is recorded, however ``body`` ends.
    """
    extra = log_extra(incident_id, stage)
    held = _hold(incident_id, STAGE_KIND, stage.value, None, extra)
    if isinstance(held, dict):
        return held
    if held.action.attempts > 1:
        log.warning("stage %s: an earlier attempt did not finish; continuing", stage, extra=extra)
    log.info("stage %s started", stage, extra=extra)
    ledger = current_backends().ledger
    heartbeat = ClaimHeartbeat(ledger, held.action.key, held.owner, held.lease_s, context=extra)

    def run() -> StageOutcome:
        token = current_heartbeat.set(heartbeat)
        try:
            with heartbeat:
                return body()
        finally:
            current_heartbeat.reset(token)

    outcome = _settle(held, run, extra)
    log.info("stage %s done: %s", stage, outcome.get("outcome"), extra=extra)
    return outcome


@dataclass(frozen=True)
class _Held:
    """An action this run has claimed and must now finish: its row, owner and lease."""

    action: ActionView
    owner: str
    lease_s: float


def _hold(
    incident_id: str, kind: str, target: str, detail: dict[str, Any] | None, extra: dict[str, Any]
) -> _Held | dict[str, Any]:
    """Claim ``<incident>:<kind>:<target>`` for this run: held, or — done already — what it
    recorded. A claim another live run holds raises :class:`db.ClaimLost`."""
    owner, lease_s = claim_owner(), _lease_s()
    claim = _claim(incident_id, kind, target, detail, owner, lease_s)
    if not claim.won and claim.action.status is ActionStatus.SUCCEEDED:
        log.info("%s already done; not repeated", claim.action.key, extra=extra)
        return dict(claim.action.detail or {})
    if not claim.won:
        raise ClaimLost(claim.action.key, owner, claim.action.owner)
    return _Held(claim.action, owner, lease_s)


def _settle(
    held: _Held, act: Callable[[], dict[str, Any]], extra: dict[str, Any]
) -> dict[str, Any]:
    """Run ``act`` for a held action and record how it ended, whatever happens.

    Succeeded: its result. An error: ``failed`` with the error, so the next attempt looks before
    it acts again. The engine stopping the run (a ``BaseException``): released
    (:func:`_release`). A claim found lost (:class:`db.ClaimLost`): nothing — it is not ours.
    """
    ledger = current_backends().ledger
    key = held.action.key
    try:
        result = act()
    except ClaimLost:
        raise
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        ledger.finish_action(
            key,
            ActionStatus.FAILED,
            {"outcome": f"failed: {err}", "error": error},
            owner=held.owner,
        )
        log.error("%s failed: %s", key, err, extra=extra)
        raise
    except BaseException as signal:
        _release(key, held.owner, signal, extra)
        raise
    ledger.finish_action(key, ActionStatus.SUCCEEDED, {**result, "error": None}, owner=held.owner)
    return result


def _lease_s() -> float:
    return CoordinationSettings().claim_lease_s


def _claim(
    incident_id: str,
    kind: str,
    target: str,
    detail: dict[str, Any] | None,
    owner: str,
    lease_s: float,
) -> ActionClaim:
    """Claim an action; a claim held by a flow run that is dead is taken over at once.

    A SIGKILLed run cannot release its claims; waiting out their lease would stall the
    incident. Prefect says whether the holder's run is finished or unknown
    (:func:`flows.incident.coordination.dead_owner_reason`); the takeover event records why.
    """
    ledger = current_backends().ledger
    claim = ledger.claim_action(incident_id, kind, target, detail, owner=owner, lease_s=lease_s)
    holder = claim.action.owner
    if claim.won or claim.action.status is not ActionStatus.CLAIMED or holder in (None, owner):
        return claim
    assert holder is not None
    why = dead_owner_reason(holder)
    if why is None:
        return claim
    log.warning(
        "taking over %s from %s (%s)",
        claim.action.key,
        holder,
        why,
        extra=log_extra(incident_id, kind, previous_owner=holder),
    )
    return ledger.claim_action(
        incident_id,
        kind,
        target,
        detail,
        owner=owner,
        lease_s=lease_s,
        dead_owner=holder,
        dead_reason=why,
    )


def _release(key: str, owner: str, signal: BaseException, extra: dict[str, Any]) -> None:
    """Give up a claim when the engine stops the run (a ``BaseException``, not a failure).

    Prefect suspends a run waiting for approval with its ``Pause`` signal and cancels one with
    ``CancelledError``; both pass ``except Exception``. Left ``claimed``, the stage would look
    in flight for ever; released (recorded ``failed`` with the signal's name, so a later run
    looks before it acts again) it is continued by whichever run comes next. The signal is
    re-raised by the caller; a ledger error here is logged and the signal still wins.
    """
    suspended = isinstance(signal, Pause)
    what = (
        "suspended: waiting for approval" if suspended else f"interrupted: {type(signal).__name__}"
    )
    try:
        current_backends().ledger.finish_action(
            key,
            ActionStatus.FAILED,
            {"outcome": what, "interrupted": type(signal).__name__},
            owner=owner,
        )
    except Exception as err:
        log.error("could not release %s after %s: %s", key, what, err, extra=extra)
        return
    log.log(
        logging.INFO if suspended else logging.WARNING, "%s released (%s)", key, what, extra=extra
    )


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
    on_job = kind in (Action.STOP_JOB, Action.RESUME)
    extra = log_extra(incident_id, kind.value, **{"job" if on_job else "node": target})
    held = _hold(incident_id, kind.value, target, detail, extra)
    if isinstance(held, dict):
        return held
    heartbeat = current_heartbeat.get()
    _still_ours(heartbeat, held.owner, held.lease_s)
    first = held.action.attempts == 1
    if not first:
        log.warning(
            "%s %s: an earlier attempt may have acted; checking first", kind, target, extra=extra
        )

    def run() -> dict[str, Any]:
        # renewed with its stage while it runs: a replacement may wait for an hour
        with heartbeat.hold(held.action.key) if heartbeat else contextlib.nullcontext():
            return act(first)

    result = _settle(held, run, extra)
    log.info("%s %s done", kind, target, extra=extra)
    return {**(held.action.detail or {}), **result}


def _still_ours(heartbeat: ClaimHeartbeat | None, owner: str, lease_s: float) -> None:
    """The check before a destructive call: the stage it belongs to must still be ours.

    A run whose stage was taken over — its heartbeat found it lost, or its lease expired while
    it hung — raises :class:`db.ClaimLost` here and performs nothing more.
    """
    if heartbeat is None:
        return
    heartbeat.check()
    current_backends().ledger.hold_claim(heartbeat.stage_key, owner, lease_s)


def stage(name: Stage) -> Callable[[Callable[[str, IncidentPolicy], StageOutcome]], StageTask]:
    """Make ``fn(incident_id, policy)`` a Prefect task recorded as the ledger stage ``name``.

    No Prefect caching (the ledger decides what is done) and no persisted results; retries are
    set per run from the policy (:func:`flows.incident.flow.incident_response`).
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
