"""``sdcguard train --parallel fsdp|hsdp``: the built-in model sharded as FSDP2's tutorial
shards it, the faults of ``--inject`` on a sharded rank, and the report's fingerprint.

*The model.* ``fully_shard`` on each transformer block, then on the root, over the mesh of
:func:`detection.simulation.parallel.mesh_shape` — 1-D for FSDP2, ``(replicate, shard)`` for
HSDP. Every rank builds the model from the same seed before sharding, so the shards are the
pieces of one model, and the guard is ``SDCGuard(model, optimizer, …)`` as for DDP (it hands
the model to :class:`~detection.guard.sharded.ShardedGuard`).

*The faults* (:class:`ShardedFaults`). The sharded guard injects nothing itself; the harness
makes the rank suffer the spec, at the points the spec names, through the same
:class:`~detection.faults.injector.FaultInjector` (same element numbering, same records):

* ``grad-flip`` / ``grad-nan`` — the rank's own *unsharded* gradient, before FSDP2 copies it
  into the reduce-scatter, so the guard's checks of the rank's input see the fault as they
  would see a corrupted local gradient. While a module runs its forward, FSDP2 has swapped its
  parameters for the unsharded ones autograd accumulates into: a gradient hook on each of
  them (installed only on a step the fault strikes, removed when the step ends) rewrites the
  gradient before it is accumulated. Elements are numbered over the unsharded parameters,
  as for DDP.
* ``act-flip`` — the target module's output in the rank's own forward. The guard's replays of
  a micro-batch (the audit's of its partner's, the calibration's of its own; the guard says
  when one runs, ``recomputing``) are recomputations, which a transient fault does not strike
  and a node's persistent fault does, as under DDP. Without this mark, the flip meant for the rank's
  own step would strike its replay of its partner too, and the audit would see two pairs
  disagree where one upset made one.
* ``weight-flip`` — after ``optimizer.step``, an element of the shards this rank holds.

*Checkpoints* (:func:`write_checkpoint`, :func:`load_checkpoint`). Every rank writes its
shards through the gate's ``write_sharded`` (``torch.distributed.checkpoint`` into
``ckpt-<step>/``, sealed by ``manifest.json``: :mod:`detection.weights.sharded_checkpoint`),
with the step and the fingerprint the guard decided for it (``meta``), and rank 0's buffers
on every rank; a resumed rank loads
them — from the directory or its manifest, the URI the ledger records — under any mesh,
*before* the guard is built (``get_state_dict`` makes an empty optimizer state by stepping
the optimizer), and the guard then verifies the loaded weights against that fingerprint.

*The fingerprint.* :func:`final_fingerprint` is the unsharded model's (rank 0's parameters
and persistent buffers, DESIGN's report contract), summed over the mesh — collective: every
rank calls it. A stopped job cannot run a collective; it reports the guard's last decided
step instead, or this rank's own part when none was decided.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from detection.faults.injector import FaultInjector
from detection.faults.spec import FaultKind, FaultSpec
from detection.gate import CheckpointGate, CheckpointRecord, StepOutcome
from detection.simulation.config import HarnessConfigError, TrainConfig
from detection.simulation.parallel import mesh_shape
from detection.weights.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
)
from detection.weights.sharded import local_parts, sharded_fingerprint
from detection.weights.sharded_checkpoint import load_sharded, sharded_directory
from detection.weights.state import model_state_tensors, persistent_buffers

__all__ = [
    "ShardedFaults",
    "final_fingerprint",
    "load_checkpoint",
    "shard_model",
    "write_checkpoint",
]

_log = logging.getLogger(__name__)

_GRADIENT_KINDS = (FaultKind.GRAD_FLIP, FaultKind.GRAD_NAN)
_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def shard_model(model: nn.Module, config: TrainConfig) -> nn.Module:
    """``model`` with ``fully_shard`` on each of its ``blocks`` and on the root, over this
    job's mesh (collective: every rank builds the mesh)."""
    # FSDP2 warns, on every rank, that the root returns a view (the head's logits) an in-place
    # op would break; the built-in loss only reshapes them. Said once here instead.
    warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
    shape = mesh_shape(config)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise HarnessConfigError("the model has no `blocks` to shard one by one")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _log.info(
        "%s: fully_shard on %d blocks and the root, mesh %s", config.parallel, len(blocks), shape
    )
    return model


