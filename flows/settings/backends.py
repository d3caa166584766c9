"""Settings of the backends: which ones the incident flow acts through, and where.

The
choice between the local backends (a simulated cluster, AWS mocked by moto) and the real ones
(Kubernetes, SageMaker HyperPod, S3) is made here, once, by ``SDCGUARD_RECOVERY_MODE`` — never
by a flag threaded through calls. ``local`` is the default: a missing setting must not reach a
real cluster. Who remediates an approved node is chosen here too, per cluster, by
``SDCGUARD_RECOVERY_REMEDIATION`` (``hyperpod`` by default: nothing an operator relied on
changes); each backend has a local counterpart on the simulated cluster.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from recovery.kube.remediation import DEFAULT_POOL_LABELS
from recovery.remediation import RemediationKind
from recovery.telemetry import DEFAULT_DIAG_IMAGE

__all__ = ["AwsSettings", "BackendMode", "KubeSettings", "RecoverySettings"]


class BackendMode(StrEnum):
    """Which side-effect backends the incident flow uses."""

    LOCAL = "local"
    """Simulated cluster state file, local training processes, fixture telemetry, moto."""
    REAL = "real"
    """Kubernetes API, SageMaker HyperPod, S3: the production cluster and account."""


class RecoverySettings(BaseSettings):
    """Backends and working directories of the incident flow (``SDCGUARD_RECOVERY_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_RECOVERY_", extra="ignore")

    mode: BackendMode = Field(
        default=BackendMode.LOCAL,
        description="local (simulated cluster, moto) or real (Kubernetes, HyperPod, S3).",
    )
    remediation: RemediationKind = Field(
        default=RemediationKind.HYPERPOD,
        description=(
            "Who remediates an approved node: hyperpod (SageMaker HyperPod replace/reboot), "
            "kubernetes (drain, delete the Node, the autoscaler replaces it), nvsentinel (an "
            "NVSentinel ExternalFault) or isolate (keep it out of service; a human takes over)."
        ),
    )
    state_dir: Path = Field(
        default=Path(".sdcguard"),
        description="Local mode: where the cluster state, job state and replays are kept.",
    )
    cluster_state: Path | None = Field(
        default=None,
        description="Local mode: the simulated cluster's JSON state (<state_dir>/cluster.json).",
    )
    telemetry_fixtures: Path | None = Field(
        default=None,
        description="Local mode: per-node telemetry fixtures (default: shipped with recovery).",
    )
    database_secret_block: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description=(
            "Name of a Prefect Secret block holding the ledger URL; read at run time and "
            "preferred over SDCGUARD_DATABASE_URL, so a deployment never carries the secret."
        ),
    )
    checkpoint_root: Path | None = Field(
        default=None,
        description="Local mode: root of the file checkpoint store (<state_dir>/checkpoints).",
    )
    checkpoint_bucket: str | None = Field(
        default=None,
        min_length=3,
        max_length=63,
        description=(
            "Real mode: default S3 bucket of checkpoints sdcguard writes itself; checkpoints "
            "are read wherever their recorded s3:// or file:// URI points."
        ),
    )
    replay_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=24 * 3600,
        description="Longest a single diagnostic replay may run before it counts as failed.",
    )

    def cluster_state_path(self) -> Path:
        return self.cluster_state or self.state_dir / "cluster.json"

    def checkpoint_root_path(self) -> Path:
        return self.checkpoint_root or self.state_dir / "checkpoints"

    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    def replay_dir(self) -> Path:
        return self.state_dir / "replays"


