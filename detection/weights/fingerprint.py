"""Weight fingerprints: two exact 64-bit aggregates over the bit patterns of all tensors.

Definition (a contract: checkpoints, the ledger and the report carry these values)
------------------------------------------------------------------------------------
Let ``w_i`` be the unsigned bit pattern of element ``i``, where ``i`` is the element's *global*
position, counted from 0 across all tensors in order (each tensor in row-major order; a caller
may place a list at an offset, :func:`fingerprint_on_device` ``offsets``), and the word width
``k`` is the element size: 8-bit dtypes give 8-bit words, 16-bit dtypes 16-bit words, float32
32-bit words, 64-bit dtypes 64-bit words. With ``m_i = splitmix64(i) | 1``, a pseudo-random odd
64-bit multiplier of the position::

    A = Σ_i w_i        mod 2**64
    B = Σ_i m_i·w_i    mod 2**64

``splitmix64(x)``: ``z = x + 0x9E3779B97F4A7C15``; ``z = (z ^ z >> 30)·0xBF58476D1CE4E5B9``;
``z = (z ^ z >> 27)·0x94D049BB133111EB``; ``z ^ z >> 31`` (logical shifts, all mod 2**64).

Invariants and their proofs
---------------------------
*Order independence.* Both aggregates are sums in the ring Z/2**64, which is associative and
commutative, and each term depends only on a word and its global position, so any split into
chunks, threads, kernels, buckets or devices gives the same bits. Nothing is ever rounded: the
kernels only use integer arithmetic.

*Concatenation is addition.* The fingerprint of ``xs + ys`` is the word-wise sum of the
fingerprint of ``xs`` and that of ``ys`` placed at offset ``len(xs)``. So the fingerprints of
DDP's gradient buckets, each taken at its parameters' global offsets, add up to the
fingerprint of the whole gradient, and weights plus buffers are two parts of one fingerprint.

*Any single bit flip changes A and B.* Flipping bit ``b < k`` of one word changes ``A`` by
``d = ±2**b`` with ``0 < |d| < 2**64``, and ``B`` by ``m_i·d``, non-zero since ``m_i`` is odd
(a unit of Z/2**64).

*No linear blind spot.* An error pattern ``e_i`` (word changes) escapes both aggregates only if
``Σ e_i ≡ 0`` and ``Σ m_i·e_i ≡ 0``. With the old weights ``i + 1`` every pattern with zero sum
and zero first moment escaped by construction — ``+x, -2x, +x`` over three adjacent words, or
equal and opposite changes at the same offset of two buckets that restarted the index. The
multipliers are splitmix64 outputs, so they satisfy no linear relation with small coefficients:
write ``e_i = 2**b·u_i`` with ``b`` the lowest bit set in any ``e_i``; ``B`` is unchanged only if
``Σ m_i·u_i ≡ 0 (mod 2**(64 - b))``, where bit 0 of every ``m_i`` is 1 and its other bits are
pseudo-random, so a fixed pattern escapes with probability about ``2**-(63 - b)``:

======  =======================================  ========================================
k       lowest changed bit ``b`` at most         a pattern that keeps ``A`` escapes ``B``
======  =======================================  ========================================
8       7                                        with probability about 2**-56
16      15                                       about 2**-48
32      31                                       about 2**-32 (two opposite sign flips)
64      63                                       always, for an even number of sign flips
======  =======================================  ========================================

The price of pseudo-random weights is that the guarantee for *pairs* is now probabilistic
(``i + 1`` made every cancelling pair of float32 flips visible up to 2**33 elements, and every
structured pattern above invisible). For 64-bit words the sign bit stays a blind spot: two
sign-bit flips in opposite directions change ``B`` by ``2**63·(m_1 - m_2) ≡ 0``, since both
multipliers are odd. Single flips are always caught, whatever the size.

The kernels that compute it, and why each exists, are :mod:`detection.weights.fingerprint_kernels`;
the per-step list a guard keeps is :mod:`detection.weights.plan`.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from detection import native
from detection.weights.fingerprint_kernels import (
    eager_fingerprint,
    fused_fingerprint,
    global_offsets,
    prepare,
    use_fused,
    use_native,
)

__all__ = [
    "Fingerprint",
    "fingerprint_from_tensor",
    "fingerprint_on_device",
    "to_fingerprint",
    "weight_fingerprint",
]

_MASK64 = (1 << 64) - 1
_HEX = frozenset(string.hexdigits)


class Fingerprint(NamedTuple):
    a: int
    b: int

    def hex(self) -> str:
        return f"{self.a & _MASK64:016x}{self.b & _MASK64:016x}"

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        if len(text) != 32 or not _HEX.issuperset(text):
            raise ValueError(f"a fingerprint is 32 hex characters, got {text!r}")
        return cls(int(text[:16], 16), int(text[16:], 16))


def fingerprint_on_device(
    tensors: Iterable[torch.Tensor],
    *,
    offsets: Sequence[int] | None = None,
    start: int = 0,
) -> torch.Tensor:
    """The two aggregates as a 2-element int64 tensor on the tensors' device (two's-complement
    views of ``A`` and ``B``), with no host synchronisation, ready to all-gather.
    :func:`fingerprint_from_tensor` turns it into a :class:`Fingerprint`. No tensors: zeros.

    Positions are global: tensor ``k`` starts at ``offsets[k]`` when given (DDP buckets: each
    gradient at its parameter's place in the model), else where the previous one ended, the
    first at ``start`` (buffers after the parameters)."""
    ts = prepare(tensors)
    if not ts:
        return torch.zeros(2, dtype=torch.int64)
    where = global_offsets(ts, offsets, start)
    if use_native(ts):
        flat = [t.contiguous().reshape(-1) for t in ts]
        listed = native.PointerList(flat, [t.element_size() for t in flat], where)
        return native.fingerprint(listed)
    with torch.no_grad():
        if use_fused(ts):
            out = fused_fingerprint(ts, where)
            if out is not None:
                return out
        return eager_fingerprint(ts, where)


def weight_fingerprint(tensors: Iterable[torch.Tensor]) -> Fingerprint:
    """The fingerprint of ``tensors`` as host integers (one synchronisation)."""
    return fingerprint_from_tensor(fingerprint_on_device(tensors))


def fingerprint_from_tensor(t: torch.Tensor) -> Fingerprint:
    """Read a :func:`fingerprint_on_device` result (or an all-gathered row of one) back."""
    if t.numel() != 2 or t.dtype != torch.int64:
        raise ValueError(f"expected 2 int64 values, got {t.dtype} of shape {tuple(t.shape)}")
    a, b = (int(v) & _MASK64 for v in t.reshape(-1).tolist())
    return Fingerprint(a, b)


def to_fingerprint(a: int, b: int) -> Fingerprint:
    """A fingerprint from two (possibly negative) int64 words read back from a device tensor."""
    return Fingerprint(a & _MASK64, b & _MASK64)
