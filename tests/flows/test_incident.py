"""The incident-response flow on the local backends, against a real Prefect API.

Everything outside sdcguard is real or faked at its wire: a temporary Prefect server (the
session's ``prefect_api``), a SQLite ledger, a simulated cluster state file, local processes as
the training job, packaged telemetry fixtures, a file checkpoint store and SageMaker HyperPod
served by moto over HTTP. The one stand-in is :class:`ScriptedRerunner`, the cluster nodes that
run replays reduced to their answers (a faulty node computes something else from a given step
on). Real diagnostic reruns of a real training job, through to an exact recovery, are the
end-to-end demos' (``tests/e2e/``); the rerun verdicts on real processes are
``tests/recovery/test_diagnosis_local.py``'s, and the resumed run's own report names
``tests/recovery/test_jobs.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from db import (
    STAGE_KIND,
    ActionStatus,
    AlarmIn,
    CheckpointStatus,
    ClaimLost,
    IllegalTransition,
    IncidentState,
    Ledger,
    RankIn,
)
from flows.incident.approval.form import ApprovalDecision, artifact_key, submit_decision
from flows.incident.flow import IncidentFailed, incident_response, respond
from flows.incident.policy import IncidentPolicy, NodeAction
from flows.incident.report import incident_summary
from flows.incident.stages import AUTO_APPROVER
from flows.incident.wiring import Backends, use_backends
from flows.settings import PolicySettings
from flows.webhook.retry import retry_incident
from flows.webhook.trigger import RecordingTrigger
from recovery.aws import moto_hyperpod
from recovery.aws.hyperpod import HyperPod, sagemaker_client
from recovery.aws.local import LocalAws, create_demo_cluster, start_local_aws
from recovery.checkpoints.store import FileCheckpointStore
from recovery.diagnosis.rerun import RerunRequest, RerunResult, StepRecord
from recovery.jobs import JobKind, JobRef, JobStatus
from recovery.local import LocalJobControl
from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster, NodeState
from recovery.local.nodes import LocalNodeDirectory, LocalNodeOps
from recovery.nodes import ANNOTATION_CORDONED_BY
from recovery.telemetry import FixtureTelemetry, packaged_fixture_root

pytestmark = pytest.mark.usefixtures("prefect_api")

NODES = ["node-0", "node-1", "node-2", "node-3"]
SPARES = ["node-4", "node-5"]
FAULTY = "node-2"
JOB = "job-sdc"
JOB_ARGS = ["--world-size", "4", "--nodes", ",".join(NODES), "--seed", "7", "--audit-mode", "loss"]
STAND_IN = [sys.executable, "-c", "import time; time.sleep(300)"]
ALARM_STEP = 37

FAST = IncidentPolicy(task_retries=2, retry_delay_s=0.0, approval_timeout_s=60)
AUTO = FAST.model_copy(update={"auto_approve": True})


class ScriptedRerunner:
    """Replay nodes reduced to their answers: bitwise equal everywhere, except that a node with
    a persistent fault computes another loss and other weights from ``from_step`` on."""

    def __init__(self, faulty: dict[str, int]) -> None:
        self.faulty = faulty
        self.requests: list[RerunRequest] = []

    def rerun(self, request: RerunRequest) -> RerunResult:
        self.requests.append(request)
        ranks = request.spec.world_size
        bad_from = self.faulty.get(request.node)
        steps = []
        for step in range(request.start, request.end + 1):
            bad = bad_from is not None and step >= bad_from
            steps.append(
                StepRecord(
                    step=step,
                    losses=(9.5 if bad else 1.0 / (step + 1),) * ranks,
                    grad_fingerprints=(f"{step:032x}",) * ranks,
                    weight_fingerprint=("f" if bad else "0") * 32,
                )
            )
        probe = None
        if request.probe_step is not None:
            bad = bad_from is not None and request.probe_step >= bad_from
            probe = {
                "order": ["embed", "head"],
                "kinds": {"embed": "embedding", "head": "linear"},
                "ranks": {"0": {"forward": {"embed": "e", "head": "bad" if bad else "ok"}}},
            }
        return RerunResult(request.node, tuple(steps), probe)


class Crash(BaseException):
    """The flow's process dies: nothing of ours catches it, as nothing survives a SIGKILL."""


