"""The job catalog of the simulated cluster: local jobs and how each computes, from their launch
records."""

from __future__ import annotations

import json
from pathlib import Path

from recovery.diagnosis.plan import RerunPlan, plan_from_harness_args
from recovery.errors import NotFoundError, PermanentError
from recovery.jobs import JobKind, JobRef

__all__ = ["LocalJobCatalog"]


class LocalJobCatalog:
    """Jobs launched by :class:`LocalJobControl`: their harness arguments are in its state
    directory (``<jobs_dir>/<job_id>.json``, ``original_args``), the documented record of
    every local launch."""

    def __init__(self, jobs_dir: Path) -> None:
        self._dir = jobs_dir

    def ref(self, job_id: str) -> JobRef:
        return JobRef(job_id, kind=JobKind.LOCAL)

    def rerun_plan(self, job_id: str) -> RerunPlan:
        path = self._dir / f"{job_id}.json"
        try:
            record = json.loads(path.read_text())
            args = [str(a) for a in record["original_args"]]
        except FileNotFoundError as err:
            raise NotFoundError("local-jobs", "read", f"job/{job_id}", "never launched") from err
        except (ValueError, KeyError, TypeError) as err:
            raise PermanentError("local-jobs", "read", str(path), f"bad record: {err}") from err
        return plan_from_harness_args(args)
