"""Fault injection exactly as DESIGN's fault spec (:mod:`detection.faults.spec`), for tests,
demos and diagnostic runs: the hooks and flips that make a rank suffer a parsed spec.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from detection.faults.spec import FaultInjectionError, FaultKind, FaultSpec, element_index
from detection.weights.state import optimizer_state_tensors

__all__ = ["FaultInjector", "flip_bit_"]

_log = logging.getLogger(__name__)


def flip_bit_(flat: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` (float32 numbering) of ``flat[index]`` in place, on the tensor's device and
    without a host synchronisation. ``flat`` must be a contiguous floating-point tensor."""
    if not flat.is_floating_point():
        raise FaultInjectionError(f"cannot flip a bit of a {flat.dtype} tensor")
    if not flat.is_contiguous():
        raise FaultInjectionError("cannot flip a bit of a non-contiguous tensor in place")
    width = flat.element_size() * 8
    local_bit = bit + width - 32
    if not 0 <= local_bit < width:
        raise FaultInjectionError(f"bit {bit} has no counterpart in {flat.dtype}")
    word = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    mask = -(1 << local_bit) if local_bit == width - 1 else 1 << local_bit
    with torch.no_grad():
        cell = flat.detach().reshape(-1)[index : index + 1]
        cell.view(word).bitwise_xor_(mask)


def _set_nan_(flat: torch.Tensor, index: int) -> None:
    if not flat.is_contiguous():
        raise FaultInjectionError("cannot write a NaN into a non-contiguous tensor in place")
    with torch.no_grad():
        flat.detach().reshape(-1)[index : index + 1].fill_(float("nan"))


