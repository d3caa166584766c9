"""What a diagnosis needs to know about a job beyond the ledger: how it computes, how it is
addressed.

The incident flow asks a :class:`JobCatalog` for both; the simulated cluster's catalog reads the
launch record of a local job (:class:`~recovery.local.catalog.LocalJobCatalog`), the Kubernetes one
reads the job's own pod template (:class:`~recovery.kube.catalog.KubeJobCatalog`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from detection.simulation import TrainArgsError, known_train_args
from recovery.diagnosis.rerun import JobSpec, StepRecord, load_trace
from recovery.errors import PermanentError
from recovery.jobs import JobKind, JobRef

__all__ = [
    "JobCatalog",
    "NotReplayable",
    "RerunPlan",
    "StaticJobCatalog",
    "plan_from_harness_args",
]


class NotReplayable(PermanentError):
    """How the job computes is known, but no diagnostic rerun of it can run: a sharded job
    (``--parallel fsdp|hsdp``), whose guard refuses the rerun's trace mode. The replay stage
    records an inconclusive verdict with this reason, so a person decides."""


@dataclass(frozen=True)
class RerunPlan:
    """What the diagnostic rerun needs to know about a job beyond the ledger."""

    spec: JobSpec
    reference: tuple[StepRecord, ...] | None
    """The job's own per-step trace, if it wrote one: tells "software" from "inconclusive"."""


class JobCatalog(Protocol):
    """How a job computes — the inputs of a bitwise rerun — and how it is addressed."""

    def ref(self, job_id: str) -> JobRef: ...

    def rerun_plan(self, job_id: str) -> RerunPlan:
        """Raise :class:`PermanentError` when the job's computation is not known here."""
        ...


class StaticJobCatalog:
    """Fixed plans by job id (tests; real mode reads them from the cluster, KubeJobCatalog)."""

    def __init__(
        self, plans: dict[str, RerunPlan] | None = None, *, namespace: str = "default"
    ) -> None:
        self._plans = dict(plans or {})
        self._namespace = namespace

    def ref(self, job_id: str) -> JobRef:
        return JobRef(job_id, namespace=self._namespace, kind=JobKind.PYTORCHJOB)

    def rerun_plan(self, job_id: str) -> RerunPlan:
        try:
            return self._plans[job_id]
        except KeyError as err:
            raise PermanentError(
                "replay", "plan", f"job/{job_id}", "how this job computes is not known here"
            ) from err


def plan_from_harness_args(args: Sequence[str]) -> RerunPlan:
    """The rerun inputs from ``sdcguard train`` arguments (the options DESIGN fixes).

    A sharded job raises :class:`NotReplayable`: a rerun traces every step as a DDP job
    (``--trace``), which ``--parallel fsdp|hsdp`` refuses; launched anyway it would fail and
    say less than the refusal does."""
    try:
        known = known_train_args(args)
    except TrainArgsError as err:
        raise PermanentError("replay", "plan", "harness arguments", str(err)) from err
    if known.parallel != "ddp":
        raise NotReplayable(
            "replay",
            "plan",
            f"--parallel {known.parallel}",
            "a sharded job is not replayed diagnostically (its guard traces no step for a "
            "rerun to compare: DDP jobs only); a person decides on the alarm's evidence",
        )
    trace = known.trace
    reference = tuple(load_trace(trace)) if trace is not None and trace.is_file() else None
    spec = JobSpec(
        world_size=known.world_size,
        seed=known.seed,
        threads=known.threads,
        audit_mode=known.audit_mode,
        inject=tuple(known.inject),
    )
    return RerunPlan(spec=spec, reference=reference)
