"""The training-job contract: what a training job must be given so the control plane can act.

docs/training-job.md is the human-readable form; this module is the check a rank runs at
start-up. Every item exists because an incident step fails without it:

- ``NODE_NAME`` from the downward API: cordon and replace address nodes, and a pod's host name
  is the pod's name (:mod:`detection.identity` refuses that guess under the contract);
- ``SDCGUARD_JOB_ID``: the value of the ``sdcguard.io/job-id`` label on the job object; the
  control plane finds the job by that label, never by taking the id for an object name;
- ``SDCGUARD_WEBHOOK_URL`` and ``SDCGUARD_WEBHOOK_SECRET``: where alarms go, and the key;
- ``SDCGUARD_CHECKPOINT_URI_PREFIX``: an ``s3://`` or ``file://`` URI the control plane can read
  (shared storage such as FSx for Lustre for ``file://``); checkpoints are recorded under it;
- ``SDCGUARD_RESUME_FROM`` (set by the control plane on resume) and ``SDCGUARD_REPLAY_*`` (set
  on a diagnostic replay, read by :mod:`detection.guard.trace_mode`).

Enforced (:class:`ContractError`) when :func:`~detection.identity.strict_contract` holds —
inside a Kubernetes pod or with ``SDCGUARD_CONTRACT=strict`` — and reported as warnings
otherwise, so a laptop run keeps working. Stdlib only: it runs before torch is imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from detection.identity import NODE_NAME_ENV, strict_contract

__all__ = [
    "CHECKPOINT_PREFIX_ENV",
    "JOB_ID_ENV",
    "JOB_ID_LABEL",
    "RESUME_ENV",
    "WEBHOOK_SECRET_ENV",
    "WEBHOOK_URL_ENV",
    "ContractError",
    "TrainingContract",
]

_log = logging.getLogger(__name__)

JOB_ID_LABEL = "sdcguard.io/job-id"
JOB_ID_ENV = "SDCGUARD_JOB_ID"
WEBHOOK_URL_ENV = "SDCGUARD_WEBHOOK_URL"
WEBHOOK_SECRET_ENV = "SDCGUARD_WEBHOOK_SECRET"
CHECKPOINT_PREFIX_ENV = "SDCGUARD_CHECKPOINT_URI_PREFIX"
RESUME_ENV = "SDCGUARD_RESUME_FROM"
READABLE_SCHEMES = ("s3", "file")


class ContractError(RuntimeError):
    """The job does not meet the training-job contract; ``problems`` lists each gap."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            "the training job does not meet the sdcguard contract (docs/training-job.md): "
            + "; ".join(problems)
        )
        self.problems = problems


@dataclass(frozen=True)
class TrainingContract:
    """What the environment gave this rank, checked."""

    job_id: str | None
    node: str | None
    webhook_url: str | None
    webhook_secret: str | None
    checkpoint_prefix: str | None
    resume_from: str | None
    strict: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainingContract:
        """Read and check the contract; raise :class:`ContractError` under the strict contract,
        else log each gap once as a warning."""
        environ: Mapping[str, str] = os.environ if env is None else env
        contract = cls(
            job_id=environ.get(JOB_ID_ENV) or None,
            node=environ.get(NODE_NAME_ENV) or None,
            webhook_url=environ.get(WEBHOOK_URL_ENV) or None,
            webhook_secret=environ.get(WEBHOOK_SECRET_ENV) or None,
            checkpoint_prefix=environ.get(CHECKPOINT_PREFIX_ENV) or None,
            resume_from=environ.get(RESUME_ENV) or None,
            strict=strict_contract(environ),
        )
        problems = contract.problems()
        if problems and contract.strict:
            raise ContractError(problems)
        for problem in problems:
            _log.warning("training-job contract: %s", problem, extra={"job": contract.job_id})
        return contract

    def problems(self) -> list[str]:
        """Every gap, in the order docs/training-job.md lists the items."""
        out: list[str] = []
        if not self.node:
            out.append(f"{NODE_NAME_ENV} is not set (downward API fieldPath spec.nodeName)")
        if not self.job_id:
            out.append(f"{JOB_ID_ENV} is not set (the job object's {JOB_ID_LABEL} label value)")
        if not self.webhook_url:
            out.append(f"{WEBHOOK_URL_ENV} is not set")
        elif urlsplit(self.webhook_url).scheme not in ("http", "https"):
            out.append(f"{WEBHOOK_URL_ENV} must be an http(s) URL, not {self.webhook_url!r}")
        if not self.webhook_secret:
            out.append(f"{WEBHOOK_SECRET_ENV} is not set (mount it from a Secret)")
        if not self.checkpoint_prefix:
            out.append(f"{CHECKPOINT_PREFIX_ENV} is not set (s3://bucket/prefix or file:///path)")
        elif not _readable_uri(self.checkpoint_prefix):
            out.append(
                f"{CHECKPOINT_PREFIX_ENV}={self.checkpoint_prefix!r} is no s3:// or file:// URI "
                "the control plane can read"
            )
        if self.resume_from and not _readable_uri(self.resume_from):
            out.append(f"{RESUME_ENV}={self.resume_from!r} is no s3:// or file:// URI")
        return out

    def checkpoint_uri(self, name: str) -> str | None:
        """The URI a checkpoint file ``name`` is recorded under, None without a prefix."""
        if not self.checkpoint_prefix:
            return None
        return f"{self.checkpoint_prefix.rstrip('/')}/{name}"


def _readable_uri(uri: str) -> bool:
    parts = urlsplit(uri)
    if parts.scheme == "s3":
        return bool(parts.netloc)
    return parts.scheme == "file" and parts.path.startswith("/")
