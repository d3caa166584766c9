"""The training-loop protocol both guards enforce, in one place.

A guarded loop is ``with guard.step(step):`` → ``guard.backward(loss)`` once per micro-batch →
``optimizer.step()`` once per optimizer. DDP's :class:`~detection.guard.SDCGuard` and the
sharded :class:`~detection.guard.sharded.ShardedGuard` accept the same loop, so they refuse the
same mistakes with the same words: a user moving a loop from DDP to FSDP2 meets one protocol.
Every refusal is a :class:`GuardUsageError` (or :class:`GuardHaltedError`) that says what to
change; none of them touches the step's state.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from detection.guard.config import GuardHaltedError, GuardUsageError

__all__ = ["refuse_backward", "refuse_step", "require_step"]


class _OpenStep(Protocol):
    step: int
    micro: int


_S = TypeVar("_S")


def refuse_step(step: int, *, halted: bool, open_step: object | None) -> None:
    """Entering ``guard.step(step)``: refused after a halt and inside another step's block."""
    if halted:
        raise GuardHaltedError(f"the guard halted the job after an alarm; step {step} refused")
    if open_step is not None:
        raise GuardUsageError(
            "guard.step() blocks do not nest: leave one step's block before the next begins"
        )


def require_step(current: _S | None, what: str) -> _S:
    """The open step, for ``what`` (a call the loop made); refused outside a step's block."""
    if current is None:
        raise GuardUsageError(
            f"{what} outside a guard.step() block: run the training step inside "
            "`with guard.step(step):`"
        )
    return current


def refuse_backward(current: _OpenStep, loss: torch.Tensor, micro_batches: int) -> None:
    """``guard.backward(loss)``: at most ``micro_batches`` calls a step, each with a scalar."""
    if current.micro >= micro_batches:
        raise GuardUsageError(
            f"guard.backward() called {current.micro + 1} times in step {current.step}, but "
            f"GuardConfig(micro_batches={micro_batches}) allows {micro_batches}: "
            "set micro_batches to the number of micro-batches per step"
        )
    if loss.numel() != 1:
        raise GuardUsageError(
            "the loss must be a scalar: reduce it (e.g. .mean()) before guard.backward()"
        )
