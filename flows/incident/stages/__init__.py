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

The modules, one runbook step each: ``_common`` (the two records above, the stage decorator),
``_incident`` (reading and moving the incident), ``_heartbeat`` (a running stage's claims renewed
while it runs), ``containment`` (triage's storm guard, stop, cordon, release), ``diagnosis``
(telemetry, rerun), ``approval`` (the decision), ``fix`` (the wired remediation, and its release
after the resume), ``handover`` (an isolated node's incident to a human), ``resume``
(quarantine, choose the checkpoint, resume). :mod:`flows.incident.flow` calls them in order.
"""

from flows.incident.stages._common import (
    Action,
    Stage,
    StageTask,
    perform,
    record_stage,
    retry_on_temporary,
)
from flows.incident.stages._incident import close, implicated_nodes, nodes_to_fix
from flows.incident.stages.approval import (
    AUTO_APPROVER,
    Decision,
    seek_approval,
    withdraw_automatic,
)
from flows.incident.stages.containment import cordon_suspects, release_nodes, stop_training, triage
from flows.incident.stages.diagnosis import collect_telemetry, diagnostic_rerun
from flows.incident.stages.fix import fix_nodes, release_remediations
from flows.incident.stages.handover import hand_over
from flows.incident.stages.resume import (
    choose_checkpoint,
    quarantine_suspect_checkpoints,
    resume_training,
)

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
    "diagnostic_rerun",
    "fix_nodes",
    "hand_over",
    "implicated_nodes",
    "nodes_to_fix",
    "perform",
    "quarantine_suspect_checkpoints",
    "record_stage",
    "release_nodes",
    "release_remediations",
    "resume_training",
    "retry_on_temporary",
    "seek_approval",
    "stop_training",
    "triage",
    "withdraw_automatic",
]