@dataclass
class Effects:
    """Side effects that reached the outside systems, and where to crash after one."""

    done: list[tuple[str, str]] = field(default_factory=list)
    crash_after: set[int] = field(default_factory=set)

    def record(self, verb: str, target: str) -> None:
        self.done.append((verb, target))
        if len(self.done) in self.crash_after:
            raise Crash(f"crash after side effect {len(self.done)}: {verb} {target}")


class CountingNodes(LocalNodeOps):
    """The simulated cluster's node API, recording each change it really made."""

    def __init__(self, cluster: LocalCluster, effects: Effects) -> None:
        super().__init__(cluster)
        self.effects = effects

    def cordon(self, node: str, incident_id: str) -> bool:
        done = super().cordon(node, incident_id)
        if done:
            self.effects.record("cordon", node)
        return done

    def taint(self, node: str, incident_id: str) -> bool:
        done = super().taint(node, incident_id)
        if done:
            self.effects.record("taint", node)
        return done

    def uncordon(self, node: str, incident_id: str) -> bool:
        done = super().uncordon(node, incident_id)
        if done:
            self.effects.record("uncordon", node)
        return done


class CountingJobs(LocalJobControl):
    """Local training processes, recording each stop and resume that changed something."""

    def __init__(self, state_dir: Path, effects: Effects) -> None:
        super().__init__(state_dir, command=STAND_IN, stop_timeout_s=5.0)
        self.effects = effects

    def stop(self, job: JobRef) -> Any:
        result = super().stop(job)
        if result.outcome.value == "stopped":
            self.effects.record("stop", job.name)
        return result

    def resume(self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None) -> Any:
        result = super().resume(job, checkpoint_uri, step, nodes)
        if result.outcome.value == "resumed":
            self.effects.record("resume", job.name)
        return result


class CountingHyperPod(HyperPod):
    """HyperPod on moto, recording each replace the service accepted."""

    effects: Effects

    def replace(self, instance_ids: Any) -> Any:
        result = super().replace(instance_ids)
        for instance_id in result.successful:
            self.effects.record("replace", instance_id)
        return result


@dataclass
class Site:
    """One simulated cluster with a training job whose node-2 went bad at step 37."""

    ledger: Ledger
    cluster: LocalCluster
    jobs: CountingJobs
    hyperpod: CountingHyperPod
    store: FileCheckpointStore
    backends: Backends
    effects: Effects
    incident_id: str
    checkpoints: dict[int, Path]
    instance_ids: dict[str, str]
    rerunner: Any

    def run(self, policy: IncidentPolicy = FAST) -> dict[str, Any]:
        with use_backends(self.backends):
            return incident_response(self.incident_id, policy)

    def respond(self, policy: IncidentPolicy = FAST) -> dict[str, Any]:
        with use_backends(self.backends):
            return respond(self.incident_id, policy)

    def incident(self) -> Any:
        return self.ledger.get_incident(self.incident_id)

    def job_record(self) -> dict[str, Any]:
        return dict(json.loads((self.jobs_dir / f"{JOB}.json").read_text()))

    @property
    def jobs_dir(self) -> Path:
        return self.checkpoints[9].parent.parent / "jobs"


@pytest.fixture(scope="module")
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


@pytest.fixture(autouse=True)
def _fast_approval_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _alarm(step: int, nodes: list[str], layer: str = "audit", **detail: Any) -> AlarmIn:
    ranks = [NODES.index(n) if n in NODES else 0 for n in nodes]
    return AlarmIn(
        alarm_id=str(uuid.uuid4()),
        job_id=JOB,
        step=step,
        rank=0,
        node="node-0",
        layer=layer,
        phase="loss",
        suspect_ranks=ranks,
        suspect_nodes=nodes,
        detail=detail or {"partner": 3},
        sent_at=datetime.now(UTC),
    )


