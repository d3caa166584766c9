"""The guard's calibration wiring: agreement at start-up, and the calibration audits' verdict.

Both are collective and reach the same result on every rank, so every rank refuses (or arms)
together:

* :func:`agree_at_start` — one ``all_gather_object`` of every rank's node, identity, replay
  environment and guard configuration; ranks that would not replay each other bitwise, or
  were given different configurations, refuse to start;
* :func:`check_calibration` — on a calibration audit, every rank's two self-replays against
  its own result (:func:`~detection.audit.calibration.calibration_causes`): a loop that does not
  reproduce itself refuses to arm (:class:`~detection.audit.calibration.NotReplayableError`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from detection import native
from detection.audit.calibration import (
    NotReplayableError,
    calibration_causes,
    check_agreement,
    replay_environment,
)
from detection.guard.config import GuardConfig, GuardConfigError
from detection.guard.counters import GuardCounters
from detection.guard.decision import OWN, REPLAY, all_finite
from detection.row.gather import all_gather_rows

__all__ = ["agree_at_start", "check_calibration"]

_log = logging.getLogger(__name__)


def agree_at_start(
    *,
    node: str,
    ident: dict[str, Any],
    config: GuardConfig,
    device: torch.device,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """Gather every rank's node, identity, replay environment and config once; refuse to
    start when they disagree: bitwise replay needs the same hardware model, builds,
    kernel flags and intra-op thread count, and an identical guard configuration.
    Returns every rank's node and identity, in rank order."""
    env = replay_environment(device)
    if device.type == "cpu":
        # the per-step sums of a bucket are compared bit for bit across ranks: one kernel for all
        env["native_kernels"] = native.available()
    mine = (node, env, repr(config), ident)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    problems = check_agreement([env for _, env, _, _ in everyone])
    if problems:
        raise GuardConfigError("; ".join(problems))
    if len({c for _, _, c, _ in everyone}) > 1:
        raise GuardConfigError("ranks were given different GuardConfig values")
    return tuple(n for n, _, _, _ in everyone), [i for _, _, _, i in everyone]


def check_calibration(
    step: int,
    self_replays: torch.Tensor,
    rows: Sequence[Sequence[int]],
    *,
    partners: Sequence[int],
    config: GuardConfig,
    counters: GuardCounters,
    group: dist.ProcessGroup | None,
    extra: dict[str, Any],
) -> None:
    """Collective, on calibration audits: every rank's two self-replays against its own
    result; a loop that does not reproduce itself — or ranks that disagree although each
    does — refuses to arm (:class:`NotReplayableError`, the same on every rank). A clean
    calibration audit is counted in ``counters.calibration_audits``."""
    selves = all_gather_rows(self_replays, group)
    if not all_finite(rows):
        return  # non-finite values prove nothing either way: not a clean audit
    causes = calibration_causes(
        step,
        partners,
        [r[OWN] for r in rows],
        [r[REPLAY] for r in rows],
        selves,
        mode=str(config.mode),
    )
    if causes:
        raise NotReplayableError(
            f"the audit refuses to arm after {counters.calibration_audits} clean "
            f"calibration audit(s) of {config.calibrate}: " + " | ".join(causes)
        )
    counters.calibration_audits += 1
    if counters.calibration_audits >= config.calibrate:
        _log.info("sdcguard armed after %d clean audits", config.calibrate, extra=extra)
