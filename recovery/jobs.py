"""What every job-control backend shares: job refs, outcomes, and the :class:`JobControl` protocol.

The protocol's invariant is idempotency, because a retried or re-run incident flow calls each
operation again:

- ``stop`` of a stopped job answers ``already-stopped`` and of a finished one ``not-running``;
  it never fails for being late;
- ``resume`` of a job already running from *that* checkpoint answers ``already-resumed`` and
  starts nothing; a job running from anything else is refused (stop it first) rather than
  silently left on the wrong weights.

The resume constants name where a resumed job finds its checkpoint, so the Kubernetes manifests
and the training container agree on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

RESUME_ENV = "SDCGUARD_RESUME_FROM"
ANNOTATION_RESUME_FROM = "sdcguard.io/resume-from"
ANNOTATION_RESUME_STEP = "sdcguard.io/resume-step"
ANNOTATION_RESUME_NODES = "sdcguard.io/resume-nodes"

RESUME_ENV_FROM_ANNOTATION: Mapping[str, Any] = {
    "name": RESUME_ENV,
    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_RESUME_FROM}']"}},
}
"""The env entry a batch/v1 Job's training container must declare so that a resume reaches it."""


class JobKind(StrEnum):
    PYTORCHJOB = "PyTorchJob"
    BATCH_JOB = "Job"
    LOCAL = "local"


class JobStatus(StrEnum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


class StopOutcome(StrEnum):
    STOPPED = "stopped"
    ALREADY_STOPPED = "already-stopped"
    NOT_RUNNING = "not-running"
    """The job had finished (succeeded or failed) on its own; nothing was stopped."""


class ResumeOutcome(StrEnum):
    RESUMED = "resumed"
    ALREADY_RESUMED = "already-resumed"


@dataclass(frozen=True)
class JobRef:
    """A training job. ``kind`` None means "whatever the backend controls"; a backend refuses
    a ref of another kind instead of touching a same-named object of the wrong type."""

    name: str
    namespace: str = "default"
    kind: JobKind | None = None

    def __str__(self) -> str:
        return self.name if self.kind is JobKind.LOCAL else f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class StopResult:
    job: JobRef
    outcome: StopOutcome
    detail: str = ""


@dataclass(frozen=True)
class ResumeResult:
    job: JobRef
    outcome: ResumeOutcome
    checkpoint_uri: str
    step: int
    nodes: tuple[str, ...] | None
    pid: int | None = None


@runtime_checkable
class JobControl(Protocol):
    """Stop, resume and observe one kind of training job (see :mod:`recovery.jobs`)."""

    def stop(self, job: JobRef) -> StopResult: ...

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult: ...

    def status(self, job: JobRef) -> JobStatus: ...