def build_site(
    tmp_path: Path,
    ledger: Ledger,
    aws: LocalAws,
    *,
    suspects: list[str] | None = None,
    rerunner: Any = None,
    throttle_retries: bool = False,
    limits: PolicySettings | None = None,
    first_alarm: bool = True,
) -> Site:
    """Seed the ledger with a job (ranks, checkpoints 9/19/29 verified, 39 pending) and one
    incident, and wire local backends around it. ``limits``: the server-side policy limits
    (default: a worker whose operator allows auto-approval, so ``AUTO`` runs may use it).
    ``first_alarm=False``: no alarm and no incident yet (``incident_id`` empty) — the caller's
    alarm opens it."""
    effects = Effects()
    cluster_name = f"sdc-{uuid.uuid4().hex[:8]}"
    names = NODES + SPARES
    ids = create_demo_cluster(aws, cluster_name, len(names))
    instance_ids = dict(zip(names, ids, strict=True))
    cluster = LocalCluster.create(tmp_path / "cluster.json", NODES, SPARES, instance_ids)
    jobs = CountingJobs(tmp_path / "jobs", effects)
    jobs.launch(JOB, JOB_ARGS, tmp_path / "job.log")
    client = sagemaker_client(aws.region, aws.endpoint_url, max_attempts=1, session=aws.session())
    hyperpod = CountingHyperPod(client, cluster_name, poll_interval_s=0.01, wait_timeout_s=30)
    hyperpod.effects = effects
    store = FileCheckpointStore(tmp_path / "store")
    ledger.register_ranks(JOB, [RankIn(r, 0, n, instance_ids[n]) for r, n in enumerate(NODES)])
    checkpoints = {}
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    for step in (9, 19, 29, 39):
        path = ckpt_dir / f"ckpt-{step:06d}.pt"
        path.write_bytes(f"weights after step {step}\n".encode() * 64)
        ledger.record_checkpoint(JOB, step, str(path), _sha256(path), f"{step:032x}", NODES)
        checkpoints[step] = path
        if step < 39:
            ledger.record_audit(JOB, step + 1, "loss", [0, 1, 2, 3], True)
    incident_id = ""
    if first_alarm:
        outcome = ledger.record_alarm(
            _alarm(ALARM_STEP, [FAULTY] if suspects is None else suspects)
        )
        incident_id = outcome.incident_id
    rerunner = rerunner if rerunner is not None else ScriptedRerunner({FAULTY: 33})
    backends = Backends(
        ledger=ledger,
        nodes=CountingNodes(cluster, effects),
        jobs=jobs,
        telemetry=FixtureTelemetry(packaged_fixture_root()),
        rerunner=rerunner,
        hyperpod=hyperpod,
        checkpoints=store,
        directory=LocalNodeDirectory(cluster),
        catalog=LocalJobCatalog(tmp_path / "jobs"),
        description=f"test: {tmp_path}",
        policy_limits=limits or PolicySettings(auto_approve=True),
    )
    return Site(
        ledger=ledger,
        cluster=cluster,
        jobs=jobs,
        hyperpod=hyperpod,
        store=store,
        backends=backends,
        effects=effects,
        incident_id=incident_id,
        checkpoints=checkpoints,
        instance_ids=instance_ids,
        rerunner=rerunner,
    )


@pytest.fixture
def site(tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws) -> Iterator[Site]:
    built = build_site(tmp_path, sqlite_ledger, local_aws)
    yield built
    built.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


class Approver:
    """Answers the approval form of the paused incident run from another thread, as the UI."""

    def __init__(self, incident_id: str, answer: dict[str, Any], timeout_s: float = 90) -> None:
        self.incident_id = incident_id
        self.answer = ApprovalDecision.model_validate(answer)
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.flow_run_id: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Approver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(self.timeout_s)

    def _run(self) -> None:
        try:
            self.flow_run_id = submit_decision(
                self.incident_id, self.answer, timeout_s=self.timeout_s, poll_s=0.2
            )
        except BaseException as err:
            self.error = err


APPROVE = {"decision": "approve", "approver": "alice@example.com", "reason": "replay names node-2"}


