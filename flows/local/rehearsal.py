"""``sdcguard replay-incident ID``: rehearse a recorded incident on local backends.

A rehearsal re-runs the incident flow for an incident recorded in a ledger — typically a copy
of production's — and touches nothing real: the source ledger is only read; the rehearsal gets
its own SQLite ledger seeded from it, a simulated cluster with the job's nodes (plus spares), a
stand-in process for the training job, packaged telemetry fixtures, and SageMaker HyperPod
mocked by moto on loopback. It shows what the flow would do — stages, decision path, which node
would be replaced, which checkpoint resumed — and says, in its result and output, that it was
a rehearsal.

What cannot be rehearsed is said too: the job's data are not here, so there is no diagnostic
replay (the verdict is ``inconclusive``), and checkpoint bytes not readable on this machine are
replaced by stand-in files whose sha256 the rehearsal ledger records instead.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from prefect.settings import PREFECT_API_URL, temporary_settings
from rich.console import RenderableType
from rich.text import Text

from db import (
    AlarmIn,
    CheckpointEvidence,
    CheckpointStatus,
    CheckpointView,
    IncidentView,
    Ledger,
    RankIn,
    upgrade,
)
from flows.incident.approval.form import ApprovalChoice, ApprovalDecision, submit_decision
from flows.incident.flow import respond
from flows.incident.policy import IncidentPolicy
from flows.incident.report import incident_renderables
from flows.incident.wiring import Backends, use_backends
from flows.local.prefect_server import one_prefect_server
from recovery.aws.hyperpod import HyperPod, sagemaker_client
from recovery.aws.local import create_demo_cluster, start_local_aws
from recovery.checkpoints.store import FileCheckpointStore
from recovery.diagnosis.rerun import RerunRequest, RerunResult
from recovery.errors import PermanentError
from recovery.jobs import JobKind, JobRef
from recovery.local import LocalJobControl
from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster
from recovery.local.nodes import LocalNodeDirectory, LocalNodeOps
from recovery.telemetry import FixtureTelemetry, packaged_fixture_root

__all__ = [
    "REHEARSAL_NOTICE",
    "Rehearsal",
    "RehearsalDecision",
    "rehearsal_renderables",
    "rehearse",
]

log = logging.getLogger(__name__)

REHEARSAL_NOTICE = (
    "REHEARSAL: no real cluster, training job, checkpoint store or AWS account was touched — "
    "nodes are simulated, the job is a stand-in process, HyperPod is mocked by moto on "
    "loopback, and the source ledger was only read."
)
_SPARES = ("rehearsal-spare-0", "rehearsal-spare-1")
_STAND_IN = (sys.executable, "-c", "import time; time.sleep(3600)")
_APPROVER = "sdcguard replay-incident"


class RehearsalDecision(StrEnum):
    """Who answers the rehearsal's approval form."""

    APPROVE = "approve"
    REJECT = "reject"
    EXPIRE = "expire"
    """Nobody: the pause times out (after ``policy.approval_timeout_s``)."""
    UI = "ui"
    """A person, in the Prefect UI, within ``policy.approval_timeout_s``."""


@dataclass(frozen=True)
class Rehearsal:
    """What the rehearsal did, and where its own records are."""

    source_incident_id: str
    incident_id: str
    """The incident's id in the rehearsal ledger."""
    ledger_url: str
    workdir: Path
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    notice: str = REHEARSAL_NOTICE


class _NoRerunner:
    """The job's data and code are not on this machine: a replay would prove nothing."""

    def rerun(self, request: RerunRequest) -> RerunResult:
        raise PermanentError(
            "replay", "run", request.node, "rehearsal: the job's data are not here to replay"
        )


