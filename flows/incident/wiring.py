"""Wiring: the side-effect backends of the incident flow, chosen once.

The flow never decides between a real and a local cluster: it asks :func:`current_backends`
for whatever was wired up. Tests and the demo inject local backends once with
:func:`use_backends`; a flow run started by a Prefect worker (no injection) builds them from
the settings (:func:`build_backends`, ``SDCGUARD_RECOVERY_MODE``). There is no ``dry_run`` flag
anywhere: a rehearsal is a different set of backends.

The injected backends live in a process-wide slot, not a context variable, on purpose: Prefect
runs tasks in worker threads and the webhook's local trigger runs whole flows in its own
threads, and every one of them must see the same backends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from db import Ledger
from flows.settings import (
    AwsSettings,
    BackendMode,
    DatabaseSettings,
    KubeSettings,
    PolicySettings,
    RecoverySettings,
    load_settings,
)
from recovery.aws.hyperpod import HyperPod
from recovery.aws.remediation import HyperPodRemediation
from recovery.checkpoints.s3 import S3CheckpointStore
from recovery.checkpoints.store import CheckpointStore, FileCheckpointStore
from recovery.checkpoints.uris import UriCheckpointStore
from recovery.diagnosis.plan import JobCatalog
from recovery.diagnosis.rerun import Rerunner
from recovery.errors import PermanentError
from recovery.isolation import IsolateRemediation
from recovery.jobs import JobControl
from recovery.kube.catalog import KubeJobCatalog
from recovery.kube.client import make_api_client
from recovery.kube.diagnosis import KubeRerunner
from recovery.kube.jobs import KubeJobFinder, KubeJobs
from recovery.kube.nodes import KubeNodeDirectory, KubeNodeOps
from recovery.kube.nvsentinel import NVSentinelRemediation
from recovery.kube.remediation import KubeReplaceRemediation
from recovery.local import LocalJobControl
from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster
from recovery.local.diagnosis import LocalRerunner
from recovery.local.nodes import LocalNodeDirectory, LocalNodeOps
from recovery.local.remediation import LocalFaultRemediation, LocalReplaceRemediation
from recovery.nodes import NodeDirectory, NodeOps
from recovery.remediation import Remediation, RemediationKind
from recovery.telemetry import (
    FixtureTelemetry,
    KubeTelemetry,
    TelemetryCollector,
    packaged_fixture_root,
)

__all__ = [
    "Backends",
    "build_backends",
    "current_backends",
    "use_backends",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backends:
    """Every outside system the incident flow acts on, plus the ledger it records in."""

    ledger: Ledger
    nodes: NodeOps
    jobs: JobControl
    telemetry: TelemetryCollector
    rerunner: Rerunner
    hyperpod: HyperPod
    checkpoints: CheckpointStore
    directory: NodeDirectory
    catalog: JobCatalog
    description: str
    """One line for logs and reports: which cluster and account these backends touch."""
    policy_limits: PolicySettings = field(default_factory=lambda: load_settings(PolicySettings))
    """The server's bounds on every run's policy (``SDCGUARD_POLICY_…`` of this process)."""
    remediation: Remediation | None = None
    """Who remediates an approved node; None: SageMaker HyperPod (``hyperpod``, the default)."""

    def remediator(self) -> Remediation:
        """The remediation backend: the one wired, else HyperPod over these backends."""
        if self.remediation is not None:
            return self.remediation
        return HyperPodRemediation(self.hyperpod, self.nodes, self.directory)


def build_backends(
    recovery: RecoverySettings | None = None,
    *,
    database_url: str | None = None,
    aws: AwsSettings | None = None,
    kube: KubeSettings | None = None,
    aws_session: Any | None = None,
) -> Backends:
    """Backends from settings: ``local`` (simulated cluster, moto) or ``real``.

    ``aws_session`` (a boto3 session, e.g. ``recovery.aws.local.LocalAws.session()`` with moto's
    dummy credentials) replaces the default credential chain; without it local mode needs some
    credentials in the environment, which go nowhere but the moto endpoint.
    """
    recovery = recovery or RecoverySettings()
    aws = aws or AwsSettings()
    kube = kube or KubeSettings()
    ledger = Ledger.from_url(database_url or _database_url(recovery))
    if recovery.mode is BackendMode.LOCAL:
        if not aws.endpoint_url:
            raise PermanentError(
                "wiring",
                "build",
                "local backends",
                "SDCGUARD_AWS_ENDPOINT_URL must name the local moto server in local mode: "
                "local mode never talks to real AWS",
            )
        cluster = LocalCluster(recovery.cluster_state_path())
        local_nodes = LocalNodeOps(cluster)
        local_remediations: dict[RemediationKind, Remediation] = {
            RemediationKind.KUBERNETES: LocalReplaceRemediation(cluster),
            RemediationKind.NVSENTINEL: LocalFaultRemediation(cluster),
            RemediationKind.ISOLATE: IsolateRemediation(local_nodes),
        }
        hyperpod = HyperPod.from_settings(
            aws.hyperpod_cluster,
            aws.region,
            aws.endpoint_url,
            session=aws_session,
            poll_interval_s=0.05,
        )
        return Backends(
            ledger=ledger,
            nodes=local_nodes,
            jobs=LocalJobControl(recovery.jobs_dir()),
            telemetry=FixtureTelemetry(recovery.telemetry_fixtures or packaged_fixture_root()),
            rerunner=LocalRerunner(recovery.replay_dir(), timeout_s=recovery.replay_timeout_s),
            hyperpod=hyperpod,
            # a local path, or a sharded checkpoint's manifest: each of its files is verified
            checkpoints=UriCheckpointStore(FileCheckpointStore(recovery.checkpoint_root_path())),
            directory=LocalNodeDirectory(cluster),
            catalog=LocalJobCatalog(recovery.jobs_dir()),
            description=(
                f"local: cluster {recovery.cluster_state_path()}, AWS mocked at {aws.endpoint_url}"
                f", remediation {recovery.remediation.value}"
            ),
            remediation=local_remediations.get(recovery.remediation),
        )
    api_client = make_api_client(context=kube.context)
    nodes = KubeNodeOps(api_client)
    remediation = _kube_remediation(recovery.remediation, api_client, nodes, kube)
    bucket = recovery.checkpoint_bucket

    def s3_store() -> S3CheckpointStore:
        return S3CheckpointStore.from_settings(
            bucket or "unset",
            region=aws.region,
            endpoint_url=aws.endpoint_url,
            session=aws_session,
        )

    return Backends(
        ledger=ledger,
        nodes=nodes,
        jobs=KubeJobs(api_client, stop_timeout_s=kube.stop_timeout_s),
        telemetry=KubeTelemetry(
            api_client,
            namespace=kube.telemetry_namespace,
            exporter_namespace=kube.exporter_namespace,
            exporter_label_selector=kube.exporter_selector,
            exporter_port=kube.exporter_port,
            diag_image=kube.telemetry_image,
            service_account=kube.telemetry_service_account,
            runtime_class_name=kube.telemetry_runtime_class or None,
        ),
        rerunner=KubeRerunner(
            api_client,
            image=kube.replay_image,
            namespace=kube.replay_namespace,
            timeout_s=recovery.replay_timeout_s,
        ),
        hyperpod=HyperPod.from_settings(
            aws.hyperpod_cluster,
            aws.region,
            aws.endpoint_url,
            session=aws_session,
            poll_interval_s=aws.hyperpod_poll_s,
        ),
        # Checkpoints are read where their recorded URI points: s3:// or file:// (shared FS).
        checkpoints=UriCheckpointStore(
            FileCheckpointStore(recovery.checkpoint_root_path()),
            s3_store,
            default="s3" if bucket else "file",
        ),
        directory=KubeNodeDirectory(nodes, kube.spare_nodes, poll_s=kube.join_poll_s),
        catalog=KubeJobCatalog(KubeJobFinder(api_client, kube.namespace)),
        description=(
            f"real: Kubernetes, HyperPod cluster {aws.hyperpod_cluster} ({aws.region}), "
            f"remediation {recovery.remediation.value}"
        ),
        remediation=remediation,
    )


def _kube_remediation(
    kind: RemediationKind, api_client: Any, nodes: KubeNodeOps, kube: KubeSettings
) -> Remediation | None:
    """The remediation a real cluster's settings name; None: HyperPod (built by Backends)."""
    if kind is RemediationKind.KUBERNETES:
        return KubeReplaceRemediation(
            api_client, nodes, pool_labels=kube.pool_labels, poll_s=kube.join_poll_s
        )
    if kind is RemediationKind.NVSENTINEL:
        return NVSentinelRemediation(
            api_client,
            version=kube.nvsentinel_version,
            replace_action=kube.nvsentinel_replace_action,
            reboot_action=kube.nvsentinel_reboot_action,
            pool_labels=kube.pool_labels,
            poll_s=kube.join_poll_s,
        )
    if kind is RemediationKind.ISOLATE:
        return IsolateRemediation(nodes)
    return None


def _database_url(recovery: RecoverySettings) -> str:
    """The ledger URL: from a Prefect Secret block when one is named, else from the settings."""
    if recovery.database_secret_block:
        from prefect.blocks.system import Secret

        secret = Secret.load(recovery.database_secret_block)
        return str(secret.get())  # type: ignore[union-attr]
    return DatabaseSettings().url


_slot_lock = threading.Lock()
_injected: list[Backends] = []
_built: dict[str, Backends] = {}


@contextlib.contextmanager
def use_backends(backends: Backends) -> Iterator[Backends]:
    """Make ``backends`` the ones every flow run in this process uses, for the block's length."""
    with _slot_lock:
        _injected.append(backends)
    log.info("incident backends wired: %s", backends.description)
    try:
        yield backends
    finally:
        with _slot_lock:
            _injected.remove(backends)


def current_backends(build: Callable[[], Backends] | None = None) -> Backends:
    """The injected backends, or (once per process) those the settings describe."""
    with _slot_lock:
        if _injected:
            return _injected[-1]
        if "settings" not in _built:
            _built["settings"] = (build or build_backends)()
            log.info("incident backends built from settings: %s", _built["settings"].description)
        return _built["settings"]