def _artifact(key: str) -> str:
    """The newest markdown artifact under ``key`` on the Prefect API."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
        )
    assert found, f"no artifact {key}"
    return str(found[0].data)


def _keys(site: Site) -> list[str]:
    return [a.key for a in site.incident().actions]


def _side_effect_actions(site: Site) -> list[Any]:
    return [a for a in site.incident().actions if a.kind != STAGE_KIND]


def test_approved_incident_is_replaced_resumed_and_resolved(site: Site) -> None:
    with Approver(site.incident_id, APPROVE) as approver:
        summary = site.run()
    assert approver.error is None
    assert approver.flow_run_id is not None

    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED
    assert [e.to_state for e in incident.history if e.from_state != e.to_state] == [
        IncidentState.OPEN,
        IncidentState.STOPPING,
        IncidentState.CORDONED,
        IncidentState.DIAGNOSING,
        IncidentState.AWAITING_APPROVAL,
        IncidentState.REPLACING,
        IncidentState.RESUMING,
        IncidentState.RESOLVED,
    ]
    assert (incident.decision, incident.approver) == ("approve", "alice@example.com")
    assert incident.verdict is not None
    assert incident.verdict.value == "hardware"

    # node-2's instance left; its replacement joined as a new node and the job resumed on it
    records = {r.name: r for r in site.cluster.records()}
    assert records[FAULTY].state is NodeState.GONE
    new_node = records[FAULTY].replaced_by
    assert new_node == "node-6"
    assert records[new_node].state is NodeState.READY
    assert records[new_node].instance_id not in site.instance_ids.values()
    launch = site.job_record()["launches"][-1]
    assert launch["args"][-4:] == [
        "--resume-from",
        str(site.checkpoints[29]),
        "--nodes",
        "node-0,node-1,node-6,node-3",
    ]
    assert site.jobs.status(JobRef(JOB, kind=JobKind.LOCAL)) is JobStatus.RUNNING

    # the pending checkpoint after the range is quarantined, never resumed from
    status = {c.step: c.status for c in site.ledger.list_checkpoints(JOB)}
    assert status == {
        9: CheckpointStatus.VERIFIED,
        19: CheckpointStatus.VERIFIED,
        29: CheckpointStatus.VERIFIED,
        39: CheckpointStatus.QUARANTINED,
    }

    assert sorted(site.effects.done) == sorted(
        [
            ("stop", JOB),
            ("cordon", FAULTY),
            ("taint", FAULTY),
            ("replace", "workers-2"),
            ("resume", JOB),
        ]
    )
    assert all(a.status is ActionStatus.SUCCEEDED for a in incident.actions)
    assert summary == incident_summary(incident)
    assert summary["suspect_range"] == [30 + 1, ALARM_STEP]
    assert summary["suspect_nodes"] == [FAULTY]
    assert summary["verdict"] == "hardware"
    assert summary["approval"]["decision"] == "approve"
    assert summary["replaced"] == [
        {
            "node": FAULTY,
            "instance_id": "workers-2",
            "new_instance_id": records[new_node].instance_id,
            "new_node": new_node,
        }
    ]
    assert summary["resumed_from_step"] == 29
    assert [s["name"] for s in summary["stages"]] == [
        "triage",
        "stop",
        "cordon",
        "telemetry",
        "replay",
        "approval",
        "replace",
        "quarantine",
        "resume",
    ]
    assert all(s["status"] == "completed" and s["start"] <= s["end"] for s in summary["stages"])

    evidence = _artifact(artifact_key(site.incident_id, "evidence"))
    for text in (
        "## Verdict",
        "**hardware** on `node-2`",
        "## Telemetry",
        "## Roll-back",
        "currently step 29",
        "Replace `node-2`",
    ):
        assert text in evidence
    report = _artifact(artifact_key(site.incident_id, "report"))
    for text in (
        "resolved",
        "## Timeline",
        "| replace | succeeded",
        "alice@example.com",
        "Resumed from the verified checkpoint at step 29",
        "8 step(s) rolled back",
    ):
        assert text in report


@pytest.mark.parametrize("uncordon", [False, True])
def test_rejected_incident_replaces_nothing_and_uncordons_only_when_asked(
    site: Site, uncordon: bool
) -> None:
    answer = {
        "decision": "reject",
        "approver": "bob",
        "reason": "known flaky audit",
        "uncordon_on_reject": uncordon,
    }
    with Approver(site.incident_id, answer) as approver:
        summary = site.run()
    assert approver.error is None

    incident = site.incident()
    assert incident.state is IncidentState.REJECTED
    assert (incident.decision, incident.approver, incident.approval_reason) == (
        "reject",
        "bob",
        "known flaky audit",
    )
    node = site.cluster.node(FAULTY)
    assert node.unschedulable is not uncordon
    assert (ANNOTATION_CORDONED_BY in node.annotations) is not uncordon
    assert ("replace", "workers-2") not in site.effects.done
    assert (("uncordon", FAULTY) in site.effects.done) is uncordon
    assert summary["replaced"] == []
    assert summary["resumed_from_step"] is None
    assert "replace" not in [s["name"] for s in summary["stages"]]


def test_no_decision_in_time_expires_and_leaves_the_node_cordoned(site: Site) -> None:
    policy = FAST.model_copy(update={"approval_timeout_s": 1})
    summary = site.respond(policy)

    incident = site.incident()
    assert incident.state is IncidentState.EXPIRED
    assert incident.decision == "expire"
    assert "no decision within 1 s" in (incident.reason or "")
    assert "nodes stay cordoned" in (incident.reason or "")
    assert site.cluster.node(FAULTY).unschedulable
    assert [v for v, _ in site.effects.done] == ["stop", "cordon", "taint"]
    assert summary["state"] == "expired"
    assert summary["replaced"] == []


def test_auto_approval_takes_a_hardware_verdict_and_a_rerun_of_the_closed_incident_changes_nothing(
    site: Site,
) -> None:
    """One run read twice (a run costs seconds): the policy's approval, then a re-run."""
    summary = site.run(AUTO)

    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED
    assert incident.approver == "policy:auto-approve"
    assert "ring audit" in (incident.approval_reason or "")
    assert summary["resumed_from_step"] == 29

    before = (site.incident().to_dict(), list(site.effects.done))
    again = site.run(AUTO)
    assert (site.incident().to_dict(), list(site.effects.done)) == before
    assert again["state"] == "resolved"


