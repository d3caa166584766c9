"""Real-mode job control at the wire: the job is found by its identity label, a stop is done
only when its pods are gone, and what cannot be stopped goes to a human (typed errors)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from recovery.errors import NotFoundError, PermanentError, TemporaryError
from recovery.jobs import JobKind, JobRef, StopOutcome
from recovery.kube.jobs import (
    JOB_ID_LABEL,
    AmbiguousJobError,
    JobNotFoundError,
    KubeJobFinder,
    KubeJobs,
    PyTorchJobControl,
    UnsupportedJobKind,
)
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_kubelet import FakeKubelet

NS = "training"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def kubelet(fake_kube: FakeKube, tmp_path: Path) -> Iterator[FakeKubelet]:
    kubelet = FakeKubelet(fake_kube, tmp_path, default_nodes=["node-a", "node-b"]).start()
    yield kubelet
    kubelet.stop()


def _label(fake: FakeKube, plural: str, name: str, job_id: str, **labels: str) -> None:
    prefix = "/apis/batch/v1" if plural == "jobs" else "/apis/kubeflow.org/v1"
    fake.mutate(
        prefix,
        plural,
        name,
        lambda o: o["metadata"].setdefault("labels", {}).update({JOB_ID_LABEL: job_id, **labels}),
        namespace=NS,
    )


def _pytorchjob(fake: FakeKube, name: str, job_id: str) -> None:
    container = {"name": "pytorch", "image": "train:1", "command": SLEEPER}
    fake.add_pytorchjob(
        name, namespace=NS, replicas={"Master": 1, "Worker": 1}, containers=[container],
        suspend=True,
    )  # fmt: skip
    _label(fake, "pytorchjobs", name, job_id)


def _unsuspend(kube_client: k8s.ApiClient, name: str) -> None:
    k8s.CustomObjectsApi(kube_client).patch_namespaced_custom_object(
        "kubeflow.org", "v1", NS, "pytorchjobs", name, {"spec": {"runPolicy": {"suspend": False}}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


def test_the_job_is_found_by_label_and_a_stop_ends_its_pods(
    fake_kube: FakeKube, kube_client: k8s.ApiClient, kubelet: FakeKubelet
) -> None:
    _pytorchjob(fake_kube, "llm-run-42", "llm-7b")
    _unsuspend(kube_client, "llm-run-42")  # the operator starts it: two pods, two processes
    pods = [p["metadata"]["name"] for p in kubelet.launched]
    assert len(pods) == 2
    procs = list(kubelet._procs.values())
    assert all(p.poll() is None for p in procs)

    found = KubeJobFinder(kube_client, NS).find("llm-7b")
    assert found.ref == JobRef("llm-run-42", namespace=NS, kind=JobKind.PYTORCHJOB)
    jobs = KubeJobs(kube_client, stop_poll_s=0.01)
    result = jobs.stop(found.ref)

    assert result.outcome is StopOutcome.STOPPED
    assert all(fake_kube.pod(p, NS) is None for p in pods)
    assert all(p.poll() is not None for p in procs)  # the computation really ended
    assert jobs.stop(found.ref).outcome is StopOutcome.ALREADY_STOPPED


def test_a_stop_is_not_done_while_a_pod_lingers(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _pytorchjob(fake_kube, "stuck", "stuck-id")
    _unsuspend(kube_client, "stuck")
    # No operator here: the suspend is accepted but this pod is never deleted.
    fake_kube.add_pod("stuck-master-0", namespace=NS, labels={
        "training.kubeflow.org/job-name": "stuck"})  # fmt: skip
    clock = iter(float(t) for t in range(100))
    control = PyTorchJobControl(
        kube_client, stop_timeout_s=5, stop_poll_s=1, sleep=lambda s: None,
        clock=lambda: next(clock),
    )  # fmt: skip
    with pytest.raises(TemporaryError, match="stuck-master-0 still exist"):
        control.stop(JobRef("stuck", NS, JobKind.PYTORCHJOB))
    fake_kube.delete_object("/api/v1", "pods", "stuck-master-0", NS)
    assert control.stop(JobRef("stuck", NS, JobKind.PYTORCHJOB)).outcome is (
        StopOutcome.ALREADY_STOPPED
    )


def test_no_job_or_two_jobs_with_the_label_go_to_a_human(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    finder = KubeJobFinder(kube_client, NS)
    fake_kube.add_pytorchjob("local-7", namespace=NS)  # named like the id, but not labelled
    with pytest.raises(JobNotFoundError, match="nothing was stopped") as caught:
        finder.find("local-7")
    assert isinstance(caught.value, PermanentError)
    assert not isinstance(caught.value, NotFoundError)  # never "already gone"
    _pytorchjob(fake_kube, "a", "twice")
    fake_kube.add_job("b", namespace=NS)
    _label(fake_kube, "jobs", "b", "twice")
    with pytest.raises(AmbiguousJobError, match="several jobs"):
        finder.find("twice")


def test_a_job_that_vanishes_before_the_stop_is_not_reported_stopped(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    with pytest.raises(JobNotFoundError, match="disappeared"):
        KubeJobs(kube_client).stop(JobRef("gone", NS, JobKind.PYTORCHJOB))


def test_a_hyperpod_training_operator_job_is_refused_clearly(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.register(
        "/apis/sagemaker.amazonaws.com/v1", "hyperpodpytorchjobs", "HyperPodPyTorchJob",
        custom=True,
    )  # fmt: skip
    fake_kube.add_object("/apis/sagemaker.amazonaws.com/v1", "hyperpodpytorchjobs", {
        "metadata": {"name": "hp", "namespace": NS, "labels": {JOB_ID_LABEL: "hp-id"}},
        "spec": {},
    })  # fmt: skip
    with pytest.raises(UnsupportedJobKind, match="no suspend field"):
        KubeJobFinder(kube_client, NS).find("hp-id")


def test_a_kueue_job_is_stopped_through_suspend_only(
    fake_kube: FakeKube, kube_client: k8s.ApiClient, kubelet: FakeKubelet
) -> None:
    container: dict[str, Any] = {"name": "trainer", "image": "train:1", "command": SLEEPER}
    fake_kube.add_job("queued", namespace=NS, containers=[container], suspend=True)
    _label(fake_kube, "jobs", "queued", "q-id", **{"kueue.x-k8s.io/queue-name": "team-a"})
    # Kueue admits the job by unsuspending it: the job controller starts the pod.
    k8s.BatchV1Api(kube_client).patch_namespaced_job(
        "queued", NS, {"spec": {"suspend": False}}, _content_type="application/merge-patch+json"
    )
    assert len(kubelet.launched) == 1
    found = KubeJobFinder(kube_client, NS).find("q-id")
    assert found.kueue_queue == "team-a"
    fake_kube.clear_requests()

    assert KubeJobs(kube_client, stop_poll_s=0.01).stop(found.ref).outcome is StopOutcome.STOPPED
    writes = [r for r in fake_kube.requests if r.method not in ("GET",)]
    assert [(r.method, r.path) for r in writes] == [
        ("PATCH", f"/apis/batch/v1/namespaces/{NS}/jobs/queued")
    ]
    assert writes[0].body["spec"] == {"suspend": True}  # the field Kueue itself uses
    assert fake_kube.pod(kubelet.launched[0]["metadata"]["name"], NS) is None
