"""Many tensors' fingerprints at once (:mod:`detection.weights.fingerprint_each`): every row is
bitwise the tensor's own fingerprint — mixed element sizes, empty and 0-d tensors, views at
odd storage offsets, batches cut at ``BATCH_MAX``, a tensor past it — a flipped bit changes
only its tensor's row, and the rows of a long list cost a few operations, not a few a
tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.fingerprint_each import fingerprints_each
from detection.weights.fingerprint_kernels import Kernel, get_kernel, set_kernel

CPU = torch.device("cpu")


@pytest.fixture
def eager() -> Iterator[None]:
    """The torch path a GPU takes (no C kernel), restored after."""
    before = get_kernel()
    set_kernel(Kernel.EAGER)
    yield
    set_kernel(before)


def _one(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.numel():
        return torch.zeros(2, dtype=torch.int64)
    return fingerprint_on_device([flat], offsets=[0])


def _mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(40)
    return [
        torch.randn(7, 3),
        torch.tensor(5.0),  # a 0-d step count
        torch.randn(0),
        torch.randn(33).to(torch.bfloat16),
        base[3:20],  # a view at an odd storage offset
        torch.randn(5, dtype=torch.float64),
        torch.randint(-100, 100, (9,), dtype=torch.int8),
        torch.randn(4, 6).t(),  # not contiguous
        torch.randn(11).half(),
    ]


def test_every_row_is_the_tensors_own_fingerprint(eager: None) -> None:
    ts = _mixed()
    rows = fingerprints_each(ts, CPU)
    assert rows.shape == (len(ts), 2)
    assert rows.dtype == torch.int64
    for k, t in enumerate(ts):
        assert torch.equal(rows[k], _one(t)), k
    assert torch.equal(rows[2], torch.zeros(2, dtype=torch.int64))  # the empty tensor


def test_batches_cut_at_their_bound_and_a_tensor_past_it_give_the_same_rows(eager: None) -> None:
    ts = [torch.randn(n) for n in (30, 50, 20, 120, 10)]
    rows = fingerprints_each(ts, CPU, batch_max=64)
    for k, t in enumerate(ts):
        assert torch.equal(rows[k], _one(t)), k


def test_a_flipped_bit_changes_its_tensors_row_alone(eager: None) -> None:
    ts = [t.clone() for t in _mixed()]
    clean = fingerprints_each(ts, CPU)
    ts[4].view(torch.int32)[2] ^= 1 << 3
    flipped = fingerprints_each(ts, CPU)
    differ = [k for k in range(len(ts)) if not torch.equal(clean[k], flipped[k])]
    assert differ == [4]
    assert (clean[4] != flipped[4]).all()  # both words move for one flip


def test_under_the_native_kernel_the_rows_are_the_same(eager: None) -> None:
    ts = _mixed()
    want = fingerprints_each(ts, CPU)
    from detection import native

    assert native.available(), "the native kernel builds wherever the suite runs"
    set_kernel(Kernel.NATIVE)
    assert torch.equal(fingerprints_each([t.contiguous() for t in ts], CPU), want)


class _Ops(TorchDispatchMode):
    """Counts the operations that launch work (views and allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in {"empty", "detach"}:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_long_list_costs_a_few_operations_not_a_few_a_tensor(eager: None) -> None:
    ts = [torch.randn(16, 8) for _ in range(40)]
    fingerprints_each(ts, CPU)  # the multiplier table and the counts made once
    with _Ops() as ops:
        fingerprints_each(ts, CPU)
    assert ops.n <= 10, ops.n  # one tensor at a time: 5 each, 200
