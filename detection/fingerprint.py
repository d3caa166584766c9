"""Weight fingerprints: two exact 64-bit aggregates over the bit patterns of all parameters.

REFERENCE VERSION (correct, not yet fast); the optimised kernel replaces ``_aggregate``.

A = Σ w_i mod 2**64 and B = Σ (i + 1)·w_i mod 2**64, where w_i is the unsigned bit pattern of
element i and i its index across all tensors in order. Integer arithmetic makes the result
independent of reduction order; a single bit flip changes A; two flips that cancel in A
(d1 = -d2) change B by (i1 - i2)·d1, which is non-zero mod 2**64 while |i1 - i2| < 2**33.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

__all__ = ["Fingerprint", "fingerprint_from_tensor", "fingerprint_on_device", "weight_fingerprint"]

_MASK = (1 << 64) - 1
_WORD_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WORD_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF, 8: -1}


class Fingerprint(NamedTuple):
    a: int
    b: int

    def hex(self) -> str:
        return f"{self.a & _MASK:016x}{self.b & _MASK:016x}"

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        if len(text) != 32:
            raise ValueError(f"a fingerprint is 32 hex characters, got {len(text)}")
        return cls(int(text[:16], 16), int(text[16:], 16))


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    w = flat.view(_WORD_VIEW[size]).to(torch.int64)
    return w if size == 8 else w & _WORD_MASK[size]


def weight_fingerprint(tensors: Iterable[torch.Tensor]) -> Fingerprint:
    a = 0
    b = 0
    offset = 0
    for t in tensors:
        w = _words(t)
        n = w.numel()
        idx = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=w.device)
        a += int(w.sum())
        b += int((w * idx).sum())
        offset += n
    return Fingerprint(a & _MASK, b & _MASK)


def fingerprint_on_device(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The same two aggregates as a 2-element int64 tensor on the tensors' device, with no host
    synchronisation, ready to all-gather. ``Fingerprint.from_tensor`` turns it into a value."""
    acc: torch.Tensor | None = None
    offset = 0
    for t in tensors:
        w = _words(t)
        n = w.numel()
        idx = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=w.device)
        part = torch.stack([w.sum(), (w * idx).sum()])
        acc = part if acc is None else acc + part
        offset += n
    if acc is None:
        return torch.zeros(2, dtype=torch.int64)
    return acc


def fingerprint_from_tensor(value: torch.Tensor) -> Fingerprint:
    a, b = (int(v) for v in value.tolist())
    return Fingerprint(a & _MASK, b & _MASK)
