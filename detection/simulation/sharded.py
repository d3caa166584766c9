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
* ``act-flip`` — the target module's output in the rank's forward (unchanged from DDP).
* ``weight-flip`` — after ``optimizer.step``, an element of the shards this rank holds.

*The fingerprint.* :func:`final_fingerprint` is the unsharded model's (rank 0's parameters
and persistent buffers, DESIGN's report contract), summed over the mesh — collective: every
rank calls it. A stopped job cannot run a collective; it reports the guard's last decided
step instead, or this rank's own part when none was decided.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from detection.faults.injector import FaultInjector
from detection.faults.spec import FaultKind, FaultSpec
from detection.simulation.config import HarnessConfigError, TrainConfig
from detection.simulation.parallel import mesh_shape
from detection.weights.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
)
from detection.weights.sharded import local_parts, sharded_fingerprint
from detection.weights.state import model_state_tensors

__all__ = ["ShardedFaults", "final_fingerprint", "shard_model"]

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
    ) -> None:
        self.injector = FaultInjector(specs, rank=rank, node=node)
        self.injector.bind(model)  # act-flip's forward hook; elements over unsharded numels
        self._handles: list[Any] = [optimizer.register_step_post_hook(self._after_optimizer_step)]
        self._grad_hooks: list[Any] = []
        if any(s.kind in _GRADIENT_KINDS for s in specs):
            self._install_gradient_points(model)

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


def final_fingerprint(model: nn.Module, *, collective: bool) -> Fingerprint:
    """The unsharded model's fingerprint (collective), or — ``collective=False``, for a job
    that was stopped and must not wait on its peers — this rank's own part of it."""
    tensors = model_state_tensors(model)
    if collective:
        return sharded_fingerprint(tensors)
    parts = local_parts(tensors)
    if not parts.runs:
        return fingerprint_from_tensor(torch.zeros(2, dtype=torch.int64))
    return fingerprint_from_tensor(fingerprint_on_device(parts.runs, offsets=parts.offsets))
