"""Job control for a ``batch/v1`` Job.

A Job's pod template is immutable except for the scheduling directives (labels, annotations,
nodeSelector, affinity, tolerations, schedulingGates), and those only while the Job is
suspended and ``status.startTime`` is unset (KEP-2926). So the checkpoint travels as the
pod-template annotation ``sdcguard.io/resume-from``, which the container reads through the
downward API (:data:`~recovery.jobs.RESUME_ENV_FROM_ANNOTATION` must be in the Job's
manifest), and ``startTime`` is cleared through the status subresource before the template
changes, as Kueue and JobSet do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from recovery.errors import PermanentError
from recovery.jobs import (
    ANNOTATION_RESUME_FROM,
    ANNOTATION_RESUME_NODES,
    ANNOTATION_RESUME_STEP,
    RESUME_ENV,
    RESUME_ENV_FROM_ANNOTATION,
    JobKind,
    JobRef,
    JobStatus,
)
from recovery.kube import client as kube
from recovery.kube.jobs.common import (
    MERGE_PATCH,
    KubeJobControl,
    annotations_of,
    pinned_affinity,
    true_conditions,
)


class BatchJobControl(KubeJobControl):
    """:class:`JobControl` for a ``batch/v1`` Job (see the module docstring for why the
    checkpoint reaches the container through a pod-template annotation).

    Needs RBAC ``get``/``patch`` on ``jobs``, ``patch`` on ``jobs/status``, ``list`` on ``pods``.
    """

    _kind = JobKind.BATCH_JOB
    _label = "job"
    _pod_label = "batch.kubernetes.io/job-name"

    def _read(self, job: JobRef) -> dict[str, Any]:
        raw = self._batch.read_namespaced_job(job.name, job.namespace)
        obj: dict[str, Any] = self._api_client.sanitize_for_serialization(raw)
        return obj

    def _patch(self, job: JobRef, body: dict[str, Any]) -> None:
        self._batch.patch_namespaced_job(job.name, job.namespace, body, _content_type=MERGE_PATCH)

    def _suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def _suspend_patch(self, value: bool) -> dict[str, Any]:
        return {"spec": {"suspend": value}}

    def _status_of(self, obj: Mapping[str, Any]) -> JobStatus:
        conditions = true_conditions(obj)
        if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
            return JobStatus.SUCCEEDED
        if "Failed" in conditions or "FailureTarget" in conditions:
            return JobStatus.FAILED
        status = obj.get("status") or {}
        if int(status.get("active") or 0) > 0:
            return JobStatus.RUNNING
        if self._suspended(obj) or "Suspended" in conditions:
            return JobStatus.SUSPENDED
        if status.get("startTime"):
            return JobStatus.RUNNING
        return JobStatus.UNKNOWN

    def _before_resume(self, job: JobRef, obj: Mapping[str, Any]) -> bool:
        containers = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "containers"
        ) or []
        missing = [c.get("name", "?") for c in containers if not _reads_resume_annotation(c)]
        if missing or not containers:
            raise PermanentError(
                kube.SYSTEM,
                "resume",
                self._target(job),
                f"container(s) {', '.join(missing) or '(none)'} do not read {RESUME_ENV} from the "
                f"pod annotation {ANNOTATION_RESUME_FROM}; a Job's env is immutable, so its "
                f"manifest must declare {json.dumps(dict(RESUME_ENV_FROM_ANNOTATION))}",
            )
        if not (obj.get("status") or {}).get("startTime"):
            return False
        # The API server lets the template's scheduling directives change only on a suspended
        # Job without startTime; the job controller sets it again when the Job resumes.
        self._batch.patch_namespaced_job_status(
            job.name,
            job.namespace,
            {"status": {"startTime": None}},
            _content_type=MERGE_PATCH,
        )
        return True

    def _resume_patch(
        self, job: JobRef, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        template = (obj.get("spec") or {}).get("template") or {}
        template_patch: dict[str, Any] = {
            "metadata": {
                "annotations": {ANNOTATION_RESUME_FROM: uri, ANNOTATION_RESUME_STEP: str(step)}
            }
        }
        unpin = nodes is None and ANNOTATION_RESUME_NODES in annotations_of(obj)
        if nodes is not None or unpin:
            template_patch["spec"] = {
                "affinity": pinned_affinity((template.get("spec") or {}).get("affinity"), nodes)
            }
        return {
            "metadata": {"annotations": self._resume_annotations(obj, uri, step, nodes)},
            "spec": {"suspend": False, "template": template_patch},
        }


def _reads_resume_annotation(container: Mapping[str, Any]) -> bool:
    for entry in container.get("env") or []:
        if entry.get("name") == RESUME_ENV:
            field_path = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            return bool(field_path) and ANNOTATION_RESUME_FROM in str(field_path)
    return False
