"""Two incidents at once: the second is contained while the first is replacing.

Containment (stop, cordon, telemetry) never waits for another incident; only the destructive
stages are serialised by the global limit ``sdcguard-destructive``
(:mod:`flows.incident.coordination`). Incident A's flow is held inside its replacement — holding
the slot — until incident B's node is cordoned; no sleeps: events say where each flow is. Both jobs
share one fleet (one simulated cluster, one HyperPod cluster in moto), as two jobs of one cluster
do.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from db import AlarmIn, IncidentState, Ledger, RankIn
from flows.incident.flow import incident_response
from flows.incident.wiring import Backends, use_backends
from flows.settings import PolicySettings
from recovery.aws.hyperpod import sagemaker_client
from recovery.aws.local import LocalAws, create_demo_cluster, start_local_aws
from recovery.checkpoints.store import FileCheckpointStore
from recovery.jobs import JobKind, JobRef
from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster
from recovery.local.nodes import LocalNodeDirectory
from recovery.telemetry import FixtureTelemetry, packaged_fixture_root
from tests.flows.test_incident import (
    AUTO,
    CountingHyperPod,
    CountingJobs,
    CountingNodes,
    Effects,
    ScriptedRerunner,
)

pytestmark = pytest.mark.usefixtures("prefect_api")

JOBS = {
    "job-a": (["node-0", "node-1", "node-2", "node-3"], "node-2"),
    "job-b": (["node-4", "node-5", "node-6", "node-7"], "node-5"),
}
SPARES = ["node-8", "node-9"]
WAIT_S = 120.0  # a bound on each wait for the other flow, never a pace


class Timeline:
    """Where each flow is: ordered marks, and events to wait on."""

    def __init__(self) -> None:
        self.marks: list[str] = []
        self.events = {name: threading.Event() for name in ("a-replacing", "b-cordoned")}
        self._lock = threading.Lock()

    def mark(self, what: str) -> None:
        with self._lock:
            self.marks.append(what)
        if what in self.events:
            self.events[what].set()


class HeldHyperPod(CountingHyperPod):
    """Incident A's replacement waits (slot held) until incident B's node is cordoned."""

    timeline: Timeline
    held: str

    def wait_replaced(self, instance_id: str, group: str, **kwargs: Any) -> str:
        if instance_id == self.held:
            self.timeline.mark("a-replacing")
            assert self.timeline.events["b-cordoned"].wait(WAIT_S), "B was not cordoned"
        new = super().wait_replaced(instance_id, group, **kwargs)
        self.timeline.mark(f"replaced {instance_id}")
        return new


class MarkingNodes(CountingNodes):
    """The node API, marking B's cordon and what A's incident was doing at that moment."""

    timeline: Timeline
    ledger: Ledger
    incident_a: str

    def cordon(self, node: str, incident_id: str) -> bool:
        done = super().cordon(node, incident_id)
        if node == JOBS["job-b"][1]:
            state = self.ledger.get_incident(self.incident_a).state
            self.timeline.mark(f"b-cordoned while A {state.value}")
            self.timeline.mark("b-cordoned")
        return done


def _alarm(job: str, nodes: list[str], suspect: str) -> AlarmIn:
    return AlarmIn(
        alarm_id=str(uuid.uuid4()),
        job_id=job,
        step=37,
        rank=0,
        node=nodes[0],
        layer="audit",
        phase="loss",
        suspect_ranks=[nodes.index(suspect)],
        suspect_nodes=[suspect],
        detail={"partner": 3},
        sent_at=datetime.now(UTC),
    )


def _seed_job(ledger: Ledger, job: str, nodes: list[str], ids: dict[str, str], root: Path) -> str:
    """Ranks, verified checkpoints 9/19/29, the alarm that opens the job's incident."""
    ledger.register_ranks(job, [RankIn(r, 0, n, ids[n]) for r, n in enumerate(nodes)])
    for step in (9, 19, 29):
        path = root / f"{job}-ckpt-{step:06d}.pt"
        path.write_bytes(f"{job} after step {step}\n".encode() * 64)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        ledger.record_checkpoint(job, step, str(path), digest, f"{step:032x}", nodes)
        ledger.record_audit(job, step + 1, "loss", list(range(len(nodes))), True)
    return ledger.record_alarm(_alarm(job, nodes, JOBS[job][1])).incident_id


