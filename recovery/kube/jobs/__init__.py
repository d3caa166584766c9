"""Training-job control on Kubernetes, one module per kind of job.

Every operation is idempotent, because a retried or re-run incident flow calls it again
(:mod:`recovery.jobs` states the rules):

- :class:`PyTorchJobControl` (:mod:`~recovery.kube.jobs.pytorchjob`) — a Kubeflow ``PyTorchJob``;
  the checkpoint goes straight into every replica's container env;
- :class:`BatchJobControl` (:mod:`~recovery.kube.jobs.batchjob`) — a ``batch/v1`` Job; the
  checkpoint travels as a pod-template annotation that the container reads through the
  downward API (:data:`~recovery.jobs.RESUME_ENV_FROM_ANNOTATION`).

The two share :mod:`~recovery.kube.jobs.common`; :class:`KubeJobs`
(:mod:`~recovery.kube.jobs.finder`) dispatches between them, and :class:`KubeJobFinder` finds
the job by its ``sdcguard.io/job-id`` label.
"""

from recovery.kube.jobs.batchjob import BatchJobControl
from recovery.kube.jobs.finder import (
    JOB_ID_LABEL,
    AmbiguousJobError,
    FoundJob,
    JobNotFoundError,
    KubeJobFinder,
    KubeJobs,
    UnsupportedJobKind,
)
from recovery.kube.jobs.pytorchjob import PyTorchJobControl

__all__ = [
    "JOB_ID_LABEL",
    "AmbiguousJobError",
    "BatchJobControl",
    "FoundJob",
    "JobNotFoundError",
    "KubeJobFinder",
    "KubeJobs",
    "PyTorchJobControl",
    "UnsupportedJobKind",
]
