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
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from db import Ledger
from detection.simulation import TrainArgsError, known_train_args
from flows.recovery_settings import (
    AwsSettings,
    BackendMode,
    KubeSettings,
    PolicySettings,
    RecoverySettings,
)
from flows.settings import DatabaseSettings, load_settings
from recovery.checkpoint_uris import UriCheckpointStore
from recovery.checkpoints import CheckpointStore, FileCheckpointStore, S3CheckpointStore
from recovery.cluster import LocalCluster
from recovery.errors import NotFoundError, PermanentError, TemporaryError
from recovery.hyperpod import HYPERPOD_NODE_PREFIX, HyperPod
from recovery.jobs import (
    FoundJob,
    JobControl,
    JobKind,
    JobRef,
    KubeJobFinder,
    KubeJobs,
    LocalJobControl,
)
from recovery.kube import make_api_client
from recovery.nodes import KubeNodeOps, LocalNodeOps, NodeOps
from recovery.replay import (
    JobSpec,
    LocalReplayRunner,
    ReplayRunner,
    StepRecord,
    UserJobTemplate,
    load_trace,
)
from recovery.replay_kube import KubeReplayRunner
from recovery.telemetry import (
    FixtureTelemetry,
    KubeTelemetry,
    TelemetryCollector,
    packaged_fixture_root,
)

__all__ = [
    "Backends",
    "JobCatalog",
    "KubeJobCatalog",
    "KubeNodeDirectory",
    "LocalJobCatalog",
    "LocalNodeDirectory",
    "NodeDirectory",
    "ReplayPlan",
    "StaticJobCatalog",
    "build_backends",
    "current_backends",
    "plan_from_harness_args",
    "use_backends",
]

log = logging.getLogger(__name__)


class NodeDirectory(Protocol):
    """Which nodes exist for the flow's purposes: spares to replay on, and replacement joins.

    A replaced instance comes back as a *new* node (EKS names it after the new instance; the
    local cluster gives it the next free ``node-N``); the flow needs that name to resume the
    job on it.
    """

    def spares(self, exclude: Collection[str]) -> list[str]:
        """Healthy, schedulable spare nodes, none of ``exclude``."""
        ...

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        """The node name under which ``new_instance_id`` (replacing ``old_node``) is ready,
        waiting at most ``timeout_s`` (what is left of the policy's replacement timeout)."""
        ...


class LocalNodeDirectory:
    """Spares and joins on the simulated cluster: a join *is* the cluster state change."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster

    def spares(self, exclude: Collection[str]) -> list[str]:
        return self._cluster.spares(exclude)

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        # Immediate: nothing to wait for. Idempotent in the cluster: a repeated join returns the
        # node already joined.
        return self._cluster.replace_instance(old_node, new_instance_id)


class KubeNodeDirectory:
    """Spares from a fixed list; a replacement is ready once ``hyperpod-<id>`` is Ready.

    The join wait has no limit of its own: the caller passes what is left of the policy's
    ``replacement_timeout_s`` (one bound for "HyperPod brought the instance up" and "it joined").
    """

    def __init__(self, nodes: NodeOps, spare_nodes: Sequence[str], *, poll_s: float = 10.0) -> None:
        self._nodes = nodes
        self._spares = list(spare_nodes)
        self._poll_s = poll_s

    def spares(self, exclude: Collection[str]) -> list[str]:
        ready = []
        for name in self._spares:
            if name in exclude:
                continue
            try:
                info = self._nodes.get(name)
            except NotFoundError:
                continue
            if info.ready and not info.unschedulable:
                ready.append(name)
        return ready

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        """Poll until the new node is Ready; looked at at least once, even with no time left."""
        name = f"{HYPERPOD_NODE_PREFIX}{new_instance_id}"
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(NotFoundError):
                if self._nodes.get(name).ready:
                    return name
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporaryError(
                    "kubernetes", "wait for node", name, f"not Ready after {timeout_s:g} s"
                )
            time.sleep(min(self._poll_s, left))


@dataclass(frozen=True)
class ReplayPlan:
    """What the diagnostic replay needs to know about a job beyond the ledger."""

    spec: JobSpec
    reference: tuple[StepRecord, ...] | None
    """The job's own per-step trace, if it wrote one: tells "software" from "inconclusive"."""


class JobCatalog(Protocol):
    """How a job computes — the inputs of a bitwise replay — and how it is addressed."""

    def ref(self, job_id: str) -> JobRef: ...

    def replay_plan(self, job_id: str) -> ReplayPlan:
        """Raise :class:`PermanentError` when the job's computation is not known here."""
        ...


class LocalJobCatalog:
    """Jobs launched by :class:`LocalJobControl`: their harness arguments are in its state
    directory (``<jobs_dir>/<job_id>.json``, ``original_args``), the documented record of
    every local launch."""

    def __init__(self, jobs_dir: Path) -> None:
        self._dir = jobs_dir

    def ref(self, job_id: str) -> JobRef:
        return JobRef(job_id, kind=JobKind.LOCAL)

    def replay_plan(self, job_id: str) -> ReplayPlan:
        path = self._dir / f"{job_id}.json"
        try:
            record = json.loads(path.read_text())
            args = [str(a) for a in record["original_args"]]
        except FileNotFoundError as err:
            raise NotFoundError("local-jobs", "read", f"job/{job_id}", "never launched") from err
        except (ValueError, KeyError, TypeError) as err:
            raise PermanentError("local-jobs", "read", str(path), f"bad record: {err}") from err
        return plan_from_harness_args(args)