def rehearse(
    source_url: str,
    incident_id: str,
    workdir: Path,
    *,
    decision: RehearsalDecision = RehearsalDecision.APPROVE,
    policy: IncidentPolicy | None = None,
) -> Rehearsal:
    """Re-run the flow for ``incident_id`` of the ledger at ``source_url`` on local backends."""
    workdir = workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    if policy is None:
        timeout = 2 if decision is RehearsalDecision.EXPIRE else 600
        policy = IncidentPolicy(task_retries=1, retry_delay_s=0.2, approval_timeout_s=timeout)
    with Ledger.from_url(source_url) as source:
        recorded = source.get_incident(incident_id)
        ranks = source.rank_map(recorded.job_id)
        checkpoints = source.list_checkpoints(recorded.job_id)
    url = f"sqlite:///{workdir / 'rehearsal-ledger.db'}"
    upgrade(url)
    notes: list[str] = []
    with Ledger.from_url(url) as ledger, start_local_aws() as aws:
        nodes = list(dict.fromkeys([r.node for _, r in sorted(ranks.items())]))
        nodes += [n for n in recorded.suspect_nodes if n not in nodes]
        names = [*nodes, *_SPARES]
        cluster_name = f"rehearsal-{uuid.uuid4().hex[:8]}"
        ids = create_demo_cluster(aws, cluster_name, len(names))
        cluster = LocalCluster.create(
            workdir / "cluster.json", nodes, list(_SPARES), dict(zip(names, ids, strict=True))
        )
        ledger.register_ranks(
            recorded.job_id,
            [
                RankIn(r.rank, r.local_rank, r.node, r.instance_id, r.gpu_uuid)
                for r in ranks.values()
            ],
        )
        notes += _copy_checkpoints(ledger, recorded, checkpoints, workdir / "stand-in-checkpoints")
        rehearsed = _copy_incident(ledger, recorded)
        if (rehearsed.suspect_start, rehearsed.suspect_end) != (
            recorded.suspect_start,
            recorded.suspect_end,
        ):
            notes.append(
                f"suspect range rebuilt as {rehearsed.suspect_start}..{rehearsed.suspect_end} "
                f"(recorded: {recorded.suspect_start}..{recorded.suspect_end})"
            )
        jobs = LocalJobControl(workdir / "jobs", command=list(_STAND_IN))
        jobs.launch(
            recorded.job_id,
            [
                "--world-size",
                str(max(len(ranks), 1)),
                "--nodes",
                ",".join(r.node for _, r in sorted(ranks.items())),
            ],
            workdir / "stand-in-job.log",
        )
        notes.append("no diagnostic replay: the job's data are not here (verdict inconclusive)")
        client = sagemaker_client(aws.region, aws.endpoint_url, session=aws.session())
        backends = Backends(
            ledger=ledger,
            nodes=LocalNodeOps(cluster),
            jobs=jobs,
            telemetry=FixtureTelemetry(packaged_fixture_root()),
            rerunner=_NoRerunner(),
            hyperpod=HyperPod(client, cluster_name, poll_interval_s=0.05, wait_timeout_s=120),
            checkpoints=FileCheckpointStore(workdir / "store"),
            directory=LocalNodeDirectory(cluster),
            catalog=LocalJobCatalog(workdir / "jobs"),
            description=f"rehearsal in {workdir}, AWS mocked at {aws.endpoint_url}",
        )
        log.warning(REHEARSAL_NOTICE, extra={"incident": rehearsed.id, "job": recorded.job_id})
        try:
            # One Prefect API for the flow and the approver thread: the configured one, or one
            # server started here. Left to themselves, each would start a temporary server of
            # its own, and the approver would wait for a run on a server that has none.
            with one_prefect_server(workdir / "prefect") as server:
                answering = _answer(rehearsed.id, incident_id, decision, policy, server.api_url)
                with use_backends(backends):
                    summary = respond(rehearsed.id, policy)
                if answering is not None:
                    answering.join(timeout=10)
        finally:
            jobs.stop(JobRef(recorded.job_id, kind=JobKind.LOCAL))
    return Rehearsal(
        source_incident_id=incident_id,
        incident_id=rehearsed.id,
        ledger_url=url,
        workdir=workdir,
        summary={**summary, "rehearsal": True, "source_incident_id": incident_id},
        notes=notes,
    )


