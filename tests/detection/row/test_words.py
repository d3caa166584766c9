"""A CPU job's row read on the host (:mod:`detection.row.words`) is the device path's, word for
word.

What must hold: every scalar read exactly (float dtypes, NaN, ±Inf, -0.0), int64 arithmetic
wrapping as a device's does, the non-finite flags the same for every mix of bucket sums, and a
model's buffer words the same through a sequence of steps (the differences carried from step to
step). The whole guard deciding alike on both paths is in ``test_guard_nothing_hidden``.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from detection import native
from detection.audit.ring import encode_loss
from detection.row.words import (
    float_words,
    loss_word,
    nonfinite_flag,
    nonfinite_sums,
    on_host,
    word_floats,
    wrap64,
)
from detection.weights.buffers import BufferWatch
from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.plan import FingerprintPlan

SPECIAL = [0.0, -0.0, 1.0, -2.5, 1e-45, 3.4e38, math.inf, -math.inf, math.nan, 0.1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_loss_word_is_the_device_encoding_for_every_float(dtype: torch.dtype) -> None:
    for value in SPECIAL:
        loss = torch.tensor(value, dtype=torch.float32).to(dtype)
        assert loss_word(loss) == int(encode_loss(loss)[0]), (dtype, value)


def test_float_words_are_the_bit_patterns_a_tensor_view_gives() -> None:
    values = [*SPECIAL, -1e300, 5e-324]
    assert (
        float_words(values) == torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()
    )


def test_word_floats_read_the_words_as_a_tensor_view_does_and_undo_float_words() -> None:
    """A row's float64 words (the per-step layer's) are read back on the host as a tensor view
    reads them, and every bit pattern survives the trip, NaN payloads included."""
    rng = random.Random(5)
    words = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(200)]
    words += [0x7FF0000000000001, -0x0008000000000001, 0x7FF8000000000000, -1, 0]
    viewed = torch.tensor(words, dtype=torch.int64).view(torch.float64).tolist()
    floats = word_floats(words)
    assert float_words(floats) == words
    assert float_words(viewed) == words
    assert [math.isnan(f) for f in floats] == [math.isnan(f) for f in viewed]
    assert [f for f in floats if not math.isnan(f)] == [f for f in viewed if not math.isnan(f)]


def test_wrap64_wraps_as_int64_arithmetic_does() -> None:
    pairs = [(2**63 - 1, -1), (-(2**63), 1), (0, 2**63 - 1), (-5, 7), (2**62, -(2**62) - 1)]
    for a, b in pairs:
        device = (torch.tensor([a], dtype=torch.int64) - torch.tensor([b], dtype=torch.int64))[0]
        assert wrap64(a - b) == int(device), (a, b)


@pytest.mark.parametrize(
    "sums",
    [
        [1.0, 2.0],
        [3.4e38, 3.4e38, 3.4e38],  # a float32 overflow of the total, none in float64
        [math.inf, -math.inf],  # a total of NaN
        [math.nan],
        [-math.inf, 1.0],
        [],
    ],
)
def test_the_nonfinite_flag_read_on_the_host_is_the_device_flag(sums: list[float]) -> None:
    tensors = [torch.tensor(v, dtype=torch.float32) for v in sums]
    total = torch.stack([t.double() for t in tensors]).sum() if tensors else torch.zeros(())
    assert nonfinite_sums(tensors) == int(nonfinite_flag(total))


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


@pytest.mark.parametrize("broadcast", [True, False])
def test_the_buffer_words_are_the_device_row_through_a_run(broadcast: bool) -> None:
    """Two watches over the same model's steps, one keeping host words and one device tensors
    (its calls made with the kernels off, as on a GPU): forwards that change the running
    statistics, a change after a forward, a flip between two steps (the words carried from one
    step's end to the next's start), and a step outside the guard that resets what is
    carried."""
    torch.manual_seed(0)
    model = _WithBuffers()
    host = BufferWatch(model, start=40, broadcast=broadcast, rank=0, device=torch.device("cpu"))
    device = BufferWatch(model, start=40, broadcast=broadcast, rank=0, device=torch.device("cpu"))
    for step in range(6):
        in_step = step != 3
        host.begin_step()
        host.forward_started(in_step)
        with _kernels_off():
            device.begin_step()
            device.forward_started(in_step)
        model(torch.randn(8, 4))
        host.forward_finished(in_step)
        with _kernels_off():
            device.forward_finished(in_step)
        assert model.norm.running_mean is not None
        if step == 4:
            model.norm.running_mean[0] -= 1.0  # after the forward: "after" is non-zero
        if in_step:
            words = host.row_on_host()
            with _kernels_off():
                assert words == device.row().tolist(), step
            assert (words[4:6] != [0, 0]) == (step == 4)
            assert (words[6:8] != [0, 0]) == (step == 2)  # the flip between steps 1 and 2
        if step == 1:
            assert model.norm.running_var is not None
            model.norm.running_var[1] += 1.0  # between two steps: "between" is non-zero next


@contextlib.contextmanager
def _kernels_off() -> Iterator[None]:
    was = native.is_enabled()
    native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(was)


def test_a_plans_host_words_are_its_tensors() -> None:
    """:meth:`FingerprintPlan.words` on the C kernel (no tensor made) and on torch's ops is the
    plan's fingerprint, for tensors of every element size."""
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(33, generator=gen),
        torch.randn(7, 5, generator=gen).to(torch.float64),
        torch.randn(19, generator=gen).to(torch.bfloat16),
        torch.randint(0, 255, (11,), generator=gen, dtype=torch.uint8),
        torch.tensor(12345, dtype=torch.int64),
    ]
    expected = fingerprint_on_device(tensors, start=1000).tolist()
    assert FingerprintPlan(tensors, start=1000).words() == expected
    with _kernels_off():
        assert FingerprintPlan(tensors, start=1000).words() == expected


def test_the_host_path_is_taken_on_a_cpu_with_the_kernels_alone() -> None:
    was = native.is_enabled()
    try:
        native.set_enabled(True)
        assert on_host(torch.device("cpu")) == native.available()
        assert not on_host(torch.device("meta"))
        native.set_enabled(False)
        assert not on_host(torch.device("cpu"))
    finally:
        native.set_enabled(was)