def test_a_run_parameter_cannot_turn_on_auto_approval_the_server_forbids(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws
) -> None:
    # the worker's SDCGUARD_POLICY_AUTO_APPROVE is off (the default); the run asks for it anyway
    site = build_site(tmp_path, sqlite_ledger, local_aws, limits=PolicySettings())
    summary = site.respond(AUTO.model_copy(update={"approval_timeout_s": 1}))

    incident = site.incident()
    assert incident.state is IncidentState.EXPIRED
    assert incident.approver is None
    assert incident.decision == "expire"
    assert summary["replaced"] == []
    assert "replace" not in [v for v, _ in site.effects.done]
    assert site.cluster.node(FAULTY).unschedulable


def test_storm_guard_refuses_auto_approval_and_waits_for_a_human(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws
) -> None:
    site = build_site(tmp_path, sqlite_ledger, local_aws, suspects=["node-1", "node-2", "node-3"])
    try:
        policy = AUTO.model_copy(update={"approval_timeout_s": 1})
        site.respond(policy)
        incident = site.incident()
        assert incident.storm
        assert "alarm storm" in (incident.storm_reason or "")
        assert "3 of the job's 4 nodes" in (incident.storm_reason or "")
        # a human was asked (the pause expired), nothing was cordoned or replaced
        assert incident.state is IncidentState.EXPIRED
        assert incident.approver is None
        assert [v for v, _ in site.effects.done] == ["stop"]
        assert not any(site.cluster.node(n).unschedulable for n in NODES)
        assert incident.verdict is not None  # the replay still ran: evidence for the human
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


class AlarmingRerunner(ScriptedRerunner):
    """The scripted replay, while more of the job's nodes raise alarms during the diagnosis."""

    def __init__(self, faulty: dict[str, int], ledger: Ledger, late: list[str]) -> None:
        super().__init__(faulty)
        self.ledger = ledger
        self.late = late

    def rerun(self, request: RerunRequest) -> RerunResult:
        if not self.requests:
            self.ledger.record_alarm(_alarm(ALARM_STEP + 1, self.late))
        return super().rerun(request)


