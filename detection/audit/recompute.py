"""What a replay must put back to reproduce the original forward and backward bitwise.

The original forward of a micro-batch ran under a context the training loop set up around it
and the guard never sees directly: an autocast region (written in the loop, not in
``loss_fn``), a GradScaler's scale, the RNG state, the module's buffers. The guard captures each
piece when the forward starts (a forward pre-hook on the module the loop calls) and the replay
runs under exactly that context:

* :class:`AutocastState` — per device type, whether autocast was on and with which dtype;
* :class:`BufferSnapshot` — the buffers, swapped in by reference for the replay;
* :func:`rng_preserved` — the caller's RNG state survives the replay's reseeding;
* :func:`local_gradients` — the replay's gradients come from ``torch.autograd.grad`` with the
  parameters as inputs, so no ``AccumulateGrad`` node runs: neither DDP's reducer hooks nor a
  user's post-accumulate-grad hook fire, ``.grad`` is never touched, and parameters DDP was
  told to ignore (or that no bucket holds) are not even differentiated.

Memory: a loss replay holds one micro-batch's activations (the original's are freed by then);
a gradient replay adds one gradient per bucketed parameter (two while a group of accumulated
micro-batches is summed), released before the replay returns.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.audit.calibration import NotReplayableError

__all__ = [
    "AutocastState",
    "BufferSnapshot",
    "all_finite",
    "local_gradients",
    "rng_preserved",
    "unwrap_ddp",
]

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """Autocast as the original forward saw it: ``(device type, enabled, dtype)`` per device
    type, and whether the cast cache was on. Captured with :meth:`capture`, reproduced with
    :meth:`applied`; the state of a loop with no autocast is :meth:`off`."""

    entries: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool = True

    @classmethod
    def capture(cls) -> AutocastState:
        """The state now. With autocast off everywhere and its cache on (a loop without
        autocast: every forward of such a job) the one shared "off" state, whose dtypes
        :meth:`applied` never reads; this runs once per forward, so it is the common case
        that must cost nothing."""
        if torch.is_autocast_cache_enabled() and not any(
            map(torch.is_autocast_enabled, _AUTOCAST_DEVICES)
        ):
            return _shared_off()
        entries = tuple(
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        )
        return cls(entries, torch.is_autocast_cache_enabled())

    @classmethod
    def off(cls) -> AutocastState:
        return cls(tuple((d, False, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES))

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.entries)

    def describe(self) -> str:
        on = [f"{d}:{str(t).removeprefix('torch.')}" for d, e, t in self.entries if e]
        return "autocast " + (", ".join(on) if on else "off")

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Enter exactly this state (turning autocast off where it was off, even if the caller
        is inside an autocast region of its own)."""
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.entries:
                if device == "cuda" and not torch.cuda.is_available():
                    continue
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.cache)
                )
            yield


@functools.cache
def _shared_off() -> AutocastState:
    return AutocastState.off()


