"""The autocast state a replay reproduces (``detection.audit.recompute.AutocastState``): captured
once
per forward, so its common case — no autocast anywhere — is a shared state, which must still be
told apart from every state a loop can set up."""

from __future__ import annotations

import torch

from detection.audit.recompute import AutocastState


def _matmul_dtype() -> torch.dtype:
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


def test_a_forward_without_autocast_is_captured_off_and_replays_off_inside_a_callers_region() -> (
    None
):
    state = AutocastState.capture()
    assert not state.enabled
    assert state.cache
    assert state.describe() == "autocast off"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _matmul_dtype() == torch.bfloat16
        with state.applied():
            assert not torch.is_autocast_enabled("cpu")
            assert _matmul_dtype() == torch.float32


def test_a_forward_under_autocast_is_captured_with_its_dtype_and_replays_under_it() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = AutocastState.capture()
    assert state.enabled
    assert ("cpu", True, torch.bfloat16) in state.entries
    assert state.describe() == "autocast cpu:bfloat16"
    assert _matmul_dtype() == torch.float32
    with state.applied():
        assert _matmul_dtype() == torch.bfloat16


def test_the_cast_cache_switched_off_is_not_taken_for_the_plain_state() -> None:
    with torch.autocast("cpu", enabled=False, cache_enabled=False):
        state = AutocastState.capture()
    assert not state.enabled
    assert not state.cache
    assert state != AutocastState.capture()


def test_autocast_switched_off_inside_an_enabled_region_is_captured_off() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
        state = AutocastState.capture()
    assert not state.enabled
    with torch.autocast("cpu", dtype=torch.bfloat16), state.applied():
        assert _matmul_dtype() == torch.float32
