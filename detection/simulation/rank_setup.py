"""One rank of ``sdcguard train`` set up before its first step: model, resume, gate, guard.

:func:`set_up` builds what :mod:`detection.simulation.rank` trains with (a :class:`RankJob`):
the built-in model seeded by ``seed`` — wrapped in DDP, or sharded for ``--parallel
fsdp|hsdp`` (:mod:`detection.simulation.sharded`) —, its optimizer, the state of
``--resume-from`` loaded and verified, the alarm sender, the checkpoint gate and the guard with
its learnt state. Kept apart from the loop because everything here happens once and in a fixed
order the determinism contract rests on: the weights are loaded before the guard exists, and
the loaded weights must show the fingerprint recorded with the checkpoint before the first step
runs (a resumed run replays bitwise the run it continues, or it does not start).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.audit.ring import AuditMode
from detection.faults.spec import FaultSpec
from detection.gate import CheckpointGate
from detection.guard import GuardConfig, GuardConfigError, SDCGuard
from detection.guard.sharded import ShardedGuard
from detection.guard.state import read_state
from detection.identity import RankIdentity
from detection.simulation.config import (
    KEY_ID_ENV,
    SECRET_ENV,
    HarnessConfigError,
    HarnessError,
    TrainConfig,
    injected_faults,
)
from detection.simulation.diagnostics import LocalGradientCapture
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.simulation.parallel import audit_every_of, is_sharded
from detection.simulation.sharded import (
    ShardedFaults,
    final_fingerprint,
    load_checkpoint,
    shard_model,
)
from detection.weights.load_check import verify_after_load
from detection.weights.state import model_state_tensors

__all__ = ["Batch", "RankJob", "guard_config_of", "set_up"]

_log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


def guard_config_of(config: TrainConfig) -> GuardConfig:
    """The guard's configuration for this job, the same on every rank. A sharded job's
    faults are the harness's to inject (:class:`ShardedFaults`): the sharded guard injects
    none."""
    return GuardConfig(
        audit_every=audit_every_of(config),
        audit_mode=AuditMode(config.audit_mode),
        seed=config.seed,
        halt_on_alarm=config.halt_on_alarm,
        inject=() if is_sharded(config) else injected_faults(config),
        abft=config.abft,
        step_checks=config.step_checks,
        skip_update_on_alarm=config.skip_update_on_alarm,
        defer_decision=config.defer_decision,
        abft_every=GuardConfig.abft_every if config.abft_every is None else config.abft_every,
    )


@dataclass
class RankJob:
    """What one rank trains with, set up once before the first step."""

    rank: int
    config: TrainConfig
    nodes: list[str]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ddp: nn.Module  # what the loop calls: the DDP wrapper, or the sharded model itself
    microbatch: Callable[[int, int], Batch]
    start: int
    capture: LocalGradientCapture | None
    sender: Any
    gate: CheckpointGate | None
    guard: SDCGuard | None
    trace: IO[str] | None = None
    faults: ShardedFaults | None = None  # a sharded job's --inject, applied by the harness

    @property
    def extra(self) -> dict[str, Any]:
        return {"job": self.config.job, "rank": self.rank, "node": self.nodes[self.rank]}


def set_up(rank: int, config: TrainConfig, secret: str | None) -> RankJob:
    """This rank's model, optimizer, gate and guard, resumed from ``--resume-from`` when
    given (the loaded weights verified against the recorded fingerprint first)."""
    nodes = config.node_names()
    cfg = ModelConfig()
    device = torch.device("cpu")
    torch.manual_seed(config.seed)
    model = TinyTransformer(cfg)
    if is_sharded(config):
        return _set_up_sharded(rank, config, secret, shard_model(model, config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, expected = _resume(config, model, optimizer)
    ddp = DistributedDataParallel(model)
    # DDP rebuilds its gradient buckets once, after the first backward, in the order gradients
    # became ready; gloo's ring sums each element in an order that depends on its position in the
    # bucket. A resumed run's first step would reduce with the initial layout and differ in the
    # last bits from the run it continues, so fix the layout before the first step (the same
    # call DDP's Join support makes): every step of every run then reduces with one layout.
    ddp.reducer._push_all_rebuilt_params()
    if expected is not None:
        verify_after_load(model_state_tensors(model), expected)
        extra = {"job": config.job, "rank": rank, "node": nodes[rank]}
        _log.info("resumed from %s at step %d", config.resume_from, start, extra=extra)

    def microbatch(step: int, r: int) -> Batch:
        return make_batch(cfg, config.seed, step, r, device)

    capture = LocalGradientCapture(list(model.parameters())) if config.trace is not None else None
    sender = None if config.plain else _sender(config, rank, secret)
    gate = _gate(rank, config, nodes, sender)
    job = RankJob(
        rank, config, nodes, model, optimizer, ddp, microbatch, start, capture, sender, gate, None
    )
    job.guard = _guard(job)
    if job.guard is not None and config.resume_from is not None:
        _load_guard_state(job.guard, config.resume_from, expected, job.extra)
    return job


def _set_up_sharded(
    rank: int, config: TrainConfig, secret: str | None, model: nn.Module
) -> RankJob:
    """A ``--parallel fsdp|hsdp`` rank: the sharded model is what the loop calls, the guard
    is the same call, the faults are the harness's; a resumed rank loads its shards before
    the guard exists, which then verifies them (no trace: the options refuse it)."""
    nodes, cfg = config.node_names(), ModelConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, expected, loaded = 0, None, None
    if config.resume_from is not None:
        start, expected, loaded = load_checkpoint(config.resume_from, model, optimizer)

    def microbatch(step: int, r: int) -> Batch:
        return make_batch(cfg, config.seed, step, r, torch.device("cpu"))

    sender = None if config.plain else _sender(config, rank, secret)
    gate = _gate(rank, config, nodes, sender)
    job = RankJob(
        rank, config, nodes, model, optimizer, model, microbatch, start, None, sender, gate, None
    )
    job.guard = _guard(job)
    if expected is not None and loaded is not None:
        _verify_sharded(job, expected)
        if job.guard is not None:
            _load_guard_state(job.guard, loaded, expected, job.extra)
        _log.info("resumed from %s at step %d", config.resume_from, start, extra=job.extra)
    specs = [FaultSpec.parse(s) for s in injected_faults(config)]
    if specs:
        guard = job.guard

        def recomputing() -> bool:  # a plain job (no guard) replays nothing
            return isinstance(guard, ShardedGuard) and guard.recomputing

        job.faults = ShardedFaults(
            specs, model, optimizer, rank=rank, node=nodes[rank], recomputing=recomputing
        )
    return job


def _verify_sharded(job: RankJob, expected: str) -> None:
    """The loaded shards hold the recorded weights (collective): the guard's check, or for a
    plain job the same fingerprint compared here."""
    if job.guard is not None:
        job.guard.verify_loaded(expected)
        return
    found = final_fingerprint(job.model, collective=True, parameters_only=True)
    if found.hex() != expected:
        raise HarnessError(
            f"--resume-from {job.config.resume_from}: loaded weights {found.hex()}, "
            f"recorded {expected}"
        )


def _gate(rank: int, config: TrainConfig, nodes: list[str], sender: Any) -> CheckpointGate | None:
    """Rank 0's gate, which reports and posts; a sharded job that checkpoints gives every rank
    one (the sharded write is collective), with no sink but rank 0's."""
    writes_everywhere = is_sharded(config) and config.checkpoint_every > 0
    if rank != 0 and not writes_everywhere:
        return None
    return CheckpointGate(
        config.checkpoint_dir,
        audit_every=audit_every_of(config),
        nodes=nodes,
        sink=sender if rank == 0 else None,
        job_id=config.job,
    )


