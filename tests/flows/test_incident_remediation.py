"""One incident end to end for each remediation backend other than HyperPod.

The site is that of :mod:`tests.flows.test_incident` (a real Prefect API, a SQLite ledger, the
job as local processes, HyperPod on moto for the wiring that still names it), with the nodes on
the HTTP-level fake Kubernetes API: cordon, drain, delete and the ``ExternalFault`` go through
the official client to the wire, and a fake autoscaler / NVSentinel answers as the real ones.
Each backend's incident ends ``resolved`` (``isolate``: handed to a human); a crash right after
the remediation was asked for converges on a re-run without a second one; the nodes the alarm
did not accuse see no write. The simulated cluster's counterparts (what ``sdcguard demo`` uses)
run the same incident last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from db import ActionStatus, IncidentState, Ledger
from flows.incident.approval.form import artifact_key
from flows.incident.stages.handover import HAND_OVER_EVIDENCE
from recovery.isolation import IsolateRemediation
from recovery.jobs import JobKind, JobRef
from recovery.kube.client import api_client_for_host
from recovery.kube.nodes import KubeNodeDirectory, KubeNodeOps
from recovery.kube.nvsentinel import NVSentinelRemediation
from recovery.kube.remediation import KubeReplaceRemediation
from recovery.local.remediation import (
    ANNOTATION_EXTERNAL_FAULT,
    LocalFaultRemediation,
    LocalReplaceRemediation,
)
from recovery.nodes import ANNOTATION_CORDONED_BY, LABEL_ISOLATED, TAINT_KEY
from recovery.remediation import Remediation
from tests.flows.test_incident import (
    APPROVE,
    AUTO,
    FAULTY,
    JOB,
    NODES,
    SPARES,
    Approver,
    Crash,
    Site,
    _artifact,
    build_site,
)
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_remediators import EXTERNAL_FAULT_PREFIX, FakeAutoscaler, FakeNVSentinel

pytestmark = pytest.mark.usefixtures("prefect_api")

POOL = {"karpenter.sh/nodepool": "gpu"}


def _no_sleep(_: float) -> None:
    pass


@pytest.fixture(autouse=True)
def _fast_approval_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")


@dataclasses.dataclass
class KubeSite:
    site: Site
    fake: FakeKube
    client: k8s.ApiClient

    def wire(self, make: Callable[[k8s.ApiClient, KubeNodeOps], Remediation]) -> None:
        nodes = KubeNodeOps(self.client, eviction_retries=1, sleep=_no_sleep)
        self.site.backends = dataclasses.replace(
            self.site.backends,
            nodes=nodes,
            directory=KubeNodeDirectory(nodes, SPARES, poll_s=0.01),
            remediation=make(self.client, nodes),
        )

    def writes_to_unaccused(self) -> list[str]:
        """Writes that reached any node but the accused one, or the pods of another node."""
        return [
            f"{r.method} {r.path}"
            for r in self.fake.requests
            if r.method != "GET"
            and ("/nodes/" in r.path or "/pods/" in r.path)
            and not r.path.endswith(f"/nodes/{FAULTY}")
            and "trainer-2" not in r.path
        ]


@pytest.fixture
def kube_site(tmp_path: Path, sqlite_ledger: Ledger, local_aws: Any) -> Iterator[KubeSite]:
    site = build_site(tmp_path, sqlite_ledger, local_aws)
    with FakeKube() as fake:
        for name in NODES + SPARES:
            fake.add_node(name, labels=POOL)
        fake.add_pod("trainer-2", namespace="training", node=FAULTY)
        fake.add_pod("trainer-1", namespace="training", node="node-1")
        client = api_client_for_host(fake.url, token="test-token")
        try:
            yield KubeSite(site, fake, client)
        finally:
            client.close()
            site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


@pytest.fixture(scope="module")
def local_aws() -> Iterator[Any]:
    from recovery.aws.local import start_local_aws

    with start_local_aws() as aws:
        yield aws


def _resumed_on(site: Site) -> list[str]:
    args = site.job_record()["launches"][-1]["args"]
    return str(args[args.index("--nodes") + 1]).split(",")


class CrashingReplace(KubeReplaceRemediation):
    """The flow's process dies right after the Node was deleted, once."""

    crashed = False

    def start(self, plan: Any, *, first: bool) -> None:
        super().start(plan, first=first)
        if not CrashingReplace.crashed:
            CrashingReplace.crashed = True
            raise Crash("crash right after the delete")