def test_alarms_arriving_during_diagnosis_make_a_storm_before_auto_approval(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws
) -> None:
    rerunner = AlarmingRerunner({FAULTY: 33}, sqlite_ledger, ["node-0", "node-1"])
    site = build_site(tmp_path, sqlite_ledger, local_aws, rerunner=rerunner)
    try:
        site.respond(AUTO.model_copy(update={"approval_timeout_s": 1}))
        incident = site.incident()
        # triage saw one node (no storm: node-2 was cordoned); the approval saw three of four
        assert incident.storm
        assert "3 of the job's 4 nodes" in (incident.storm_reason or "")
        assert incident.state is IncidentState.EXPIRED
        assert incident.approver is None
        assert [v for v, _ in site.effects.done] == ["stop", "cordon", "taint"]
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


@pytest.mark.parametrize("late_alarms", [True, False])
def test_the_storm_guard_runs_again_before_the_fix_and_withdraws_an_automatic_approval(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws, late_alarms: bool
) -> None:
    """A run is auto-approved, then stopped before the fix (a zombie holds the fix stage);
    alarms on two more nodes arrive before the next run reaches the fix."""
    site = build_site(tmp_path, sqlite_ledger, local_aws)
    zombie = "flow-run-zombie"
    claim = site.ledger.claim_action(
        site.incident_id, STAGE_KIND, "replace", owner=zombie, lease_s=3600
    )
    try:
        with pytest.raises(ClaimLost):
            site.run(AUTO)
        assert site.incident().approver == "policy:auto-approve"
        assert site.incident().state is IncidentState.AWAITING_APPROVAL
        if late_alarms:
            site.ledger.record_alarm(_alarm(ALARM_STEP + 1, ["node-0", "node-1"]))
        site.ledger.finish_action(
            claim.action.key, ActionStatus.FAILED, {"outcome": "zombie gone"}, owner=zombie
        )

        summary = site.respond(AUTO.model_copy(update={"approval_timeout_s": 1}))

        incident = site.incident()
        if not late_alarms:  # the clean run: the policy's approval stands, node-2 is replaced
            assert incident.state is IncidentState.RESOLVED
            assert [r["node"] for r in summary["replaced"]] == [FAULTY]
            return
        assert incident.storm
        assert "3 of the job's 4 nodes" in (incident.storm_reason or "")
        (withdrawn,) = [e for e in incident.history if (e.detail or {}).get("withdrawn")]
        assert "automatic approval withdrawn before the fix" in (withdrawn.reason or "")
        assert withdrawn.detail == {
            "withdrawn": {"decision": "approve", "approver": AUTO_APPROVER, "nodes": [FAULTY]},
            "by": "storm guard",
        }
        assert withdrawn.to_state is IncidentState.AWAITING_APPROVAL
        # the trail reads as it happened: withdrawn, then a human asked; no retry, one expiry
        assert not any((e.detail or {}).get("retry") for e in incident.history)
        assert [e.to_state for e in incident.history].count(IncidentState.EXPIRED) == 1
        # a human was asked (and did not answer in time): nothing was replaced
        assert incident.state is IncidentState.EXPIRED
        assert incident.approver is None
        assert summary["replaced"] == []
        assert "replace" not in [v for v, _ in site.effects.done]
        assert site.cluster.node(FAULTY).unschedulable
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_approving_one_of_two_suspects_replaces_exactly_that_one(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws
) -> None:
    """The replay names nobody, so both suspects are put to the approver; only one is approved."""
    site = build_site(
        tmp_path,
        sqlite_ledger,
        local_aws,
        suspects=["node-1", FAULTY],
        rerunner=ScriptedRerunner({}),
    )
    replaces_before = moto_hyperpod.call_count("BatchReplaceClusterNodes")
    answer = {**APPROVE, "nodes": [FAULTY]}
    try:
        with Approver(site.incident_id, answer) as approver:
            summary = site.respond(FAST.model_copy(update={"storm_node_share": 1.0}))
        assert approver.error is None
        incident = site.incident()
        assert summary["state"] == "resolved", incident.reason
        assert (incident.evidence or {})["approval_request"]["nodes"] == ["node-1", FAULTY]
        assert (incident.evidence or {})["approval"]["nodes"] == [FAULTY]
        states = {r.name: r.state for r in site.cluster.records()}
        assert states[FAULTY] is NodeState.GONE
        assert states["node-1"] is not NodeState.GONE
        assert not site.cluster.node("node-1").unschedulable  # not approved: back to work
        assert moto_hyperpod.call_count("BatchReplaceClusterNodes") - replaces_before == 1
        assert [t for v, t in site.effects.done if v == "replace"] == [site.instance_ids[FAULTY]]
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_a_culprit_unknown_alarm_cordons_nothing_and_asks_a_human(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws
) -> None:
    """Two replicas differ and neither is named: the reporter (node-0) is no suspect either."""
    site = build_site(tmp_path, sqlite_ledger, local_aws, suspects=[])
    try:
        site.respond(AUTO.model_copy(update={"approval_timeout_s": 1}))
        incident = site.incident()
        assert (incident.evidence or {}).get("culprit_unknown") is True
        assert not any(site.cluster.node(n).unschedulable for n in NODES + SPARES)
        assert [v for v, _ in site.effects.done] == ["stop"]  # stopped, nothing cordoned
        assert incident.state is IncidentState.EXPIRED  # auto-approve refused; a human asked
        assert incident.approver is None
        assert (incident.evidence or {})["approval_request"]["nodes"] == []
        cordon = next(a for a in incident.actions if a.target == "cordon")
        assert "culprit unknown" in str((cordon.detail or {}).get("outcome"))
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_a_crash_after_any_side_effect_is_continued_by_a_rerun_exactly_once(site: Site) -> None:
    replaces_before = moto_hyperpod.call_count("BatchReplaceClusterNodes")
    site.effects.crash_after = {1, 2, 3, 4, 5}
    crashes = 0
    for _ in range(6):
        try:
            site.run(AUTO)
        except Crash:
            crashes += 1
            continue
        break
    assert crashes == 5

    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED
    assert sorted(site.effects.done) == sorted(
        [
            ("stop", JOB),
            ("cordon", FAULTY),
            ("taint", FAULTY),
            ("replace", "workers-2"),
            ("resume", JOB),
        ]
    )
    assert moto_hyperpod.call_count("BatchReplaceClusterNodes") - replaces_before == 1
    keys = _keys(site)
    assert len(keys) == len(set(keys))
    assert all(a.status is ActionStatus.SUCCEEDED for a in incident.actions)
    claims = [
        e.action_key
        for e in site.ledger.action_events(site.incident_id)
        if e.status is ActionStatus.CLAIMED
    ]
    side_effects = {a.key for a in _side_effect_actions(site)}
    assert {k for k in claims if k in side_effects} == side_effects
    # each crash released the claim it interrupted: recorded, named, and continued next run
    interrupted = [
        e
        for e in site.ledger.action_events(site.incident_id)
        if e.status is ActionStatus.FAILED and (e.detail or {}).get("interrupted") == "Crash"
    ]
    assert len(interrupted) >= crashes
    assert len(site.job_record()["launches"]) == 2  # the original run and one resume


