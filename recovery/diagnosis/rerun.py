"""A diagnostic rerun: recompute a suspect step range of a job on one chosen node.

A rerun is evidence only if it is deterministic: the same checkpoint, micro-batches, RNG state
(dropout), intra-op thread count, library versions and device model as the original. This module
holds what a rerun is (:class:`RerunRequest` in, :class:`RerunResult` out, the per-step
:class:`StepRecord`), the :class:`Rerunner` interface its backends implement
(:class:`~recovery.local.diagnosis.LocalRerunner` on the simulated cluster,
:class:`~recovery.kube.diagnosis.KubeRerunner` on Kubernetes), and the ``sdcguard train``
options that run one (:func:`harness_args`). :mod:`recovery.diagnosis.verdict` turns the reruns
of several nodes into a verdict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "JobSpec",
    "RerunRequest",
    "RerunResult",
    "Rerunner",
    "StepRecord",
    "UserJobTemplate",
    "harness_args",
    "load_trace",
]


@dataclass(frozen=True)
class StepRecord:
    """One step of a trace: per-rank losses and local gradient fingerprints, weights after it."""

    step: int
    losses: tuple[float, ...]
    grad_fingerprints: tuple[str, ...]
    weight_fingerprint: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepRecord:
        return cls(
            step=int(raw["step"]),
            losses=tuple(float(x) for x in raw["losses"]),
            grad_fingerprints=tuple(str(x) for x in raw.get("grad_fingerprints", [])),
            weight_fingerprint=str(raw["weight_fingerprint"]),
        )

    def same_as(self, other: StepRecord) -> bool:
        # Bitwise: float equality of the same bits is exact; a rerun is evidence only if exact.
        return (
            self.losses == other.losses
            and self.grad_fingerprints == other.grad_fingerprints
            and self.weight_fingerprint == other.weight_fingerprint
        )


@dataclass(frozen=True)
class UserJobTemplate:
    """The user's own job, as read from the cluster: a rerun runs *this* (its image, command,
    env and volumes), pinned to one node, with the guard told to trace (detection.replay_mode).

    ``pod_template`` is the pod template of the job's first replica (PyTorchJob ``Master``, or
    the batch/v1 Job's template); ``namespace`` is the job's, where its volumes and secrets are.
    """

    job_name: str
    namespace: str
    pod_template: Mapping[str, Any] = field(repr=False)
    gpus: int = 0


@dataclass(frozen=True)
class JobSpec:
    """What it takes to recompute a job's steps: the harness options that shape the computation,
    or (``template``) the user's own job to run in replay mode."""

    world_size: int
    seed: int
    threads: int = 1
    audit_mode: str = "loss"
    inject: tuple[str, ...] = ()
    template: UserJobTemplate | None = field(default=None, compare=False)

    def persistent_faults(self) -> tuple[str, ...]:
        """Only node-bound faults follow a rerun; a transient fault does not recur."""
        return tuple(spec for spec in self.inject if "@node=" in spec)


@dataclass(frozen=True)
class RerunRequest:
    job_id: str
    checkpoint_uri: str
    checkpoint_step: int
    end: int
    node: str
    spec: JobSpec
    probe_step: int | None = None

    @property
    def start(self) -> int:
        return self.checkpoint_step + 1


@dataclass(frozen=True)
class RerunResult:
    node: str
    steps: tuple[StepRecord, ...]
    probe: dict[str, Any] | None = None
    log_path: str | None = None


class Rerunner(Protocol):
    """Runs one rerun. A runner whose nodes are separate machines says so with a class
    attribute ``parallel = True``, and a diagnosis then runs its reruns of different nodes
    at once (:mod:`recovery.diagnosis.batch`); without it they run one after the other."""

    def rerun(self, request: RerunRequest) -> RerunResult:
        """Recompute steps ``request.start .. request.end`` on ``request.node``."""
        ...


def harness_args(request: RerunRequest, *, trace: Path | str, probe: Path | str) -> list[str]:
    """``sdcguard train`` options that recompute ``request``: every rank on the one node, from
    the checkpoint, with the job's own seed, thread count and node-bound (hardware) faults."""
    spec = request.spec
    args = [
        "--world-size", str(spec.world_size),
        "--nodes", ",".join([request.node] * spec.world_size),
        "--seed", str(spec.seed),
        "--steps", str(request.end + 1),
        "--audit-every", "0",
        "--audit-mode", spec.audit_mode,
        "--threads", str(spec.threads),
        "--resume-from", request.checkpoint_uri,
        "--job-id", f"{request.job_id}-replay-{request.node}",
        "--trace", str(trace),
    ]  # fmt: skip
    for fault in spec.persistent_faults():
        args += ["--inject", fault]
    if request.probe_step is not None:
        args += ["--probe-step", str(request.probe_step), "--probe", str(probe)]
    return args


def load_trace(path: Path) -> list[StepRecord]:
    records = []
    with path.open() as fh:
        for line in fh:
            if line.strip():
                records.append(StepRecord.from_dict(json.loads(line)))
    return records
