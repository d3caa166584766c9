"""The simulated cluster: the local backends of the incident flow, all on this machine.

- :mod:`~recovery.local.cluster` — :class:`LocalCluster`, the nodes' JSON state, file-locked;
- :mod:`~recovery.local.nodes` — :class:`LocalNodeOps`, :class:`LocalNodeDirectory`;
- :mod:`~recovery.local.jobs` — :class:`LocalJobControl`: ``sdcguard train`` process groups
  (:mod:`~recovery.local.process_group`), resumed with :func:`resume_args`
  (:mod:`~recovery.local.train_args`);
- :mod:`~recovery.local.catalog` — :class:`LocalJobCatalog`, from the jobs' launch records;
- :mod:`~recovery.local.diagnosis` — :class:`LocalRerunner`, diagnostic reruns as processes.

AWS is mocked for it by :mod:`recovery.aws.local`; telemetry comes from fixtures
(:class:`recovery.telemetry.FixtureTelemetry`); checkpoints are files
(:class:`recovery.checkpoints.FileCheckpointStore`).
"""

from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster
from recovery.local.diagnosis import LocalRerunner
from recovery.local.jobs import LocalJobControl
from recovery.local.nodes import LocalNodeDirectory, LocalNodeOps
from recovery.local.train_args import resume_args

__all__ = [
    "LocalCluster",
    "LocalJobCatalog",
    "LocalJobControl",
    "LocalNodeDirectory",
    "LocalNodeOps",
    "LocalRerunner",
    "resume_args",
]