def _resume(
    config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, str | None]:
    """The first step to run and the fingerprint the loaded weights must have (``None``: a
    fresh start)."""
    if config.resume_from is None:
        return 0, None
    state = torch.load(config.resume_from, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]) + 1, str(state["fingerprint"])


def _load_guard_state(
    guard: SDCGuard, checkpoint: Path, fingerprint: str | None, extra: dict[str, Any]
) -> None:
    """The per-step layer's learnt state written beside ``checkpoint`` (the gate writes it),
    so the resumed job is armed at its first step; a checkpoint without one starts learning."""
    state = read_state(checkpoint)
    if state is None:
        _log.info("no guard state beside %s: the statistics learn afresh", checkpoint, extra=extra)
        return
    if fingerprint is not None and state.get("fingerprint") != fingerprint:
        raise GuardConfigError(
            f"the guard state beside {checkpoint} belongs to other weights (fingerprint "
            f"{state.get('fingerprint')}, the checkpoint's {fingerprint})"
        )
    guard.load_state_dict(state)
    _log.info("guard state of step %s loaded", state.get("step"), extra=extra)


def _guard(job: RankJob) -> SDCGuard | None:
    """The guard of this rank (``None`` for ``--plain``, which registers the trace's hook
    on plain DDP instead)."""
    if job.config.plain:
        if job.capture is not None:
            assert isinstance(job.ddp, DistributedDataParallel)  # --trace is DDP's only
            job.ddp.register_comm_hook(None, job.capture.hook)
        return None
    nodes, rank = job.nodes, job.rank
    local_rank = sum(1 for r in range(rank) if nodes[r] == nodes[rank])
    return SDCGuard(
        job.ddp,
        job.optimizer,
        microbatch=job.microbatch,
        loss_fn=loss_fn,
        config=guard_config_of(job.config),
        identity=RankIdentity.detect(rank, local_rank, job.config.world_size, node=nodes[rank]),
        sender=job.sender,
        gate=job.gate,
        job_id=job.config.job,
        comm_hook=job.capture.hook if job.capture is not None else None,
    )


def _sender(config: TrainConfig, rank: int, secret: str | None) -> Any:
    if config.webhook is None:
        return None
    if not secret:
        raise HarnessConfigError(f"--webhook needs the secret in {SECRET_ENV}")
    from detection.transport.sender import AlarmSender  # imported only when asked: it needs httpx

    base = (
        config.checkpoint_dir / ".spool"
        if config.checkpoint_dir is not None
        else Path(tempfile.gettempdir()) / "sdcguard-spool" / config.job
    )
    spool = base / f"rank-{rank}"
    spool.mkdir(parents=True, exist_ok=True)
    key_id = os.environ.get(KEY_ID_ENV) or "default"
    return AlarmSender(config.webhook, secret, config.job, spool, key_id=key_id)
