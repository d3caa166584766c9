"""What ``sdcguard train`` records for a diagnostic run: the per-step trace and the probe.

* ``--trace FILE`` — one JSON line per step (rank 0 writes): every rank's loss and
  local-gradient fingerprint, rank 0's weights after the step. A diagnostic: one extra
  collective per step, and a copy of each local gradient (:class:`LocalGradientCapture`).
* ``--probe-step S --probe FILE`` — per-submodule fingerprints of forward outputs and of the
  gradients w.r.t. module inputs at step ``S`` (:class:`Probe`), from every rank.
"""

# No ``from __future__ import annotations`` here: DDP compares a comm hook's annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects when it is registered.

import json
import warnings
from collections.abc import Sequence
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from detection.gate import StepOutcome
from detection.row.gather import all_gather_rows
from detection.simulation.config import TrainConfig
from detection.weights.fingerprint import fingerprint_on_device, to_fingerprint, weight_fingerprint

__all__ = ["LocalGradientCapture", "Probe", "open_trace", "trace_step", "write_probe"]


class LocalGradientCapture:
    """Comm hook for ``--trace``: keeps a copy of each local gradient before all-reduce (a
    diagnostic that may cost), then all-reduces like DDP's default."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.grads: dict[int, torch.Tensor] = {}

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self.grads[self._index[id(p)]] = g.detach().clone()
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def fingerprint(self) -> torch.Tensor:
        tensors = [self.grads.get(i, torch.zeros_like(p)) for i, p in enumerate(self.params)]
        self.grads.clear()
        return fingerprint_on_device(tensors)


class Probe:
    """Per-submodule fingerprints of forward outputs and of gradients w.r.t. module inputs at
    one step. The first call per module wins, so an audit replay later in the step is ignored."""

    def __init__(self, module: nn.Module) -> None:
        # Modules fed only integer tokens (embeddings) have no input gradient; the hook then
        # fires with None and we record nothing for them, which is what we want.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.forward: dict[str, str] = {}
        self.backward: dict[str, str] = {}
        self.order: list[str] = []
        self.kinds: dict[str, str] = {}
        self._handles: list[Any] = []
        for name, sub in module.named_modules():
            if not name:
                continue
            self.kinds[name] = type(sub).__name__
            self._handles.append(sub.register_forward_hook(self._on_forward(name)))
            self._handles.append(sub.register_full_backward_hook(self._on_backward(name)))

    @staticmethod
    def _hex(values: Any) -> str | None:
        items = values if isinstance(values, tuple | list) else (values,)
        tensors = [t.detach() for t in items if isinstance(t, torch.Tensor)]
        return weight_fingerprint(tensors).hex() if tensors else None

    def _on_forward(self, name: str) -> Any:
        def hook(_m: nn.Module, _inputs: Any, output: Any) -> None:
            if name not in self.forward:
                value = self._hex(output)
                if value is not None:
                    self.forward[name] = value
                    self.order.append(name)

        return hook

    def _on_backward(self, name: str) -> Any:
        def hook(_m: nn.Module, grad_input: Any, _grad_output: Any) -> None:
            if name not in self.backward:
                value = self._hex(grad_input)
                if value is not None:
                    self.backward[name] = value

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def open_trace(config: TrainConfig, rank: int) -> IO[str] | None:
    if config.trace is None or rank != 0:
        return None
    config.trace.parent.mkdir(parents=True, exist_ok=True)
    mode = "a" if config.resume_from is not None and config.trace.exists() else "w"
    return config.trace.open(mode)


def trace_step(
    trace: Any,
    step: int,
    loss: torch.Tensor,
    capture: LocalGradientCapture | None,
    params: Sequence[torch.Tensor],
    outcome: StepOutcome | None,
) -> None:
    """One JSON line per step (rank 0 writes): losses and local-gradient fingerprints of every
    rank, rank 0's weights after the step. A diagnostic: one extra collective per step."""
    grad = capture.fingerprint() if capture is not None else torch.zeros(2, dtype=torch.int64)
    row = torch.cat([loss.detach().reshape(1).to(torch.float64).view(torch.int64), grad])
    rows = all_gather_rows(row)
    if trace is None:
        return
    weights = outcome.fingerprint if outcome is not None else weight_fingerprint(params)
    losses = [torch.tensor([r[0]], dtype=torch.int64).view(torch.float64).item() for r in rows]
    trace.write(
        json.dumps(
            {
                "step": step,
                "losses": losses,
                "grad_fingerprints": [to_fingerprint(r[1], r[2]).hex() for r in rows],
                "weight_fingerprint": weights.hex(),
            }
        )
        + "\n"
    )
    trace.flush()


def write_probe(config: TrainConfig, rank: int, probe: Probe) -> None:
    mine = {"forward": probe.forward, "backward": probe.backward}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0 or config.probe is None:
        return
    body = {
        "step": config.probe_step,
        "ranks": {str(r): v for r, v in enumerate(everyone)},
        "order": probe.order,
        "kinds": probe.kinds,
    }
    config.probe.parent.mkdir(parents=True, exist_ok=True)
    config.probe.write_text(json.dumps(body, indent=1) + "\n")