@pytest.fixture
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


def test_the_second_incident_is_cordoned_while_the_first_replaces(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")
    ledger = sqlite_ledger
    names = [n for nodes, _ in JOBS.values() for n in nodes] + SPARES
    cluster_name = f"sdc-{uuid.uuid4().hex[:8]}"
    ids = dict(zip(names, create_demo_cluster(local_aws, cluster_name, len(names)), strict=True))
    cluster = LocalCluster.create(tmp_path / "cluster.json", names[:-2], SPARES, ids)
    effects = Effects()
    timeline = Timeline()
    jobs = CountingJobs(tmp_path / "jobs", effects)
    (tmp_path / "ckpt").mkdir()
    incidents = {}
    for job, (nodes, _) in JOBS.items():
        args = ["--world-size", "4", "--nodes", ",".join(nodes), "--seed", "7"]
        jobs.launch(job, [*args, "--audit-mode", "loss"], tmp_path / f"{job}.log")
        incidents[job] = _seed_job(ledger, job, nodes, ids, tmp_path / "ckpt")
    client = sagemaker_client(
        local_aws.region, local_aws.endpoint_url, max_attempts=1, session=local_aws.session()
    )
    hyperpod = HeldHyperPod(client, cluster_name, poll_interval_s=0.01, wait_timeout_s=30)
    hyperpod.effects, hyperpod.timeline, hyperpod.held = effects, timeline, ids["node-2"]
    node_ops = MarkingNodes(cluster, effects)
    node_ops.timeline, node_ops.ledger, node_ops.incident_a = timeline, ledger, incidents["job-a"]
    backends = Backends(
        ledger=ledger,
        nodes=node_ops,
        jobs=jobs,
        telemetry=FixtureTelemetry(packaged_fixture_root()),
        rerunner=ScriptedRerunner({"node-2": 33, "node-5": 33}),
        hyperpod=hyperpod,
        checkpoints=FileCheckpointStore(tmp_path / "store"),
        directory=LocalNodeDirectory(cluster),
        catalog=LocalJobCatalog(tmp_path / "jobs"),
        description=f"two jobs: {tmp_path}",
        policy_limits=PolicySettings(auto_approve=True),
    )
    outcome: dict[str, Any] = {}

    def run_a() -> None:
        try:
            outcome["a"] = incident_response(incidents["job-a"], AUTO)
        except BaseException as err:  # reported below, in the test's thread
            outcome["a"] = err
            timeline.events["a-replacing"].set()

    try:
        with use_backends(backends):
            first = threading.Thread(target=run_a, name="incident-a", daemon=True)
            first.start()
            assert timeline.events["a-replacing"].wait(WAIT_S), "A never reached its replace"
            assert not isinstance(outcome.get("a"), BaseException), outcome.get("a")
            summary_b = incident_response(incidents["job-b"], AUTO)
            first.join(WAIT_S)
        assert not first.is_alive()
        summary_a = outcome["a"]
        assert not isinstance(summary_a, BaseException), summary_a
    finally:
        for job in JOBS:
            jobs.stop(JobRef(job, kind=JobKind.LOCAL))

    # B was stopped and cordoned while A held the destructive slot, inside its replacement
    assert "b-cordoned while A replacing" in timeline.marks
    marks = timeline.marks
    assert marks.index("a-replacing") < marks.index("b-cordoned")
    assert marks.index("b-cordoned") < marks.index(f"replaced {ids['node-2']}")
    # and B's own replacement waited for A's slot: one fleet change at a time
    assert marks.index(f"replaced {ids['node-2']}") < marks.index(f"replaced {ids['node-5']}")
    assert ("stop", "job-b") in effects.done
    for summary, node in ((summary_a, "node-2"), (summary_b, "node-5")):
        assert summary["state"] == IncidentState.RESOLVED.value
        assert [r["node"] for r in summary["replaced"]] == [node]
    new_a, new_b = summary_a["replaced"][0], summary_b["replaced"][0]
    assert new_a["new_instance_id"] != new_b["new_instance_id"]
