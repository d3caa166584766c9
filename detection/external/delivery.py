"""Where an adapter sends its alarm, and the one call that sends it.

An adapter runs for a moment — a launcher wrapper whose training command just exited, a
trainer that is about to re-raise, a health check — and then its process ends. So delivery goes
through the rank's own spool-backed sender (:class:`detection.transport.AlarmSender`): the alarm
is on disk before the first attempt, the call waits a bounded time for the webhook's 2xx, and
what could not be delivered stays spooled for ``sdcguard spool drain`` — an unreachable webhook
never loses an alarm, and never holds the job's exit hostage.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from detection.external.alarm import ExternalAlarm
from detection.transport.sender import AlarmSender, SpoolBusyError
from detection.transport.signing import DEFAULT_KEY_ID

__all__ = [
    "KEY_ID_ENV",
    "SPOOL_ENV",
    "DeliveryConfigError",
    "WebhookTarget",
    "deliver",
    "deliver_all",
    "job_from_env",
    "node_from_env",
    "rank_from_env",
]

_log = logging.getLogger(__name__)

# The training-job contract's names (detection.contract, detection.identity: those modules
# import torch, which a launcher wrapper must not; tests/detection/external checks they agree).
JOB_ID_ENV = "SDCGUARD_JOB_ID"
WEBHOOK_URL_ENV = "SDCGUARD_WEBHOOK_URL"
WEBHOOK_SECRET_ENV = "SDCGUARD_WEBHOOK_SECRET"
NODE_NAME_ENV = "NODE_NAME"
KEY_ID_ENV = "SDCGUARD_WEBHOOK_KEY_ID"
SPOOL_ENV = "SDCGUARD_EXTERNAL_SPOOL"
_DEFAULT_SPOOL = Path(".sdcguard") / "external-spool"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class DeliveryConfigError(RuntimeError):
    """The adapter was not told where to send (no webhook URL, no secret, no job id)."""


@dataclass(frozen=True)
class WebhookTarget:
    """The webhook, the key that signs for the job, and the spool root undelivered alarms
    wait in (one directory per job, source and process below it)."""

    url: str
    secret: str
    spool_root: Path
    key_id: str = DEFAULT_KEY_ID

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebhookTarget:
        """The training-job contract's variables (docs/training-job.md): ``SDCGUARD_WEBHOOK_URL``,
        ``SDCGUARD_WEBHOOK_SECRET``, optional ``SDCGUARD_WEBHOOK_KEY_ID`` and
        ``SDCGUARD_EXTERNAL_SPOOL`` (default ``.sdcguard/external-spool``)."""
        env = os.environ if env is None else env
        url = env.get(WEBHOOK_URL_ENV, "").strip()
        secret = env.get(WEBHOOK_SECRET_ENV, "")
        if not url or not secret:
            raise DeliveryConfigError(
                f"{WEBHOOK_URL_ENV} and {WEBHOOK_SECRET_ENV} must be set to send external alarms"
            )
        return cls(
            url=url,
            secret=secret,
            spool_root=Path(env.get(SPOOL_ENV) or _DEFAULT_SPOOL),
            key_id=env.get(KEY_ID_ENV) or DEFAULT_KEY_ID,
        )


def job_from_env(env: Mapping[str, str] | None = None) -> str:
    """``SDCGUARD_JOB_ID``: the job's id as the control plane knows it."""
    env = os.environ if env is None else env
    job_id = env.get(JOB_ID_ENV, "").strip()
    if not job_id:
        raise DeliveryConfigError(f"{JOB_ID_ENV} must be set (or the job id given explicitly)")
    return job_id


def node_from_env(env: Mapping[str, str] | None = None) -> str:
    """The node this process runs on: ``NODE_NAME`` (the downward API), else the host name
    (outside Kubernetes, where the host name is the node's)."""
    env = os.environ if env is None else env
    return env.get(NODE_NAME_ENV, "").strip() or os.uname().nodename


def rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``RANK`` as torchrun, Slurm wrappers and the PyTorch operators set it; ``None`` if absent."""
    env = os.environ if env is None else env
    value = env.get("RANK", env.get("SLURM_PROCID", "")).strip()
    return int(value) if value.isdigit() else None


def deliver(alarm: ExternalAlarm, target: WebhookTarget, *, timeout_s: float = 10.0) -> bool:
    """Spool ``alarm`` and wait up to ``timeout_s`` for the webhook to take it.

    True when delivered; False when it stays spooled under ``target.spool_root`` (logged with
    the directory to drain). Never raises for an unreachable webhook.
    """
    return deliver_all([alarm], target, timeout_s=timeout_s)


def deliver_all(
    alarms: Sequence[ExternalAlarm], target: WebhookTarget, *, timeout_s: float = 10.0
) -> bool:
    """:func:`deliver` for several alarms of one job and source (a node's health reading):
    one spool, in order, one wait. True when every one was delivered."""
    if not alarms:
        return True
    first = alarms[0]
    if any(a.job_id != first.job_id for a in alarms):
        raise ValueError("deliver_all takes the alarms of one job")
    base = target.spool_root / _SAFE.sub("_", first.job_id)
    name = _SAFE.sub("_", f"{first.source}-{first.node or 'rank'}-{first.rank}")
    spool = base / name
    try:
        sender = AlarmSender(target.url, target.secret, first.job_id, spool, key_id=target.key_id)
    except SpoolBusyError:  # another process of this rank holds it: a spool of our own
        spool = base / f"{name}-{os.getpid()}"
        sender = AlarmSender(target.url, target.secret, first.job_id, spool, key_id=target.key_id)
    try:
        for alarm in alarms:
            sender.send_external_alarm(alarm.to_webhook())
        delivered = sender.flush(timeout_s)
    finally:
        sender.close(timeout_s=0.0)
    if not delivered:
        _log.error(
            "external alarm not delivered yet; it stays spooled: run `sdcguard spool drain %s`",
            spool,
            extra={"job": first.job_id, "node": first.node, "rank": first.rank, "step": first.step},
        )
    return delivered