def _broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's persistent buffers to every rank (collective). FSDP2 leaves buffers
    (BatchNorm's running statistics) to each rank, and a sharded checkpoint keeps one copy of
    a tensor every rank holds, from whichever rank: written without this, a resumed rank 0
    could get another rank's statistics and not continue bitwise as the run it resumes. Rank
    0's own are what a DDP job keeps (DDP broadcasts them from rank 0)."""
    for buffer in persistent_buffers(module):
        dist.broadcast(buffer, src=0)


class ShardedFaults:
    """The specs that strike this rank of a sharded job, applied from the harness's own hooks
    (see the module); :meth:`begin_step` / :meth:`end_step` bracket each training step."""

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        node: str,
        recomputing: Callable[[], bool],
    ) -> None:
        self.injector = FaultInjector(specs, rank=rank, node=node)
        self._recomputing = recomputing
        self.injector.bind(model)  # act-flip's forward hook; elements over unsharded numels
        self._handles: list[Any] = [optimizer.register_step_post_hook(self._after_optimizer_step)]
        self._grad_hooks: list[Any] = []
        self._recomputation: contextlib.AbstractContextManager[None] | None = None
        self._handles += [
            model.register_forward_pre_hook(self._before_root_forward),
            model.register_forward_hook(self._after_root_forward, always_call=True),
        ]
        if any(s.kind in _GRADIENT_KINDS for s in specs):
            self._install_gradient_points(model)

    def _before_root_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._recomputing() and self._recomputation is None:
            self._recomputation = self.injector.recomputing()
            self._recomputation.__enter__()

    def _after_root_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._leave_recomputation()

    def _leave_recomputation(self) -> None:
        if self._recomputation is not None:
            recomputation, self._recomputation = self._recomputation, None
            recomputation.__exit__(None, None, None)

    def _install_gradient_points(self, model: nn.Module) -> None:
        """A forward pre-hook on each module that owns parameters: on a step a gradient
        fault strikes, it hooks the gradient of the (unsharded) parameters it computes with."""
        owners: dict[str, list[tuple[int, str]]] = {}
        for position, (name, _) in enumerate(model.named_parameters()):
            owner, _, attr = name.rpartition(".")
            owners.setdefault(owner, []).append((position, attr))
        for owner, params in owners.items():
            module = model.get_submodule(owner)
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(params)))

    def _pre_forward(self, params: list[tuple[int, str]]) -> Any:
        def hook(module: nn.Module, _inputs: Any) -> None:
            if not self.injector.strikes(*_GRADIENT_KINDS):
                return
            for position, attr in params:
                param = getattr(module, attr)
                if isinstance(param, torch.Tensor) and param.requires_grad:
                    self._grad_hooks.append(param.register_hook(self._on_gradient(position)))

        return hook

    def _on_gradient(self, position: int) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            mine = grad.clone(memory_format=torch.contiguous_format)
            self.injector.on_local_gradient([(position, mine)])
            return mine

        return hook

    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.injector.after_optimizer_step(optimizer)

    def begin_step(self, step: int) -> None:
        self.injector.begin_step(step)

    def end_step(self) -> None:
        self._leave_recomputation()
        self.injector.end_step()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()

    def close(self) -> None:
        self.end_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.injector.close()


def final_fingerprint(
    model: nn.Module, *, collective: bool, parameters_only: bool = False
) -> Fingerprint:
    """The unsharded model's fingerprint (collective), or — ``collective=False``, for a job
    that was stopped and must not wait on its peers — this rank's own part of it. With
    ``parameters_only``, the parameters' alone: what the sharded guard decides and records."""
    tensors = list(model.parameters()) if parameters_only else model_state_tensors(model)
    if collective:
        return sharded_fingerprint(tensors)
    parts = local_parts(tensors)
    if not parts.runs:
        return fingerprint_from_tensor(torch.zeros(2, dtype=torch.int64))
    return fingerprint_from_tensor(fingerprint_on_device(parts.runs, offsets=parts.offsets))


def write_checkpoint(
    gate: CheckpointGate,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    outcome: StepOutcome | None,
    ranks: Sequence[int],
) -> CheckpointRecord:
    """Collective: the state after ``step`` through ``gate.write_sharded``, on every rank.
    ``outcome``: the guard's decision of ``step``; ``None`` for a plain job, whose record then
    carries the weights' fingerprint with no evidence (it stays pending)."""
    if outcome is None:
        fingerprint = sharded_fingerprint(model.parameters())  # the guard's: the parameters
        outcome = StepOutcome(step, tuple(ranks), fingerprint, vote_passed=False)
        gate.observe(outcome)
    _broadcast_buffers(model)
    msd, osd = get_state_dict(model, optimizer)
    meta = {"step": step, "fingerprint": outcome.fingerprint.hex()}
    return gate.write_sharded(step, {"model": msd, "optim": osd, "meta": meta})


def load_checkpoint(
    where: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, str, Path]:
    """Collective: load the sharded checkpoint at ``where`` (its directory or manifest) into
    ``model`` and ``optimizer`` — checked against its manifest first, resharded to this mesh —
    before any guard exists. Returns the first step to run, the fingerprint the loaded
    parameters must show (``guard.verify_loaded``), and the checkpoint's directory (the
    guard's state lies beside it)."""
    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd, "meta": {"step": -1, "fingerprint": ""}}
    load_sharded(where, state)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = state["meta"]
    if int(meta["step"]) < 0 or not meta["fingerprint"]:
        raise HarnessConfigError(f"--resume-from {where}: the checkpoint records no step")
    return int(meta["step"]) + 1, str(meta["fingerprint"]), sharded_directory(where)
