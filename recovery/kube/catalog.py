"""The job catalog of a Kubernetes cluster: the job found by its label, how it computes read from
its pod template."""

from __future__ import annotations

from typing import Any

from recovery.diagnosis.plan import RerunPlan
from recovery.diagnosis.rerun import JobSpec, UserJobTemplate
from recovery.errors import PermanentError
from recovery.jobs import JobRef
from recovery.kube.jobs import FoundJob, KubeJobFinder

__all__ = ["KubeJobCatalog"]


class KubeJobCatalog:
    """Real mode: the job is the one object labelled ``sdcguard.io/job-id=<job id>`` in the
    training namespace (:class:`~recovery.jobs.KubeJobFinder`; none or several is a
    :class:`PermanentError` that goes to a human), and how it computes is its own pod template,
    read from the cluster at the moment of the rerun."""

    def __init__(self, finder: KubeJobFinder) -> None:
        self._finder = finder

    def find(self, job_id: str) -> FoundJob:
        return self._finder.find(job_id)

    def ref(self, job_id: str) -> JobRef:
        return self._finder.find(job_id).ref

    def rerun_plan(self, job_id: str) -> RerunPlan:
        found = self._finder.find(job_id)
        templates = found.pod_templates()
        if not templates:
            raise PermanentError("replay", "plan", str(found.ref), "the job has no pod template")
        # The first replica (PyTorchJob Master) holds the command every rank runs.
        first = "Master" if "Master" in templates else sorted(templates)[0]
        _, template = templates[first]
        return RerunPlan(
            spec=JobSpec(
                world_size=1,
                seed=0,
                template=UserJobTemplate(
                    job_name=found.ref.name,
                    namespace=found.ref.namespace,
                    pod_template=template,
                    gpus=_gpus_of(template),
                ),
            ),
            reference=None,
        )


def _gpus_of(template: Any) -> int:
    """The ``nvidia.com/gpu`` limit of the pod template's first container (0 without)."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    limits = (containers[0].get("resources") or {}).get("limits") or {}
    try:
        return int(limits.get("nvidia.com/gpu") or 0)
    except (TypeError, ValueError):
        return 0
