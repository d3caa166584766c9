"""Find a training job by its identity label, and control whatever kind it turned out to be.

The alarm carries the job id the training job was given (``SDCGUARD_JOB_ID``); the job object
carries the same id as the label ``sdcguard.io/job-id`` (docs/training-job.md). The flow finds
the object through that label — never by taking the id for an object name, because a default
id such as ``local-7`` names nothing, and a stop of "nothing" that reports success leaves the
corrupting job running.

Invariant: :meth:`KubeJobFinder.find` returns exactly one job or raises
:class:`JobNotFoundError` / :class:`AmbiguousJobError` — both :class:`PermanentError` that are
*not* :class:`NotFoundError`, so no caller can take them for "already gone": they go to a human.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from kubernetes import client as k8s

from recovery.errors import NotFoundError, PermanentError
from recovery.jobs import JobControl, JobKind, JobRef, JobStatus, ResumeResult, StopResult
from recovery.kube import client as kube
from recovery.kube.jobs.batchjob import BatchJobControl
from recovery.kube.jobs.pytorchjob import PyTorchJobControl

__all__ = [
    "HYPERPOD_JOB",
    "JOB_ID_LABEL",
    "KUEUE_QUEUE_LABEL",
    "AmbiguousJobError",
    "FoundJob",
    "JobNotFoundError",
    "KubeJobFinder",
    "KubeJobs",
    "UnsupportedJobKind",
]

log = logging.getLogger(__name__)

JOB_ID_LABEL = "sdcguard.io/job-id"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
HYPERPOD_JOB = ("sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs")


class JobNotFoundError(PermanentError):
    """No job object carries the identity label: nothing was stopped; a human must look."""


class AmbiguousJobError(PermanentError):
    """More than one job object carries the identity label: acting on one is a guess."""


class UnsupportedJobKind(PermanentError):
    """The job is of a kind sdcguard cannot stop without deleting it."""


@dataclass(frozen=True)
class FoundJob:
    """One job found by label: its ref, and the object as the API server sent it."""

    ref: JobRef
    obj: Mapping[str, Any] = field(repr=False)

    @property
    def kueue_queue(self) -> str | None:
        labels = (self.obj.get("metadata") or {}).get("labels") or {}
        return labels.get(KUEUE_QUEUE_LABEL)

    def pod_templates(self) -> dict[str, tuple[int, Mapping[str, Any]]]:
        """Replica type → (replica count, pod template); a batch/v1 Job is one ``Job`` replica."""
        spec = self.obj.get("spec") or {}
        if self.ref.kind is JobKind.PYTORCHJOB:
            return {
                str(name): (int(replica.get("replicas") or 1), replica.get("template") or {})
                for name, replica in (spec.get("pytorchReplicaSpecs") or {}).items()
            }
        return {"Job": (int(spec.get("parallelism") or 1), spec.get("template") or {})}


class KubeJobFinder:
    """Lists PyTorchJobs and batch/v1 Jobs by ``sdcguard.io/job-id`` in one namespace.

    Needs RBAC ``list`` on ``pytorchjobs.kubeflow.org``, ``jobs.batch`` and (to refuse them
    clearly) ``hyperpodpytorchjobs.sagemaker.amazonaws.com``; a cluster without that CRD
    answers 404, which means no such job.
    """

    def __init__(self, api_client: k8s.ApiClient, namespace: str) -> None:
        self._api_client = api_client
        self._custom = k8s.CustomObjectsApi(api_client)
        self._batch = k8s.BatchV1Api(api_client)
        self.namespace = namespace

    def find(self, job_id: str) -> FoundJob:
        selector = f"{JOB_ID_LABEL}={job_id}"
        target = f"{self.namespace}/{selector}"
        found: list[FoundJob] = []
        group, version, plural = PyTorchJobControl.GROUP, PyTorchJobControl.VERSION, "pytorchjobs"
        listed: dict[str, Any] = kube.call(
            "list",
            f"pytorchjobs/{target}",
            lambda: cast(
                dict[str, Any],
                self._custom.list_namespaced_custom_object(
                    group, version, self.namespace, plural, label_selector=selector
                ),
            ),
        )
        for obj in listed.get("items") or []:
            found.append(FoundJob(self._ref(obj, JobKind.PYTORCHJOB), obj))
        jobs = kube.call(
            "list",
            f"jobs/{target}",
            lambda: self._batch.list_namespaced_job(self.namespace, label_selector=selector),
        )
        for item in jobs.items:
            obj = self._api_client.sanitize_for_serialization(item)
            found.append(FoundJob(self._ref(obj, JobKind.BATCH_JOB), obj))
        hyperpod = self._hyperpod_jobs(selector, target)
        if hyperpod:
            raise UnsupportedJobKind(
                kube.SYSTEM,
                "find",
                f"hyperpodpytorchjob/{self.namespace}/{hyperpod[0]}",
                "HyperPodPyTorchJob (HyperPod training operator) has no suspend field: sdcguard "
                "cannot stop it without deleting it. Run the job as a Kubeflow PyTorchJob "
                "(docs/training-job.md)",
            )
        if not found:
            raise JobNotFoundError(
                kube.SYSTEM,
                "find",
                target,
                f"no PyTorchJob or Job carries the label {selector}: nothing was stopped "
                "(docs/training-job.md, item 2)",
            )
        if len(found) > 1:
            raise AmbiguousJobError(
                kube.SYSTEM,
                "find",
                target,
                "several jobs carry the label: " + ", ".join(str(f.ref) for f in found),
            )
        return found[0]

    def _ref(self, obj: Mapping[str, Any], kind: JobKind) -> JobRef:
        return JobRef(str(obj["metadata"]["name"]), namespace=self.namespace, kind=kind)

    def _hyperpod_jobs(self, selector: str, target: str) -> list[str]:
        group, version, plural = HYPERPOD_JOB
        try:
            listed: dict[str, Any] = kube.call(
                "list",
                f"{plural}/{target}",
                lambda: cast(
                    dict[str, Any],
                    self._custom.list_namespaced_custom_object(
                        group, version, self.namespace, plural, label_selector=selector
                    ),
                ),
            )
        except NotFoundError:
            return []  # the CRD is not installed: no HyperPod jobs here
        return [str(o["metadata"]["name"]) for o in listed.get("items") or []]


class KubeJobs:
    """:class:`JobControl` over both Kubernetes kinds, chosen by the ref's kind.

    A job that vanished between being found and being stopped is a :class:`JobNotFoundError`
    (not "already stopped"): in real mode a stop is done only when its pods are seen gone.
    Kueue-managed jobs (label ``kueue.x-k8s.io/queue-name``) are stopped through the same
    ``suspend`` field Kueue itself uses, never by deleting the Workload.
    """

    def __init__(self, api_client: k8s.ApiClient, **options: Any) -> None:
        self._controls: dict[JobKind, JobControl] = {
            JobKind.PYTORCHJOB: PyTorchJobControl(api_client, **options),
            JobKind.BATCH_JOB: BatchJobControl(api_client, **options),
        }

    def _control(self, job: JobRef) -> JobControl:
        if job.kind is None or job.kind not in self._controls:
            raise UnsupportedJobKind(kube.SYSTEM, "control", str(job), f"kind {job.kind}")
        return self._controls[job.kind]

    def stop(self, job: JobRef) -> StopResult:
        try:
            return self._control(job).stop(job)
        except NotFoundError as err:
            raise JobNotFoundError(
                kube.SYSTEM, "stop", str(job), f"the job disappeared before it was stopped: {err}"
            ) from err

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult:
        return self._control(job).resume(job, checkpoint_uri, step, nodes)

    def status(self, job: JobRef) -> JobStatus:
        return self._control(job).status(job)
