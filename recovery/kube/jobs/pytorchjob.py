"""Job control for a Kubeflow ``PyTorchJob`` (training-operator v1.7+, for ``runPolicy.suspend``).

A custom resource's spec is mutable, so the checkpoint goes straight into every replica's
container env (``SDCGUARD_RESUME_FROM``); a stopped job is one the operator sees suspended.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from recovery.errors import PermanentError
from recovery.jobs import ANNOTATION_RESUME_NODES, RESUME_ENV, JobKind, JobRef, JobStatus
from recovery.kube import client as kube
from recovery.kube.jobs.common import (
    MERGE_PATCH,
    KubeJobControl,
    annotations_of,
    pinned_affinity,
    true_conditions,
    with_env,
)


class PyTorchJobControl(KubeJobControl):
    """:class:`JobControl` for Kubeflow ``PyTorchJob`` (kubeflow.org/v1, ``pytorchjobs``).

    Needs RBAC ``get``/``patch`` on ``pytorchjobs.kubeflow.org`` and ``list`` on ``pods``. Stop sets
    ``spec.runPolicy.suspend: true`` (the operator deletes the pods); resume writes the
    checkpoint into every replica container's ``SDCGUARD_RESUME_FROM``, the job annotations and,
    given ``nodes``, a ``kubernetes.io/hostname In nodes`` node-affinity term, then unsuspends.
    """

    _kind = JobKind.PYTORCHJOB
    _label = "pytorchjob"
    _pod_label = "training.kubeflow.org/job-name"
    GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"

    def _read(self, job: JobRef) -> dict[str, Any]:
        obj = self._custom.get_namespaced_custom_object(
            self.GROUP, self.VERSION, job.namespace, self.PLURAL, job.name
        )
        if not isinstance(obj, dict):
            raise PermanentError(
                kube.SYSTEM, "read", self._target(job), f"unexpected answer {type(obj).__name__}"
            )
        return obj

    def _patch(self, job: JobRef, body: dict[str, Any]) -> None:
        # Custom resources take JSON merge patches (strategic merge is for built-in kinds only).
        self._custom.patch_namespaced_custom_object(
            self.GROUP,
            self.VERSION,
            job.namespace,
            self.PLURAL,
            job.name,
            body,
            _content_type=MERGE_PATCH,
        )

    def _suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def _suspend_patch(self, value: bool) -> dict[str, Any]:
        return {"spec": {"runPolicy": {"suspend": value}}}

    def _status_of(self, obj: Mapping[str, Any]) -> JobStatus:
        conditions = true_conditions(obj)
        if "Succeeded" in conditions:
            return JobStatus.SUCCEEDED
        if "Failed" in conditions:
            return JobStatus.FAILED
        if "Suspended" in conditions:
            return JobStatus.SUSPENDED
        if "Running" in conditions or "Restarting" in conditions:
            return JobStatus.RUNNING
        if self._suspended(obj):
            return JobStatus.SUSPENDED
        return JobStatus.UNKNOWN

    def _resume_patch(
        self, job: JobRef, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        replica_specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        if not replica_specs:
            raise PermanentError(
                kube.SYSTEM, "resume", self._target(job), "spec.pytorchReplicaSpecs is empty"
            )
        unpin = nodes is None and ANNOTATION_RESUME_NODES in annotations_of(obj)
        patched_specs: dict[str, Any] = {}
        for replica_type, replica in replica_specs.items():
            pod_spec = copy.deepcopy(((replica.get("template") or {}).get("spec")) or {})
            # A merge patch replaces lists whole: send each full container list, env updated.
            containers = [with_env(c, RESUME_ENV, uri) for c in pod_spec.get("containers", [])]
            template_spec: dict[str, Any] = {"containers": containers}
            if nodes is not None or unpin:
                template_spec["affinity"] = pinned_affinity(pod_spec.get("affinity"), nodes)
            patched_specs[replica_type] = {"template": {"spec": template_spec}}
        return {
            "metadata": {"annotations": self._resume_annotations(obj, uri, step, nodes)},
            "spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": patched_specs},
        }