def test_a_temporary_error_is_retried_and_recovers(site: Site) -> None:
    moto_hyperpod.inject_throttling("BatchReplaceClusterNodes", 1)
    summary = site.run(AUTO)

    assert summary["state"] == "resolved"
    replace = next(a for a in site.incident().actions if a.kind == "replace")
    assert replace.attempts == 2
    assert replace.status is ActionStatus.SUCCEEDED


def test_an_action_failing_after_its_retries_fails_the_incident_and_a_retry_resolves_it(
    site: Site,
) -> None:
    moto_hyperpod.inject_throttling("BatchReplaceClusterNodes", FAST.task_retries + 1)
    with pytest.raises(IncidentFailed) as failed:
        site.run(AUTO)
    moto_hyperpod.inject_throttling("BatchReplaceClusterNodes", 0)

    incident = site.incident()
    assert incident.state is IncidentState.FAILED
    assert "ThrottledError" in (incident.reason or "")
    assert failed.value.summary["state"] == "failed"
    replace = next(a for a in incident.actions if a.kind == "replace")
    assert replace.status is ActionStatus.FAILED
    assert replace.attempts == FAST.task_retries + 1
    assert site.cluster.node(FAULTY).unschedulable  # nothing was undone or replaced
    assert ("resume", JOB) not in site.effects.done

    # the operator retries once the throttling is over: the ledger reopens it where it failed
    trigger = RecordingTrigger()
    reopened = retry_incident(site.ledger, trigger, site.incident_id, by="oncall", reason="blip")
    assert reopened.state is IncidentState.REPLACING
    assert trigger.calls == [(site.incident_id, JOB)]
    assert site.run(AUTO)["state"] == "resolved"
    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED
    retried = [e for e in incident.history if (e.detail or {}).get("retry")]
    assert [(e.from_state, e.to_state, e.detail) for e in retried] == [
        (IncidentState.FAILED, IncidentState.REPLACING, {"retry": 1, "by": "oncall"})
    ]
    assert [v for v, _ in site.effects.done].count("replace") == 1
    assert ("resume", JOB) in site.effects.done
    # resolved is final: a second retry is refused
    with pytest.raises(IllegalTransition):
        retry_incident(site.ledger, trigger, site.incident_id, by="oncall", reason="again")