def _held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (a view of its storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _FlatMap:
    """Maps a flat index over a concatenation of tensors to (tensor position, offset)."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        self.total = sum(self.numels)

    def locate(self, flat: int) -> tuple[int, int]:
        for position, n in enumerate(self.numels):
            if flat < n:
                return position, flat
            flat -= n
        raise FaultInjectionError(f"flat index {flat} beyond {self.total} elements")


class FaultInjector:
    """Applies the specs that strike this rank, at the points the guard calls it from.

    The guard brackets each step with :meth:`begin_step`/:meth:`end_step` and each partner
    recomputation with :meth:`recomputing`, so a fault knows its step and whether it is a
    recomputation.
    Outside a step nothing is injected.
    """

    def __init__(self, specs: Sequence[FaultSpec], *, rank: int, node: str) -> None:
        self.specs = tuple(specs)
        self.rank = rank
        self.node = node
        self._step: int | None = None
        self._replay = False
        self._params: list[torch.Tensor] = []
        self._grad_map = _FlatMap([])
        self._handles: list[Any] = []
        self.injected: list[tuple[int, str, bool]] = []  # (step, spec, replay) — evidence for tests
        # (step, spec, bit was set before the flip): for an exponent bit, 0 → 1 raises the value
        self.flips: list[tuple[int, str, bool]] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def bind(self, module: nn.Module) -> None:
        """Resolve targets on ``module`` (the unwrapped model) and install the act-flip hook."""
        self._params = list(module.parameters())
        self._grad_map = _FlatMap([p.numel() for p in self._params])
        for target_name in {s.module or "" for s in self.specs if s.kind is FaultKind.ACT_FLIP}:
            target = self._resolve_module(module, target_name)
            handle = target.register_forward_hook(self._make_act_hook(target_name))
            self._handles.append(handle)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def begin_step(self, step: int) -> None:
        self._step = step
        self._replay = False

    def end_step(self) -> None:
        self._step = None

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Mark a partner recomputation: inside, this node's persistent faults apply, and a
        transient fault only when its spec names the recomputation (``in=recompute``)."""
        previous = self._replay
        self._replay = True
        try:
            yield
        finally:
            self._replay = previous

    # -- queries ---------------------------------------------------------------------------------
    def any_active(self) -> bool:
        """Whether any fault strikes this rank's own computation in the current step."""
        return self._step is not None and any(self._active_specs())

    def strikes(self, *kinds: FaultKind) -> bool:
        """Whether a fault of one of ``kinds`` strikes this rank's computation now."""
        return any(self._active_specs(*kinds))

    def _active_specs(self, *kinds: FaultKind) -> Iterator[FaultSpec]:
        if self._step is None:
            return
        for spec in self.specs:
            if kinds and spec.kind not in kinds:
                continue
            if spec.applies(rank=self.rank, node=self.node, step=self._step, replay=self._replay):
                yield spec

    # -- injection points ------------------------------------------------------------------------
    def on_local_gradient(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """``grads``: (parameter position, gradient view) pairs of the rank's local gradient —
        a DDP bucket before all-reduce, or the recomputed ``.grad`` of a replay."""
        for spec in self._active_specs(FaultKind.GRAD_NAN, FaultKind.GRAD_FLIP):
            self._inject_gradient(spec, grads)

    def on_reduced_gradient(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Same pairs, over the rank's gradient after all-reduce, before ``optimizer.step``."""
        if self._replay:
            return
        for spec in self._active_specs(FaultKind.REDUCED_FLIP):
            self._inject_gradient(spec, grads)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Weight and optimizer-state faults, right after ``optimizer.step``. A sharded
        parameter (a DTensor: FSDP2, HSDP) is the shard this rank holds: the flip strikes the
        rank's own memory, as a weight flip strikes a DDP rank's copy."""
        if self._replay or self._step is None:
            return
        step = self._step
        for spec in self._active_specs(FaultKind.WEIGHT_FLIP, FaultKind.OPTIM_FLIP):
            targets = (
                [_held(p) for p in self._params]
                if spec.kind is FaultKind.WEIGHT_FLIP
                else [
                    t
                    for t in optimizer_state_tensors(optimizer, self._params)
                    if t.is_floating_point()
                ]
            )
            if not targets:
                raise FaultInjectionError(f"{spec}: no {spec.kind} target tensors on this rank")
            flat_map = _FlatMap([t.numel() for t in targets])
            position, offset = flat_map.locate(element_index(step, flat_map.total))
            flip_bit_(targets[position].data.reshape(-1), offset, spec.bit)
            self._record(spec, f"tensor {position} element {offset}")

    # -- internals ---------------------------------------------------------------------------------
    def _inject_gradient(self, spec: FaultSpec, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        assert self._step is not None
        position, offset = self._grad_map.locate(element_index(self._step, self._grad_map.total))
        for index, grad in grads:
            if index == position:
                flat = grad.reshape(-1)
                if spec.kind is FaultKind.GRAD_NAN:
                    _set_nan_(flat, offset)
                else:
                    self._note_flip(spec, flat, offset)
                    flip_bit_(flat, offset, spec.bit)
                self._record(spec, f"parameter {position} element {offset}")

    def _make_act_hook(self, target_name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            specs = [
                s for s in self._active_specs(FaultKind.ACT_FLIP) if (s.module or "") == target_name
            ]
            if not specs:
                return None
            return self._flip_output(output, specs)

        return hook

    def _flip_output(self, output: Any, specs: Sequence[FaultSpec]) -> Any:
        assert self._step is not None
        if isinstance(output, torch.Tensor):
            # A fresh tensor, so no autograd node that saved the original output sees a change.
            flipped = output.clone(memory_format=torch.contiguous_format)
            for spec in specs:
                index = element_index(self._step, flipped.numel())
                self._note_flip(spec, flipped, index)
                flip_bit_(flipped, index, spec.bit)
                self._record(spec, "output")
            return flipped
        if isinstance(output, tuple | list):
            items = list(output)
            for i, item in enumerate(items):
                if isinstance(item, torch.Tensor) and item.is_floating_point():
                    items[i] = self._flip_output(item, specs)
                    return type(output)(items)
        raise FaultInjectionError("act-flip target returned no floating-point tensor")

    def _resolve_module(self, module: nn.Module, name: str) -> nn.Module:
        if name:
            try:
                return module.get_submodule(name)
            except AttributeError as err:
                raise FaultInjectionError(f"act-flip: the model has no submodule {name!r}") from err
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise FaultInjectionError("act-flip: the model has no nn.Linear; name a /MODULE")
        return linears[-1]

    def _note_flip(self, spec: FaultSpec, flat: torch.Tensor, index: int) -> None:
        """Whether the bit was set before the flip (one host read, only when a fault strikes)."""
        assert self._step is not None
        width = flat.element_size() * 8
        word = {16: torch.int16, 32: torch.int32, 64: torch.int64}.get(width)
        local_bit = spec.bit + width - 32
        if word is None or not flat.is_floating_point() or not 0 <= local_bit < width:
            return
        cell = flat.detach().reshape(-1)[index : index + 1].view(word)
        was_set = bool((int(cell.item()) >> local_bit) & 1)
        self.flips.append((self._step, str(spec), was_set))

    def _record(self, spec: FaultSpec, where: str) -> None:
        assert self._step is not None
        self.injected.append((self._step, str(spec), self._replay))
        _log.info(
            "injected %s at %s",
            spec,
            where,
            extra={
                "rank": self.rank,
                "node": self.node,
                "step": self._step,
                "replay": self._replay,
            },
        )