def _copy_checkpoints(
    ledger: Ledger,
    incident: IncidentView,
    checkpoints: Sequence[CheckpointView],
    stand_in_dir: Path,
) -> list[str]:
    """Record the job's checkpoints with the provenance they had before the incident.

    Verified checkpoints before the suspect range are verified again by one passed audit just
    before the range (which also makes the rehearsal ledger compute the same suspect start);
    everything else is recorded afterwards, so it stays pending; corrupt ones are marked.
    """
    notes: list[str] = []
    job = incident.job_id
    start = incident.suspect_start
    stood_in = 0

    def record(c: CheckpointView) -> None:
        nonlocal stood_in
        uri, sha256 = c.uri, c.sha256
        path = Path(uri)
        if not (path.is_absolute() and path.is_file()):
            stand_in_dir.mkdir(parents=True, exist_ok=True)
            path = (
                stand_in_dir
                / f"ckpt-{c.step:06d}-{hashlib.sha256(uri.encode()).hexdigest()[:8]}.pt"
            )
            path.write_bytes(f"stand-in for {uri} (step {c.step})\n".encode())
            uri, sha256 = str(path), hashlib.sha256(path.read_bytes()).hexdigest()
            stood_in += 1
        ledger.record_checkpoint(job, c.step, uri, sha256, c.fingerprint, c.nodes)
        if c.status is CheckpointStatus.CORRUPT:
            ledger.mark_checkpoint_corrupt(
                job, c.step, f"corrupt in the source ledger: {c.reason}", uri=uri
            )

    before = [c for c in checkpoints if c.status is CheckpointStatus.VERIFIED and c.step < start]
    for checkpoint in before:
        record(checkpoint)
    if start > 0:
        ring = any(c.evidence is CheckpointEvidence.RING_AUDIT for c in checkpoints)
        ledger.record_audit(job, start - 1, "loss" if ring else "fingerprint", [0], True)
    for checkpoint in checkpoints:
        if checkpoint not in before:
            record(checkpoint)
    if stood_in:
        notes.append(
            f"{stood_in} checkpoint(s) not readable here were replaced by stand-in files; "
            "their sha256 checks run against the stand-ins"
        )
    return notes


def _copy_incident(ledger: Ledger, incident: IncidentView) -> IncidentView:
    """Open the incident again in the rehearsal ledger from its own alarms."""
    opened: str | None = None
    for alarm in incident.alarms:
        outcome = ledger.record_alarm(
            AlarmIn(
                alarm_id=alarm.alarm_id,
                job_id=alarm.job_id,
                step=alarm.step,
                rank=alarm.rank,
                node=alarm.node,
                layer=alarm.layer,
                phase=alarm.phase,
                suspect_ranks=alarm.suspect_ranks,
                suspect_nodes=alarm.suspect_nodes,
                detail=alarm.detail,
                sent_at=alarm.sent_at,
            )
        )
        opened = opened or outcome.incident_id
    if opened is None:
        return ledger.open_incident(
            incident.job_id,
            start=incident.suspect_start,
            end=incident.suspect_end,
            suspect_nodes=incident.suspect_nodes,
        )
    return ledger.get_incident(opened)


def _answer(
    rehearsal_id: str,
    source_id: str,
    decision: RehearsalDecision,
    policy: IncidentPolicy,
    api_url: str,
) -> threading.Thread | None:
    """Answer the rehearsal's approval form from a thread, as a person would in the UI."""
    if decision not in (RehearsalDecision.APPROVE, RehearsalDecision.REJECT):
        return None
    answer = ApprovalDecision(
        decision=ApprovalChoice(decision.value),
        approver=_APPROVER,
        reason=f"rehearsal of incident {source_id}",
    )

    def run() -> None:
        # A new thread has no settings context of its own: name the flow's API explicitly.
        try:
            with temporary_settings({PREFECT_API_URL: api_url}):
                submit_decision(rehearsal_id, answer, timeout_s=policy.approval_timeout_s)
        except TimeoutError as err:
            log.error("rehearsal approval not submitted: %s", err, extra={"incident": rehearsal_id})

    thread = threading.Thread(target=run, name="rehearsal-approver", daemon=True)
    thread.start()
    return thread


def rehearsal_renderables(result: Rehearsal) -> list[RenderableType]:
    """What ``sdcguard replay-incident`` prints: the notice, the caveats, the incident."""
    out: list[RenderableType] = [Text(result.notice, style="bold yellow")]
    out += [Text(f"- {note}", style="yellow") for note in result.notes]
    with Ledger.from_url(result.ledger_url) as ledger:
        out += incident_renderables(ledger.get_incident(result.incident_id))
    out.append(
        Text(f"rehearsal of incident {result.source_incident_id}; its ledger: {result.ledger_url}")
    )
    out.append(
        Text(
            f"REHEARSAL ended {result.summary['state']} — nothing real was touched",
            style="bold yellow",
        )
    )
    return out