class AwsSettings(BaseSettings):
    """SageMaker HyperPod and S3 (``SDCGUARD_AWS_…``); credentials come from the AWS chain."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_AWS_", extra="ignore")

    endpoint_url: str | None = Field(
        default=None,
        max_length=2048,
        description=(
            "Override of the AWS endpoint: the local moto server in local mode (required there); "
            "unset in real mode."
        ),
    )
    region: str = Field(
        default="us-east-1",
        pattern=r"^[a-z]{2}(-[a-z]+)+-\d$",
        description="AWS region of the HyperPod cluster and the checkpoint bucket.",
    )
    hyperpod_cluster: str = Field(
        default="sdcguard-local",
        min_length=1,
        max_length=63,
        description="Name of the SageMaker HyperPod cluster whose instances are replaced.",
    )
    hyperpod_poll_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="How often a replacement or reboot is polled until its instance is Running.",
    )


class KubeSettings(BaseSettings):
    """The Kubernetes cluster the nodes and training jobs live in (``SDCGUARD_KUBE_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_KUBE_", extra="ignore")

    namespace: str = Field(
        default="default",
        min_length=1,
        max_length=63,
        description="Namespace of the training jobs.",
    )
    context: str | None = Field(
        default=None,
        max_length=253,
        description="kubeconfig context; unset inside the cluster (in-cluster config).",
    )
    replay_image: str | None = Field(
        default=None,
        max_length=512,
        description=(
            "Image for replays of the built-in harness only; a user's job is replayed from "
            "its own template (image, command, env, volumes), read from the cluster."
        ),
    )
    replay_namespace: str = Field(
        default="sdcguard",
        min_length=1,
        max_length=63,
        description="Namespace of the replay Jobs.",
    )
    spare_nodes: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Spare nodes the diagnostic replay may run on (JSON list of node names).",
    )
    stop_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="Longest a stop waits for the job's pods to be gone before it fails.",
    )
    telemetry_namespace: str = Field(
        default="sdcguard",
        min_length=1,
        max_length=63,
        description=(
            "sdcguard's own namespace, where the privileged diagnostic pod runs (its Pod "
            "Security level must admit it; the training namespace's need not)."
        ),
    )
    telemetry_service_account: str = Field(
        default="sdcguard-telemetry",
        min_length=1,
        max_length=253,
        description="Service account of the diagnostic pod (no token is mounted).",
    )
    telemetry_image: str = Field(
        default=DEFAULT_DIAG_IMAGE,
        min_length=1,
        max_length=512,
        description="Image of the diagnostic pod (dcgmi, nvidia-smi, dmesg).",
    )
    telemetry_runtime_class: str | None = Field(
        default="nvidia",
        max_length=253,
        description="runtimeClassName of the diagnostic pod; empty: the cluster default.",
    )
    exporter_namespace: str = Field(
        default="gpu-operator",
        min_length=1,
        max_length=63,
        description="Namespace of the dcgm-exporter pods.",
    )
    exporter_selector: str = Field(
        default="app=nvidia-dcgm-exporter",
        min_length=1,
        max_length=512,
        description="Label selector of the dcgm-exporter pods.",
    )
    exporter_port: int = Field(default=9400, ge=1, le=65535, description="dcgm-exporter port.")
    join_poll_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="How often a replacement's node is polled until it is Ready in the cluster.",
    )
    pool_labels: list[str] = Field(
        default_factory=lambda: list(DEFAULT_POOL_LABELS),
        max_length=16,
        description=(
            "kubernetes/nvsentinel remediation: labels whose values a new node must share with "
            "the node it replaces (JSON list; those the old node lacks are not required)."
        ),
    )
    nvsentinel_version: str = Field(
        default="v1",
        pattern=r"^v[0-9]+((alpha|beta)[0-9]+)?$",
        description="API version of NVSentinel's ExternalFault (group nvsentinel.dgxc.nvidia.com).",
    )
    nvsentinel_replace_action: str = Field(
        default="REPLACE_VM",
        pattern=r"^[A-Z_]{1,64}$",
        description="NVSentinel recommendedAction an approved replacement asks for.",
    )
    nvsentinel_reboot_action: str = Field(
        default="RESTART_VM",
        pattern=r"^[A-Z_]{1,64}$",
        description="NVSentinel recommendedAction an approved reboot asks for.",
    )
