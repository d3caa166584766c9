"""The loop protocol's refusals, shared by the DDP and the sharded guard: each says what to
change, and a loop that keeps the protocol passes every one of them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from detection.guard import GuardHaltedError, GuardUsageError
from detection.guard.protocol import refuse_backward, refuse_step, require_step


@dataclass
class _Open:
    step: int
    micro: int


def test_a_step_after_a_halt_or_inside_another_is_refused_and_a_fresh_one_is_not() -> None:
    refuse_step(7, halted=False, open_step=None)
    with pytest.raises(GuardHaltedError, match="step 7 refused"):
        refuse_step(7, halted=True, open_step=None)
    with pytest.raises(GuardUsageError, match="do not nest"):
        refuse_step(7, halted=False, open_step=_Open(6, 1))


def test_a_call_outside_a_step_names_the_call_and_the_block_to_use() -> None:
    open_step = _Open(3, 0)
    assert require_step(open_step, "guard.backward()") is open_step
    with pytest.raises(GuardUsageError, match=r"optimizer\.step\(\) outside a guard\.step"):
        require_step(None, "optimizer.step()")


def test_backward_takes_one_scalar_per_micro_batch_and_no_more() -> None:
    scalar = torch.tensor(1.5)
    refuse_backward(_Open(4, 1), scalar, micro_batches=2)
    with pytest.raises(GuardUsageError, match=r"called 3 times in step 4.*allows 2"):
        refuse_backward(_Open(4, 2), scalar, micro_batches=2)
    with pytest.raises(GuardUsageError, match="must be a scalar"):
        refuse_backward(_Open(4, 0), torch.ones(3), micro_batches=2)