class StaticJobCatalog:
    """Fixed plans by job id (tests; real mode reads them from the cluster, KubeJobCatalog)."""

    def __init__(
        self, plans: dict[str, ReplayPlan] | None = None, *, namespace: str = "default"
    ) -> None:
        self._plans = dict(plans or {})
        self._namespace = namespace

    def ref(self, job_id: str) -> JobRef:
        return JobRef(job_id, namespace=self._namespace, kind=JobKind.PYTORCHJOB)

    def replay_plan(self, job_id: str) -> ReplayPlan:
        try:
            return self._plans[job_id]
        except KeyError as err:
            raise PermanentError(
                "replay", "plan", f"job/{job_id}", "how this job computes is not known here"
            ) from err


class KubeJobCatalog:
    """Real mode: the job is the one object labelled ``sdcguard.io/job-id=<job id>`` in the
    training namespace (:class:`~recovery.jobs.KubeJobFinder`; none or several is a
    :class:`PermanentError` that goes to a human), and how it computes is its own pod template,
    read from the cluster at the moment of the replay."""

    def __init__(self, finder: KubeJobFinder) -> None:
        self._finder = finder

    def find(self, job_id: str) -> FoundJob:
        return self._finder.find(job_id)

    def ref(self, job_id: str) -> JobRef:
        return self._finder.find(job_id).ref

    def replay_plan(self, job_id: str) -> ReplayPlan:
        found = self._finder.find(job_id)
        templates = found.pod_templates()
        if not templates:
            raise PermanentError("replay", "plan", str(found.ref), "the job has no pod template")
        # The first replica (PyTorchJob Master) holds the command every rank runs.
        first = "Master" if "Master" in templates else sorted(templates)[0]
        _, template = templates[first]
        return ReplayPlan(
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


def plan_from_harness_args(args: Sequence[str]) -> ReplayPlan:
    """The replay inputs from ``sdcguard train`` arguments (the options DESIGN fixes)."""
    try:
        known = known_train_args(args)
    except TrainArgsError as err:
        raise PermanentError("replay", "plan", "harness arguments", str(err)) from err
    trace = known.trace
    reference = tuple(load_trace(trace)) if trace is not None and trace.is_file() else None
    spec = JobSpec(
        world_size=known.world_size,
        seed=known.seed,
        threads=known.threads,
        audit_mode=known.audit_mode,
        inject=tuple(known.inject),
    )
    return ReplayPlan(spec=spec, reference=reference)


@dataclass(frozen=True)
class Backends:
    """Every outside system the incident flow acts on, plus the ledger it records in."""

    ledger: Ledger
    nodes: NodeOps
    jobs: JobControl
    telemetry: TelemetryCollector
    replay: ReplayRunner
    hyperpod: HyperPod
    checkpoints: CheckpointStore
    directory: NodeDirectory
    catalog: JobCatalog
    description: str
    """One line for logs and reports: which cluster and account these backends touch."""
    policy_limits: PolicySettings = field(default_factory=lambda: load_settings(PolicySettings))
    """The server's bounds on every run's policy (``SDCGUARD_POLICY_…`` of this process)."""


def build_backends(
    recovery: RecoverySettings | None = None,
    *,
    database_url: str | None = None,
    aws: AwsSettings | None = None,
    kube: KubeSettings | None = None,
    aws_session: Any | None = None,
) -> Backends:
    """Backends from settings: ``local`` (simulated cluster, moto) or ``real``.

    ``aws_session`` (a boto3 session, e.g. ``recovery.aws_local.LocalAws.session()`` with moto's
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
        hyperpod = HyperPod.from_settings(
            aws.hyperpod_cluster,
            aws.region,
            aws.endpoint_url,
            session=aws_session,
            poll_interval_s=0.05,
        )
        return Backends(
            ledger=ledger,
            nodes=LocalNodeOps(cluster),
            jobs=LocalJobControl(recovery.jobs_dir()),
            telemetry=FixtureTelemetry(recovery.telemetry_fixtures or packaged_fixture_root()),
            replay=LocalReplayRunner(recovery.replay_dir(), timeout_s=recovery.replay_timeout_s),
            hyperpod=hyperpod,
            checkpoints=FileCheckpointStore(recovery.checkpoint_root_path()),
            directory=LocalNodeDirectory(cluster),
            catalog=LocalJobCatalog(recovery.jobs_dir()),
            description=(
                f"local: cluster {recovery.cluster_state_path()}, AWS mocked at {aws.endpoint_url}"
            ),
        )
    api_client = make_api_client(context=kube.context)
    nodes = KubeNodeOps(api_client)
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
        replay=KubeReplayRunner(
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
        description=f"real: Kubernetes, HyperPod cluster {aws.hyperpod_cluster} ({aws.region})",
    )


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
