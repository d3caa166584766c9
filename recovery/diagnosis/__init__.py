"""Deep diagnosis: rerun the suspect steps on chosen nodes, and say who is at fault.

- :mod:`~recovery.diagnosis.rerun` — what a rerun is, and the :class:`Rerunner` interface;
- :mod:`~recovery.diagnosis.batch` — several reruns at once, each node's one after the other;
- :mod:`~recovery.diagnosis.verdict` — :func:`diagnose`: hardware, software or inconclusive;
- :mod:`~recovery.diagnosis.plan` — what a diagnosis needs to know about a job
  (:class:`JobCatalog`).

The backends live with their outside system: :class:`recovery.kube.diagnosis.KubeRerunner` (a
Job pinned to the node, running the user's own pod template) and
:class:`recovery.local.diagnosis.LocalRerunner` (processes on the simulated cluster).
"""

from recovery.diagnosis.plan import (
    JobCatalog,
    NotReplayable,
    RerunPlan,
    StaticJobCatalog,
    plan_from_harness_args,
)
from recovery.diagnosis.rerun import (
    JobSpec,
    Rerunner,
    RerunRequest,
    RerunResult,
    StepRecord,
    UserJobTemplate,
    load_trace,
)
from recovery.diagnosis.verdict import Verdict, VerdictResult, diagnose

__all__ = [
    "JobCatalog",
    "JobSpec",
    "NotReplayable",
    "RerunPlan",
    "RerunRequest",
    "RerunResult",
    "Rerunner",
    "StaticJobCatalog",
    "StepRecord",
    "UserJobTemplate",
    "Verdict",
    "VerdictResult",
    "diagnose",
    "load_trace",
    "plan_from_harness_args",
]
