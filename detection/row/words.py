"""A CPU job's per-step row, built from host numbers instead of device tensors.

Why: on a GPU the row is assembled on the device — every flag, fingerprint and statistic stays a
tensor, since reading one back is a host synchronisation — and sent as one tensor. On a CPU
there is nothing to synchronise: reading a scalar is a memory load, while every op on a
one-element tensor is a dispatch of several microseconds. A small model's step there pays for
some thirty such ops (the flags' stack and test, the loss's casts, the row's concatenation),
which was most of the fixed cost a step adds (``benchmarks/RESULTS.md``). Here the same
values are read once and joined in Python; the row becomes a tensor once, for the collective.

Invariant — the row is the device path's, word for word: every value is read exactly (float32
and float64 scalars become Python floats without rounding, int64 words stay ints), the float
arithmetic is the same IEEE double arithmetic in the same order, and int64 arithmetic wraps as
the device's does (:func:`wrap64`). Which path a step takes is decided by :func:`on_host`: a
CPU tensor and :mod:`detection.native` available (``SDCGUARD_NATIVE=0`` keeps the device path,
the one a GPU runs, so a CPU host can test both). Ranks need not agree on it: the words agree.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence

import torch

from detection import native

__all__ = [
    "float_words",
    "loss_word",
    "nonfinite_flag",
    "nonfinite_sums",
    "on_host",
    "word_floats",
    "wrap64",
]

_INT64 = 1 << 64
_HALF = 1 << 63


def on_host(device: torch.device) -> bool:
    """Whether this step's row is built on the host (see the module)."""
    return device.type == "cpu" and native.available()


def wrap64(value: int) -> int:
    """``value`` wrapped into int64, as a device's int64 arithmetic wraps."""
    return (value + _HALF) % _INT64 - _HALF


def float_words(values: Sequence[float]) -> list[int]:
    """Float64 values as the int64 words of their bit patterns (``tensor.view(torch.int64)``)."""
    n = len(values)
    return list(struct.unpack(f"<{n}q", struct.pack(f"<{n}d", *values)))


def word_floats(words: Sequence[int]) -> list[float]:
    """Int64 words as the float64 values whose bit patterns they are (:func:`float_words`
    undone; ``tensor.view(torch.float64)`` on the host)."""
    n = len(words)
    return list(struct.unpack(f"<{n}d", struct.pack(f"<{n}q", *words)))


def loss_word(loss: torch.Tensor) -> int:
    """A scalar loss's exact float64 bit pattern as an int64
    (:func:`detection.audit.ring.encode_loss`
    on the host): any float dtype widens to float64 without rounding."""
    return float_words([float(loss)])[0]


def nonfinite_sums(sums: Iterable[torch.Tensor]) -> int:
    """``1`` when the float64 total of these bucket sums is NaN or ±Inf, else ``0`` — the
    device path's :func:`detection.row.words.nonfinite_flag` of the same total. Each sum is a
    float32-sized value (a bucket's), so the total overflows float64 never, and it is finite
    exactly when every sum is."""
    return int(not all(map(math.isfinite, map(float, sums))))


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """``1`` (int64, elementwise, on ``x``'s device) where ``x`` is NaN or ±Inf, else ``0``.

    ``x - x`` is exactly ``0`` for every finite float and NaN for NaN and ±Inf, and NaN is the
    one value unequal to itself: two elementwise ops and a cast, where ``isfinite`` (a
    composite of four) and its negation take six — the flags are taken on every step."""
    return torch.isnan(x - x).to(torch.int64)
