"""Kubernetes: the adapters that act on a real cluster.

- :mod:`~recovery.kube.client` — API clients (in-cluster, kubeconfig, host) and the error
  translation every adapter shares;
- :mod:`~recovery.kube.nodes` — :class:`KubeNodeOps` (cordon, taint, health labels, eviction)
  and :class:`KubeNodeDirectory` (spares, a replacement's join);
- :mod:`~recovery.kube.jobs` — training-job control (``PyTorchJob``, ``batch/v1`` Job) and the
  finder of a job by its ``sdcguard.io/job-id`` label;
- :mod:`~recovery.kube.catalog` — :class:`KubeJobCatalog`: a job and its pod template;
- :mod:`~recovery.kube.diagnosis` — :class:`KubeRerunner`: a diagnostic rerun as a Job pinned to
  the node;
- :mod:`~recovery.kube.remediation` — :class:`KubeReplaceRemediation`: drain, delete the Node,
  the autoscaler's new node; :mod:`~recovery.kube.nvsentinel` — :class:`NVSentinelRemediation`:
  an NVSentinel ``ExternalFault`` per node;
- :mod:`~recovery.kube.tokenreview` — :class:`TokenReviewer`, who a service-account token is.

Telemetry's Kubernetes backend (:class:`recovery.telemetry.KubeTelemetry`) lives with the
parsers it feeds.
"""

from recovery.kube.catalog import KubeJobCatalog
from recovery.kube.client import make_api_client
from recovery.kube.diagnosis import KubeRerunner
from recovery.kube.nodes import KubeNodeDirectory, KubeNodeOps
from recovery.kube.tokenreview import TokenReviewer

__all__ = [
    "KubeJobCatalog",
    "KubeNodeDirectory",
    "KubeNodeOps",
    "KubeRerunner",
    "TokenReviewer",
    "make_api_client",
]