@contextlib.contextmanager
def rng_preserved(device: torch.device) -> Iterator[None]:
    """Restore the CPU generator (and ``device``'s CUDA generator) on exit."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


class BufferSnapshot:
    """The module's buffers as they were when the original forward started.

    Taking it costs one copy of the buffers (BatchNorm statistics: tiny next to the weights);
    using it costs nothing: the copies are swapped in by reference and the live buffers swapped
    back, so the replay's own running-statistics update lands in the throw-away copy. A group
    of micro-batches replayed in a row sees the copies evolve exactly as the originals did.
    """

    def __init__(self, module: nn.Module) -> None:
        self._slots = [
            (owner, name)
            for owner in module.modules()
            for name, buf in owner._buffers.items()
            if buf is not None
        ]
        self._copies: list[torch.Tensor] | None = None

    @property
    def empty(self) -> bool:
        return not self._slots

    @property
    def taken(self) -> bool:
        return self._copies is not None or not self._slots

    def capture(self) -> None:
        with torch.no_grad():
            self._copies = [owner._buffers[name].clone() for owner, name in self._slots]  # type: ignore[union-attr]

    def clear(self) -> None:
        self._copies = None

    def duplicate(self) -> list[torch.Tensor] | None:
        """A second copy of the snapshot, for another replay (a replay updates its copies)."""
        if self._copies is None:
            return None
        with torch.no_grad():
            return [c.clone() for c in self._copies]

    def restore(self, copies: list[torch.Tensor] | None) -> None:
        self._copies = copies

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        if not self._slots:
            yield
            return
        if self._copies is None:
            raise RuntimeError("no buffer snapshot was taken for this step")
        live = [owner._buffers[name] for owner, name in self._slots]
        for (owner, name), copy in zip(self._slots, self._copies, strict=True):
            owner._buffers[name] = copy
        try:
            yield
        finally:
            for (owner, name), tensor in zip(self._slots, live, strict=True):
                owner._buffers[name] = tensor
            self._copies = None


def local_gradients(
    loss: torch.Tensor,
    params: Sequence[torch.Tensor],
    positions: Sequence[int],
    into: list[torch.Tensor | None],
) -> None:
    """Add d(loss)/d(params[i]) for ``i`` in ``positions`` to ``into[i]`` (``None``: start
    there), in the order ``AccumulateGrad`` would: ``into + new``. Parameters the loss does not
    reach contribute zeros, as DDP's ``find_unused_parameters`` does in the bucket."""
    inputs = [params[i] for i in positions]
    if not inputs:
        return
    try:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    except RuntimeError as err:
        if "use_reentrant" not in str(err):
            raise
        # the same model code on every rank: every rank's replay stops here alike
        raise NotReplayableError(
            "a gradient audit replays the backward with torch.autograd.grad, which activation "
            "checkpointing with use_reentrant=True does not support: pass use_reentrant=False "
            "to torch.utils.checkpoint (PyTorch's recommended setting), or audit in "
            "audit_mode='loss'"
        ) from err
    for i, g in zip(positions, grads, strict=True):
        if g is None:
            g = torch.zeros_like(params[i])
        previous = into[i]
        into[i] = g if previous is None else previous + g


def all_finite(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``1`` (int64, on device, no sync) when every tensor's float32 sum is finite — the same
    test the comm hook applies to a bucket, so an overflow reads the same in both places."""
    sums = [t.sum(dtype=torch.float32).to(torch.float64) for t in tensors if t is not None]
    if not sums:
        return torch.ones((), dtype=torch.int64, device=device)
    return torch.isfinite(torch.stack(sums).sum()).to(torch.int64)


def unwrap_ddp(
    model: nn.Module,
) -> tuple[DistributedDataParallel, nn.Module, nn.Module, bool] | None:
    """``(ddp, replay module, module to hook, compiled around DDP)`` for a DDP model, a DDP
    of a compiled module, or a compiled DDP model; ``None`` for anything else.

    The replay module is what the loop's forward runs through minus DDP's synchronisation,
    so a replay runs the same (compiled) kernels; the hooked module is the outermost one that
    runs eagerly after DDP's buffer broadcast where there is one."""
    compiled_outer = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    ddp = model._orig_mod if compiled_outer else model
    if not isinstance(ddp, DistributedDataParallel):
        return None
    if compiled_outer:
        # The loop's forward runs DDP inside the compiled region, where a hook on the inner
        # module would be traced, not called: hook the compiled wrapper, and replay through it
        # too — a fresh compile of the inner module fuses differently and is not bitwise.
        return ddp, _NoSyncReplay(model, ddp), model, True
    return ddp, ddp.module, ddp.module, False


class _NoSyncReplay(nn.Module):
    """Calls the compiled DDP model inside ``no_sync()``: the same compiled kernels as the
    loop's forward, with no reducer preparation (and no gradient hook: the replay's
    ``autograd.grad`` runs no ``AccumulateGrad``)."""

    def __init__(self, compiled: nn.Module, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.compiled = compiled
        self._ddp = [ddp]  # not a submodule: parameters come once, through ``compiled``

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._ddp[0].no_sync():
            return self.compiled(*args, **kwargs)
