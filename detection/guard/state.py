"""The guard's learnt state, so that a resumed job is armed at its first step.

The per-step layer learns each rank's statistics (running means and spreads of the log bucket
norms and of the loss, per rank and statistic, and the cross-rank spread per statistic). Without
them a restarted job — after a preemption, or on a node that replaced the one an incident
condemned — would test against the early, conservative thresholds until it learnt them again.
:meth:`SDCGuard.state_dict <detection.guard.SDCGuard.state_dict>` returns them as plain Python
lists, floats and ints (``torch.save`` keeps every bit, ``torch.load(weights_only=True)`` reads
them); :meth:`~detection.guard.SDCGuard.load_state_dict` takes them over. The checksums'
tolerance is derived from the arithmetic (:mod:`detection.stepcheck.abft_bound`), so it holds
nothing to carry.

Every rank learns from the same all-gathered table, so every rank holds the same state: the one
that writes the checkpoint saves it, every rank loads that copy. The
:class:`~detection.gate.CheckpointGate` of a guard writes it beside each checkpoint it writes
(:func:`~detection.gate.state_path`: ``ckpt-<step>.sdcguard.pt``), with the step and the
weights' fingerprint it belongs to.

What is portable: the same model (parameter sizes, checked) at the same world size. Another world
size is refused (:class:`~detection.guard.config.GuardConfigError`): each rank's history is of its
own share of the batch, which a new world size changes. Another bucket layout (DDP's buckets
differ) is found at the first step and the statistics learn afresh there, logged. A changed
``StatsConfig`` is accepted: the references are measurements, the configuration how they are
read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from detection.gate import StepOutcome, state_path
from detection.guard.config import GuardConfig, GuardConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FORMAT", "VERSION", "load_state", "read_state", "state_of", "state_path"]

FORMAT = "sdcguard-guard-state"
VERSION = 1


class _Learner(Protocol):
    """The per-step layer that learns: the DDP guard's
    :class:`~detection.stepcheck.checks.StepChecks`, the sharded guard's
    :class:`~detection.guard.sharded_stats.ShardedStats` (each refuses the other's state)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Guard(Protocol):
    """What of an :class:`~detection.guard.SDCGuard` (or its sharded guard) its state is read
    from and written to (a protocol: the guard imports this module, not the reverse)."""

    @property
    def world_size(self) -> int: ...
    @property
    def params(self) -> Sequence[nn.Parameter]: ...
    @property
    def config(self) -> GuardConfig: ...
    @property
    def checks(self) -> _Learner: ...
    @property
    def last_outcome(self) -> StepOutcome | None: ...


def state_of(guard: _Guard) -> dict[str, Any]:
    """The guard's learnt state (see the module); call between steps, after the last one was
    decided (with ``defer_decision``, after ``guard.flush()`` on every rank)."""
    outcome = guard.last_outcome
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": guard.world_size,
        "step": outcome.step if outcome is not None else None,
        "parameters": [int(p.numel()) for p in guard.params],
        "stats": asdict(guard.config.stats),
        "per_step": guard.checks.state_dict(),
    }


def load_state(guard: _Guard, state: dict[str, Any]) -> None:
    """Validate ``state`` against ``guard`` and take it over (:class:`GuardConfigError` saying
    what does not match)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GuardConfigError("not an sdcguard guard state (guard.state_dict())")
    version = state.get("version")
    if version != VERSION:
        raise GuardConfigError(
            f"guard state version {version}: this sdcguard reads version {VERSION}"
        )
    if int(state["world_size"]) != guard.world_size:
        raise GuardConfigError(
            f"the guard state was learnt by {state['world_size']} ranks and this job has "
            f"{guard.world_size}: per-rank statistics do not carry over to another world size "
            "(start this job without it: the per-step layer is armed with its early thresholds)"
        )
    sizes = [int(p.numel()) for p in guard.params]
    if [int(n) for n in state["parameters"]] != sizes:
        raise GuardConfigError(
            "the guard state belongs to a model with other parameters "
            f"({len(state['parameters'])} tensors against {len(sizes)}): load the state of "
            "this model's checkpoint"
        )
    before = guard.checks.state_dict()
    try:
        guard.checks.load_state_dict(state["per_step"])
    except (KeyError, TypeError, ValueError) as exc:
        # a state refused half-way (another kind of guard's) leaves the guard as it was
        guard.checks.load_state_dict(before)
        raise GuardConfigError(f"guard state refused: {exc}") from exc


def read_state(checkpoint: Path | str) -> dict[str, Any] | None:
    """The guard state written beside ``checkpoint`` by the gate, or ``None`` if there is none."""
    import torch

    path = state_path(checkpoint)
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
