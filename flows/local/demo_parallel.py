"""``sdcguard demo --parallel ddp|fsdp|hsdp``: the layout the demo's jobs run under, and what
an incident of a sharded job can show end to end.

The demo's proof is a resume from the newest *verified* checkpoint before the fault, ending on
the fault-free run's fingerprint bit for bit. What that asks of a sharded job decides the
layout and refuses the rest, before anything starts (:func:`parallel_problems`):

* **HSDP, replicas of** :data:`HSDP_SHARD_SIZE` **shards** (4 ranks: 2 replicas x 2 shards,
  rank-major — ranks 0-1 hold replica 0, ranks 2-3 replica 1). A sharded job's checkpoint
  becomes ``verified`` only by a passed weight vote across replicas, so only HSDP verifies one;
  its checkpoints are ``ckpt-<step>/manifest.json`` directories, and the resumed job is
  launched with the same ``--parallel`` options and ``--resume-from`` that manifest.
* **Pure FSDP2** has one copy of each shard: no vote, and a passed ring audit does not show a
  stored shard right (every rank gathers the same wrong shard alike) — no checkpoint is ever
  verified, so no incident could resume. Refused.
* **The fault** must be one the harness injects into a sharded rank *and* the sharded guard
  names a node for (the fix replaces only named nodes): a NaN or flipped gradient, a flipped
  activation — each rank's own gradient is checked before the reduce-scatter. A weight flip
  is named only by a vote of three or more replicas; two can say only that they differ.
* **No diagnostic replay.** The replay traces a job as DDP; a sharded job's guard refuses that
  (:class:`~recovery.diagnosis.plan.NotReplayable`), the replay stage records an inconclusive
  verdict, and the policy never approves on one: a person approves (``--approve-in-ui``).
* **No trace**, hence no loss plot: the sharded harness refuses ``--trace``.
"""

from __future__ import annotations

from collections.abc import Sequence

from detection.faults.spec import FaultKind
from detection.simulation.parallel import PARALLEL_MODES, SHARDED_FAULT_KINDS

__all__ = [
    "HSDP_SHARD_SIZE",
    "NAMED_UNDER_SHARDING",
    "layout_args",
    "layout_words",
    "parallel_problems",
    "writes_trace",
]

HSDP_SHARD_SIZE = 2
"""Ranks per replica of the demo's HSDP job; the world divides into replicas of this size."""

NAMED_UNDER_SHARDING = frozenset(
    k.value for k in SHARDED_FAULT_KINDS if k is not FaultKind.WEIGHT_FLIP
)
"""Demo faults the sharded guard names a node for on any mesh (each rank's own gradient is
checked before the reduce-scatter); ``weight-flip`` is named only by 3+ replicas."""

_VOTE_NAMES = 3  # replicas a weight vote needs to name the odd one out


def is_sharded(parallel: str) -> bool:
    return parallel != "ddp"


def layout_args(parallel: str) -> list[str]:
    """The ``sdcguard train`` options of the layout; none for DDP, the default."""
    if parallel == "hsdp":
        return ["--parallel", "hsdp", "--shard-size", str(HSDP_SHARD_SIZE)]
    if parallel == "fsdp":
        return ["--parallel", "fsdp"]
    return []


def layout_words(parallel: str, world_size: int) -> str:
    """The layout as the console says it."""
    if parallel == "hsdp":
        replicas = world_size // HSDP_SHARD_SIZE
        return f"HSDP, {replicas} replicas x {HSDP_SHARD_SIZE} shards"
    return "FSDP2, one copy of each shard" if parallel == "fsdp" else "DDP"


def writes_trace(parallel: str) -> bool:
    """Whether the job writes a per-step trace (``--trace``): DDP jobs only."""
    return not is_sharded(parallel)


def parallel_problems(
    parallel: str,
    *,
    fault: str,
    world_size: int,
    transient: bool,
    approve_in_ui: bool,
) -> Sequence[str]:
    """Why this demo cannot show a sharded incident end to end; empty when it can (and for
    DDP, whose checks are the demo's own)."""
    if parallel not in PARALLEL_MODES:
        return [f"--parallel must be one of {', '.join(PARALLEL_MODES)}"]
    if not is_sharded(parallel):
        return []
    why = f"--parallel {parallel}"
    problems: list[str] = []
    if parallel == "fsdp":
        problems.append(
            f"{why}: no checkpoint is ever verified (one copy of each shard: no weight vote, "
            "and a passed audit does not show a stored shard right), so the incident could "
            "not resume; use --parallel hsdp"
        )
    if parallel == "hsdp" and (world_size % HSDP_SHARD_SIZE or world_size // HSDP_SHARD_SIZE < 2):
        problems.append(
            f"{why}: the ranks form replicas of {HSDP_SHARD_SIZE} shards and a vote needs 2 or "
            f"more replicas: --world-size a multiple of {HSDP_SHARD_SIZE}, at least "
            f"{2 * HSDP_SHARD_SIZE}"
        )
    if transient:
        problems.append(
            f"{why}: --transient upsets an auditor's recomputation (in=recompute), which a "
            "sharded job's harness does not inject"
        )
    replicas = world_size // HSDP_SHARD_SIZE if parallel == "hsdp" else 1
    named = fault in NAMED_UNDER_SHARDING or (
        fault == FaultKind.WEIGHT_FLIP.value and replicas >= _VOTE_NAMES
    )
    if not named:
        kinds = ", ".join(sorted(NAMED_UNDER_SHARDING))
        problems.append(
            f"{why}: --fault {fault} is not named on a node by the sharded guard on this "
            f"layout (it is: {kinds}; weight-flip with {_VOTE_NAMES}+ replicas)"
        )
    if not approve_in_ui:
        problems.append(
            f"{why} needs --approve-in-ui: a sharded job is not replayed diagnostically, so "
            "its verdict is inconclusive and a person approves"
        )
    return problems