def test_kubernetes_deletes_the_node_once_resumes_on_the_new_one_even_after_a_crash(
    kube_site: KubeSite,
) -> None:
    autoscaler = FakeAutoscaler(kube_site.fake)
    kube_site.wire(lambda c, n: CrashingReplace(c, n, poll_s=0.01, sleep=_no_sleep))
    with pytest.raises(Crash):
        kube_site.site.run(AUTO)
    summary = kube_site.site.run(AUTO)  # a re-run: the plan from the ledger, the node gone

    incident = kube_site.site.incident()
    assert incident.state is IncidentState.RESOLVED, incident.reason
    assert [r.path for r in kube_site.fake.requests_to("DELETE", "/nodes/")] == [
        f"/api/v1/nodes/{FAULTY}"
    ]
    assert kube_site.fake.pod("trainer-2", "training") is None  # drained first
    (replaced,) = summary["replaced"]
    assert (replaced["node"], replaced["new_node"]) == (FAULTY, autoscaler.joined[0])
    assert _resumed_on(kube_site.site) == [
        autoscaler.joined[0] if n == FAULTY else n for n in NODES
    ]
    replace = next(a for a in incident.actions if a.kind == "replace")
    assert (replace.status, replace.attempts) == (ActionStatus.SUCCEEDED, 2)
    assert kube_site.writes_to_unaccused() == []


def test_nvsentinel_fault_is_followed_node_restored_and_fault_deleted_on_resolve(
    kube_site: KubeSite,
) -> None:
    sentinel = FakeNVSentinel(kube_site.fake)
    kube_site.wire(lambda c, n: NVSentinelRemediation(c, poll_s=0.01, sleep=_no_sleep))

    with Approver(kube_site.site.incident_id, APPROVE) as approver:  # a human, in the form
        summary = kube_site.site.run()
    assert approver.error is None

    incident = kube_site.site.incident()
    assert incident.state is IncidentState.RESOLVED, incident.reason
    evidence = _artifact(artifact_key(kube_site.site.incident_id, "evidence"))
    assert "**Remediation backend: `nvsentinel`.** Replace `node-2`" in evidence
    assert "NVSentinel ExternalFault (REPLACE_VM)" in evidence
    assert summary["replaced"] == []
    assert len(sentinel.created) == 1
    assert kube_site.fake.list_objects(EXTERNAL_FAULT_PREFIX, "externalfaults") == []
    node = kube_site.fake.node(FAULTY)
    assert not node["spec"].get("unschedulable")  # our cordon lifted: back in service
    assert ANNOTATION_CORDONED_BY not in node["metadata"]["annotations"]
    assert _resumed_on(kube_site.site) == NODES
    kinds = [a.kind for a in incident.actions if a.status is ActionStatus.SUCCEEDED]
    assert "clear-remediation" in kinds
    assert kube_site.writes_to_unaccused() == []


def test_isolate_keeps_the_node_out_of_service_and_hands_the_incident_to_a_human(
    kube_site: KubeSite,
) -> None:
    kube_site.wire(lambda c, n: IsolateRemediation(n))

    summary = kube_site.site.run(AUTO)

    incident = kube_site.site.incident()
    assert incident.state is IncidentState.RESOLVED
    assert "handed to a human" in (incident.reason or "")
    hand_over = (incident.evidence or {})[HAND_OVER_EVIDENCE]
    assert hand_over["isolated"] == [FAULTY]
    assert hand_over["resume_from_step"] == 29
    node = kube_site.fake.node(FAULTY)
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["labels"][LABEL_ISOLATED] == kube_site.site.incident_id
    assert any(t["key"] == TAINT_KEY for t in node["spec"]["taints"])
    assert summary["replaced"] == []
    assert summary["resumed_from_step"] is None
    assert "resume" not in {a.kind for a in incident.actions}  # training stays stopped
    assert kube_site.fake.pod("trainer-2", "training") is not None  # untouched for forensics
    assert kube_site.fake.requests_to("DELETE", "/nodes/") == []
    assert kube_site.writes_to_unaccused() == []


@pytest.mark.parametrize("backend", ["kubernetes", "nvsentinel"])
def test_the_simulated_clusters_counterparts_resolve_the_same_incident(
    tmp_path: Path, sqlite_ledger: Ledger, local_aws: Any, backend: str
) -> None:
    site = build_site(tmp_path, sqlite_ledger, local_aws)
    make = LocalReplaceRemediation if backend == "kubernetes" else LocalFaultRemediation
    site.backends = dataclasses.replace(site.backends, remediation=make(site.cluster))
    try:
        summary = site.run(AUTO)
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))

    assert site.incident().state is IncidentState.RESOLVED
    untouched = [n for n in NODES if n != FAULTY]
    assert all(not site.cluster.node(n).unschedulable for n in untouched)
    if backend == "kubernetes":
        (replaced,) = summary["replaced"]
        assert site.cluster.node(replaced["new_node"]).ready
        assert _resumed_on(site)[NODES.index(FAULTY)] == replaced["new_node"]
    else:
        node = site.cluster.node(FAULTY)
        assert not node.unschedulable
        assert ANNOTATION_EXTERNAL_FAULT not in node.annotations  # released on resolve
        assert _resumed_on(site) == NODES