def test_a_corrupt_newest_checkpoint_is_marked_and_the_next_older_one_is_used(site: Site) -> None:
    site.checkpoints[29].write_bytes(b"bit rot")
    summary = site.run(AUTO)

    by_step = {c.step: c for c in site.ledger.list_checkpoints(JOB)}
    assert by_step[29].status is CheckpointStatus.CORRUPT
    assert "sha256" in (by_step[29].reason or "")
    assert by_step[39].status is CheckpointStatus.QUARANTINED
    assert summary["resumed_from_step"] == 19
    assert summary["resumed_checkpoint"] == str(site.checkpoints[19])
    launch = site.job_record()["launches"][-1]
    assert str(site.checkpoints[19]) in launch["args"]


class CrashingOnce:
    """Wraps a telemetry collector or replay runner: the first call answers, then the process
    dies — inside a stage that changes nothing outside, before the stage is recorded done."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner = inner
        self.method = method
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            result = real(*args, **kwargs)
            if self.calls == 1:
                raise Crash(f"crash after {name}")
            return result

        return call


def test_a_crash_inside_a_read_only_stage_is_continued_by_a_rerun(site: Site) -> None:
    """The telemetry stage dies, then (next run) the replay stage: each is continued."""
    wrapped = {
        "telemetry": CrashingOnce(site.backends.telemetry, "collect"),
        "replay": CrashingOnce(site.backends.rerunner, "rerun"),
    }
    site.backends = dataclasses.replace(
        site.backends, telemetry=wrapped["telemetry"], rerunner=wrapped["replay"]
    )
    for stage in ("telemetry", "replay"):
        with pytest.raises(Crash):
            site.run(AUTO)
        stuck = next(a for a in site.incident().actions if a.key.endswith(f":stage:{stage}"))
        # the signal passed every `except Exception`, and the stage was released on its way out
        assert stuck.status is ActionStatus.FAILED
        assert (stuck.detail or {}).get("interrupted") == "Crash"

    summary = site.run(AUTO)
    assert summary["state"] == "resolved"
    assert all(w.calls > 1 for w in wrapped.values())
    keys = _keys(site)
    assert len(keys) == len(set(keys))
    assert sorted(site.effects.done) == sorted(
        [
            ("stop", JOB),
            ("cordon", FAULTY),
            ("taint", FAULTY),
            ("replace", "workers-2"),
            ("resume", JOB),
        ]
    )


def test_reboot_policy_reboots_in_place_uncordons_and_resumes_on_the_same_nodes(
    site: Site,
) -> None:
    reboots_before = moto_hyperpod.call_count("BatchRebootClusterNodes")
    summary = site.run(AUTO.model_copy(update={"action": NodeAction.REBOOT}))

    assert summary["state"] == "resolved"
    assert summary["replaced"] == []
    assert summary["rebooted"] == [{"node": FAULTY, "instance_id": "workers-2"}]
    assert moto_hyperpod.call_count("BatchRebootClusterNodes") - reboots_before == 1
    node = site.cluster.node(FAULTY)
    assert not node.unschedulable
    assert node.instance_id == "workers-2"
    assert ("uncordon", FAULTY) in site.effects.done
    launch = site.job_record()["launches"][-1]
    assert launch["args"][-2:] == ["--nodes", ",".join(NODES)]
