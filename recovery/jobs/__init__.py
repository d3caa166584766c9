"""Training-job control: stop a job, resume it from a verified checkpoint, ask its status.

Every operation is idempotent, because a retried or re-run incident flow calls it again
(:mod:`recovery.jobs.base` states the rules). One module per backend:

- :class:`PyTorchJobControl` (:mod:`~recovery.jobs.pytorchjob`) — a Kubeflow ``PyTorchJob``;
  the checkpoint goes straight into every replica's container env;
- :class:`BatchJobControl` (:mod:`~recovery.jobs.batchjob`) — a ``batch/v1`` Job; the
  checkpoint travels as a pod-template annotation that the container reads through the
  downward API (:data:`RESUME_ENV_FROM_ANNOTATION`);
- :class:`LocalJobControl` (:mod:`~recovery.jobs.local`) — local ``sdcguard train`` process
  groups (:mod:`~recovery.jobs.process_group`), resumed with :func:`resume_args`.

The two Kubernetes backends share :mod:`~recovery.jobs.kube_common`; in real mode
:class:`KubeJobs` (:mod:`~recovery.jobs.finder`) dispatches between them, and
:class:`KubeJobFinder` finds the job by its ``sdcguard.io/job-id`` label.
"""

from recovery.jobs.base import (
    ANNOTATION_RESUME_FROM,
    ANNOTATION_RESUME_NODES,
    ANNOTATION_RESUME_STEP,
    RESUME_ENV,
    RESUME_ENV_FROM_ANNOTATION,
    JobControl,
    JobKind,
    JobRef,
    JobStatus,
    ResumeOutcome,
    ResumeResult,
    StopOutcome,
    StopResult,
)
from recovery.jobs.batchjob import BatchJobControl
from recovery.jobs.finder import (
    JOB_ID_LABEL,
    AmbiguousJobError,
    FoundJob,
    JobNotFoundError,
    KubeJobFinder,
    KubeJobs,
    UnsupportedJobKind,
)
from recovery.jobs.local import LocalJobControl
from recovery.jobs.pytorchjob import PyTorchJobControl
from recovery.jobs.train_args import resume_args

__all__ = [
    "ANNOTATION_RESUME_FROM",
    "ANNOTATION_RESUME_NODES",
    "ANNOTATION_RESUME_STEP",
    "JOB_ID_LABEL",
    "RESUME_ENV",
    "RESUME_ENV_FROM_ANNOTATION",
    "AmbiguousJobError",
    "BatchJobControl",
    "FoundJob",
    "JobControl",
    "JobKind",
    "JobNotFoundError",
    "JobRef",
    "JobStatus",
    "KubeJobFinder",
    "KubeJobs",
    "LocalJobControl",
    "PyTorchJobControl",
    "ResumeOutcome",
    "ResumeResult",
    "StopOutcome",
    "StopResult",
    "UnsupportedJobKind",
    "resume_args",
]
