"""Where incidents wait for each other: one global concurrency limit around destructive stages.

Containment (stop, cordon, telemetry) and the diagnosis of an incident never wait for another
incident: a second faulty job must be stopped and its node cordoned while the first incident is
still replacing. Only what changes the fleet — replace or reboot a node, then resume a job onto
the new node set — is serialised, by a Prefect *global* concurrency limit (``limit: 1`` by
default) held for exactly those stages, never by a deployment-wide limit. Nothing is held while
an incident waits for its approver.

The limit is created by code, here, idempotently: :func:`ensure_prefect_objects` runs in every
flow run before the first destructive stage and from ``sdcguard prefect-setup`` beside
``prefect deploy``; ``strict=True`` makes a missing limit an error instead of "no limit".

Invariant: a slot is held only inside :func:`destructive_slot`; leaving it (return, exception,
cancellation) releases it, and the lease (``lease_s``) bounds how long a dead holder blocks.

A ledger claim is owned by a flow run (:func:`claim_owner`). A claim whose owner's flow run is
finished — ``Crashed`` (its process was SIGKILLed and the worker reported it), ``Failed``,
``Cancelled``, ``Completed`` — or that Prefect does not know at all can be taken over at once
(:func:`dead_owner_reason`) instead of after its lease; an owner Prefect reports live (running,
paused, suspended, scheduled) keeps its claim until the lease expires.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Final

from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound

from flows.settings import CoordinationSettings

__all__ = [
    "claim_owner",
    "dead_owner_reason",
    "destructive_slot",
    "ensure_prefect_objects",
]

log = logging.getLogger(__name__)


_PROCESS_OWNER = f"process-{uuid.uuid4()}"
_FLOW_RUN_OWNER: Final = "flow-run-"


def claim_owner() -> str:
    """Who holds the ledger claims this code makes: the Prefect flow run (stable across a
    suspend and its re-entry), or, outside any run, one id per process."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return f"{_FLOW_RUN_OWNER}{context.flow_run.id}"
    return _PROCESS_OWNER


def dead_owner_reason(owner: str) -> str | None:
    """Why the flow run that owns a claim is dead ("flow run Crashed", "flow run not found"),
    or None when it may be alive — live, or unknowable: an owner that is not a flow run, or a
    Prefect API that does not answer (then the lease decides, as before)."""
    if not owner.startswith(_FLOW_RUN_OWNER):
        return None
    try:
        run_id = uuid.UUID(owner.removeprefix(_FLOW_RUN_OWNER))
    except ValueError:
        return None
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
    except ObjectNotFound:
        return "flow run not found"
    except Exception as err:  # the API is down or refuses: cannot tell, keep the lease rule
        log.warning("cannot read owner %s from Prefect: %s", owner, err, extra={"owner": owner})
        return None
    if run.state is not None and run.state.is_final():
        return f"flow run {run.state.type.value}"
    return None


def ensure_prefect_objects(settings: CoordinationSettings | None = None) -> None:
    """Create (or correct) the global concurrency limit on the current Prefect API."""
    s = settings or CoordinationSettings()
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(s.destructive_limit, s.destructive_slots)
    log.info(
        "global concurrency limit ready",
        extra={"limit": s.destructive_limit, "slots": s.destructive_slots},
    )


@contextlib.contextmanager
def destructive_slot(
    incident_id: str, settings: CoordinationSettings | None = None
) -> Iterator[None]:
    """Hold one slot of the destructive limit for the block; waits while another incident does."""
    s = settings or CoordinationSettings()
    ensure_prefect_objects(s)
    extra = {"incident": incident_id, "limit": s.destructive_limit}
    log.info("waiting for a destructive slot", extra=extra)
    with concurrency(
        s.destructive_limit, occupy=1, strict=True, lease_duration=s.destructive_lease_s
    ):
        log.info("destructive slot held", extra=extra)
        yield
    log.info("destructive slot released", extra=extra)
