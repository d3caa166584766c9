"""Weight fingerprints: two exact 64-bit aggregates over the bit patterns of all parameters.

Definition (a contract: checkpoints, the ledger and the report carry these values)
------------------------------------------------------------------------------------
Let ``w_i`` be the unsigned bit pattern of element ``i``, where ``i`` counts elements across all
tensors in order (each tensor in row-major order) and the word width ``k`` is the element size:
8-bit dtypes give 8-bit words, 16-bit dtypes (float16, bfloat16) 16-bit words, float32 32-bit
words, 64-bit dtypes 64-bit words. Then::

    A = Σ_i w_i          mod 2**64
    B = Σ_i (i + 1)·w_i  mod 2**64

Invariants and their proofs
---------------------------
*Order independence.* Both aggregates are sums in the ring Z/2**64, which is associative and
commutative, so any split into chunks, threads, kernels or devices gives the same bits. Nothing
is ever rounded: the fast kernels below only use integer arithmetic.

*Any single bit flip changes A.* Flipping bit ``b < k`` of one word changes ``A`` by
``d = ±2**b``, and ``0 < |d| ≤ 2**63 < 2**64``.

*Two flips cannot cancel in both aggregates (within a size bound).* Flips in the same word
change it by ``±2**b1 ± 2**b2`` with ``b1 ≠ b2``: non-zero, magnitude below ``2**64``, so ``A``
changes. Flips in words ``i1 ≠ i2`` change ``A`` by ``d1 + d2`` with ``|dj| = 2**bj``; that sum
is ``≡ 0 (mod 2**64)`` only when ``d2 ≡ -d1`` (for ``k < 64`` that means the same bit flipped in
opposite directions; for ``k = 64`` also both words' bit 63 flipped). Then ``B`` changes by::

    (i1 + 1)·d1 + (i2 + 1)·d2 ≡ (i1 - i2)·d1 = ±(i1 - i2)·2**b   (mod 2**64)

which is non-zero unless ``2**(64 - b)`` divides ``i1 - i2``. So a cancelling pair at bit ``b``
is always caught while ``|i1 - i2| < 2**(64 - b)``. With ``b ≤ k - 1`` the guarantee for a
whole model of ``n`` elements (``|i1 - i2| ≤ n - 1``) is:

======  ==============================  ======================================
k       every pair caught when          equivalently
======  ==============================  ======================================
8       n ≤ 2**57                       any realistic model
16      n ≤ 2**49  (5.6·10**14)         any realistic model
32      n ≤ 2**33  (8.6·10**9)          float32 models up to 8.5 billion values
64      n ≤ 2                           see below
======  ==============================  ======================================

For 64-bit words the bound is per bit: a pair at bit ``b`` is caught while
``|i1 - i2| < 2**(64 - b)``; two sign-bit flips of float64 values an even distance apart cancel
in both aggregates. Single flips are always caught, whatever the size.

Kernels
-------
Each tensor is reduced on its own to ``S = Σ_j w_j`` and ``T = Σ_j (j + 1)·w_j`` over its
local index ``j``; with ``o`` the number of elements before it, its share of the fingerprint is
``A += S`` and ``B += o·S + T``. This makes tensors independent, so they can be reduced by
different kernels, and keeps every per-element index small.

* ``eager`` runs anywhere torch runs: chunks of ``_CHUNK`` words are widened to int64, masked
  to their unsigned value and reduced with torch ops. Memory overhead is bounded by a few int64
  chunks (never a full-size int64 copy). It reads the data several times, so it is several
  times slower than ``torch.sum``.
* ``fused`` traces the same arithmetic for one list layout with ``torch.compile`` (C++/OpenMP
  on CPU, Triton on CUDA) into one pass per tensor with no temporaries. Words narrower than
  64 bits are read as packed int64 lanes (two float32 words per lane) and split with shifts
  and masks, which halves the per-word work. Its first call for a layout compiles for
  seconds. Afterwards, on parameters larger than the caches it runs at memory bandwidth
  (about 1.1x ``torch.sum``); on cache-resident ones it is compute-bound at about 1.5x,
  doing roughly nine vector operations per sixteen float32 words where ``torch.sum`` does
  one (``benchmarks/fingerprint.py`` measures both). At most ``_MAX_FUSED_LAYOUTS``
  layouts are compiled per process (more would hit the compiler's recompile limit); other
  layouts, and element types outside ``_FUSED_DTYPES`` (complex, float8), use ``eager``.
* ``auto`` (the default) uses ``fused`` for lists of at least ``_FUSED_MIN_ELEMENTS``
  elements, where compiling pays off, and ``eager`` otherwise. If compiling a layout fails
  (no C++ compiler in the image, say) it logs a warning and runs that layout on ``eager``;
  under ``fused`` the failure raises :class:`FusedKernelUnavailable`.

Neither kernel reads a value back to the host: ``fingerprint_on_device`` returns a device
tensor, so the vote can all-gather it without a synchronisation. All device-side sums wrap
two's-complement at 64 bits, which is what torch's int64 arithmetic does on every backend;
the tests hold both kernels to a Python-integer reference on inputs where the sums overflow
(on CPU; the CUDA path is written device-agnostic but has not run on a GPU here).
"""

from __future__ import annotations

import logging
import string
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any, NamedTuple

import torch

__all__ = [
    "Fingerprint",
    "FingerprintError",
    "FusedKernelUnavailable",
    "Kernel",
    "fingerprint_from_tensor",
    "fingerprint_on_device",
    "get_kernel",
    "set_kernel",
    "weight_fingerprint",
]

_log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_HEX = frozenset(string.hexdigits)
# Signed integer views of each element size; the unsigned word is the view masked to its width.
_WORD_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WORD_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
# Words per eager step: two int64 temporaries of this length (4 MiB) bound the overhead.
_CHUNK = 1 << 18
# ``auto`` compiles only for lists at least this large: below it the compile never pays off.
_FUSED_MIN_ELEMENTS = 1 << 22
# torch.compile keeps at most 8 graphs per function before it silently runs it uncompiled.
_MAX_FUSED_LAYOUTS = 4
# Element types the fused kernel is traced for; others (complex, float8) take the eager kernel.
_FUSED_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


class FingerprintError(Exception):
    """The tensors cannot be fingerprinted (unsupported element size, mixed devices)."""


class FusedKernelUnavailable(FingerprintError):
    """The ``fused`` kernel was required but ``torch.compile`` failed for this layout."""


class Kernel(StrEnum):
    """Which implementation reduces the words; every kernel gives the same bits."""

    AUTO = "auto"
    EAGER = "eager"
    FUSED = "fused"


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


_FusedFn = Callable[[list[torch.Tensor], tuple[tuple[int, int], ...]], torch.Tensor]


# -- kernel selection ------------------------------------------------------------------------------
class _FusedState:
    """Process-wide choice of kernel and the layouts compiled so far (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernel = Kernel.AUTO
        self.layouts: set[tuple[object, ...]] = set()
        self.failed: set[tuple[object, ...]] = set()  # layouts whose compile failed
        self.refused: set[tuple[object, ...]] = set()  # layouts past the cap, logged once
        self._compiled: dict[tuple[str, int], _FusedFn] = {}

    def compiled(self, device_type: str) -> _FusedFn:
        """The ``torch.compile`` wrapper for one device type, made on first use so importing
        stays cheap. On CPU a C++ wrapper launches the per-tensor kernels without a Python call
        each (about 60 µs instead of 160 µs of fixed cost for a 22-tensor model); CPU kernels
        need a C++ compiler anyway. Elsewhere the default Python wrapper keeps Triton as the
        only requirement. CPU kernels are specialised for the intra-op thread count, which the
        compiler's guards do not check, so each count gets its own wrapper (and graphs)."""
        threads = torch.get_num_threads() if device_type == "cpu" else 0
        fn = self._compiled.get((device_type, threads))
        if fn is None:
            options: dict[str, str | int | bool | Callable[..., Any]] = (
                {"cpp_wrapper": True} if device_type == "cpu" else {}
            )
            fn = torch.compile(_fused_list, fullgraph=True, dynamic=False, options=options)
            self._compiled[(device_type, threads)] = fn
        return fn


def set_kernel(kernel: Kernel | str) -> None:
    """Choose the kernel for this process (default ``auto``); the fingerprint does not change."""
    with _STATE.lock:
        _STATE.kernel = Kernel(kernel)


def get_kernel() -> Kernel:
    return _STATE.kernel


# -- per-tensor reductions -----------------------------------------------------------------------
def _flat_words(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order as a 1-D signed integer view of the same width."""
    size = t.element_size()
    if size not in _WORD_VIEW:
        raise FingerprintError(f"cannot fingerprint {t.dtype}: {size}-byte elements")
    return t.detach().reshape(-1).view(_WORD_VIEW[size])


def _plain(words: torch.Tensor, first: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ w, Σ (first + j)·w)`` of a short-enough 1-D word view, widened to int64."""
    w = words.to(torch.int64)
    if bits < 64:
        w = w & _WORD_MASK[bits // 8]
    idx = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device)
    return w.sum(), (w * idx).sum()


def _eager_local(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, T)`` of one tensor in chunks of ``_CHUNK`` words: bounded memory on any device.
    Each chunk allocates two int64 temporaries (the widened words and their positions)."""
    words = _flat_words(t)
    size = words.element_size()
    s = torch.zeros((), dtype=torch.int64, device=words.device)
    tt = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        w = chunk.to(torch.int64, copy=True)  # always a copy: it is modified in place below
        if size < 8:
            w.bitwise_and_(_WORD_MASK[size])
        s += w.sum()
        idx = torch.arange(
            start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=words.device
        )
        tt += w.mul_(idx).sum()
    return s, tt


def _packed_local(t: torch.Tensor, head: int, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, T)`` of one tensor, traced by ``torch.compile``.

    With ``r = 8 / element size`` words per int64 lane, the words are ``head`` loose words
    (up to the first 8-byte boundary), ``lanes`` packed lanes, and a loose tail. Lane ``m``
    holds local words ``j = head + r·m + q`` for ``q < r`` (little-endian), so with
    ``s_m = Σ_q w_mq`` and ``u_m = Σ_q q·w_mq``::

        Σ (j + 1)·w over the lanes = (head + 1)·Σ s_m + r·Σ m·s_m + Σ u_m
    """
    words = _flat_words(t)
    size = words.element_size()
    bits = 8 * size
    n = words.numel()
    r = 8 // size
    if r == 1:
        return _plain(words, 1, bits)
    s = torch.zeros((), dtype=torch.int64, device=words.device)
    tt = torch.zeros((), dtype=torch.int64, device=words.device)
    if head:
        hs, ht = _plain(words[:head], 1, bits)
        s, tt = s + hs, tt + ht
    if lanes:
        v = words[head : head + r * lanes].view(torch.int64)
        mask = _WORD_MASK[size]
        second = (v >> bits) & mask
        lane_sum = (v & mask) + second
        lane_weighted = second  # Σ_q q·w_q; q = 0 adds nothing, q = 1 needs no multiply
        for q in range(2, r):
            wq = (v >> (q * bits)) & mask
            lane_sum = lane_sum + wq
            lane_weighted = lane_weighted + q * wq
        # r·m·s_m + u_m in one accumulator: one reduction fewer than summing them apart.
        rm = torch.arange(0, r * lanes, r, dtype=torch.int64, device=words.device)
        ls = lane_sum.sum()
        s = s + ls
        tt = tt + (head + 1) * ls + (lane_sum * rm + lane_weighted).sum()
    done = head + r * lanes
    if done < n:
        ts_, tt_ = _plain(words[done:], done + 1, bits)
        s, tt = s + ts_, tt + tt_
    return s, tt


def _fused_list(tensors: list[torch.Tensor], plan: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The whole fingerprint of one layout; ``plan`` holds each tensor's ``(head, lanes)``."""
    device = tensors[0].device
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for t, (head, lanes) in zip(tensors, plan, strict=True):
        n = t.numel()
        if n:
            s, tt = _packed_local(t, head, lanes)
            a = a + s
            b = b + offset * s + tt
        offset += n
    return torch.stack([a, b])


def _plan(t: torch.Tensor) -> tuple[int, int]:
    """``(head, lanes)`` for :func:`_packed_local`: loose words up to an 8-byte boundary of the
    storage, then whole int64 lanes. A non-contiguous tensor is copied by ``reshape`` first,
    so its words start at offset 0."""
    size = t.element_size()
    r = 8 // size if size in _WORD_VIEW else 1
    n = t.numel()
    offset = t.storage_offset() if t.is_contiguous() else 0
    head = min((-offset) % r, n)
    return head, (n - head) // r


# -- public API ------------------------------------------------------------------------------------
def _prepare(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    ts = [t.detach() for t in tensors]
    devices = {t.device for t in ts}
    if len(devices) > 1:
        raise FingerprintError(f"tensors on several devices: {sorted(map(str, devices))}")
    for t in ts:
        if t.element_size() not in _WORD_VIEW:
            raise FingerprintError(
                f"cannot fingerprint {t.dtype}: {t.element_size()}-byte elements"
            )
    return ts


def _layout(ts: Sequence[torch.Tensor]) -> tuple[object, ...]:
    """What a compiled graph is specialised for: every tensor's metadata and the thread count."""
    threads = torch.get_num_threads() if ts[0].device.type == "cpu" else 0
    return (threads, *((t.dtype, t.shape, t.stride(), t.storage_offset(), t.device) for t in ts))


def _use_fused(ts: Sequence[torch.Tensor]) -> bool:
    kernel = _STATE.kernel
    if kernel is Kernel.EAGER or any(t.dtype not in _FUSED_DTYPES for t in ts):
        return False
    if kernel is Kernel.AUTO and sum(t.numel() for t in ts) < _FUSED_MIN_ELEMENTS:
        return False
    layout = _layout(ts)
    with _STATE.lock:
        if layout in _STATE.layouts:
            return True
        if layout in _STATE.failed:
            if kernel is Kernel.FUSED:
                raise FusedKernelUnavailable("torch.compile failed for this layout before")
            return False
        if len(_STATE.layouts) + len(_STATE.failed) >= _MAX_FUSED_LAYOUTS:
            if layout not in _STATE.refused:
                _STATE.refused.add(layout)
                _log.info(
                    "fingerprint: %d layouts already compiled; this one runs the eager kernel",
                    _MAX_FUSED_LAYOUTS,
                    extra={"tensors": len(ts)},
                )
            return False
        _STATE.layouts.add(layout)
        return True


def _fused(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The fused result, or ``None`` when compiling this layout failed under ``auto``."""
    plan = tuple(_plan(t) for t in ts)
    try:
        with warnings.catch_warnings():
            # Inductor notes that it reads float16 and bfloat16 storage in one kernel; the words
            # are integer views, so the note is noise in a training log.
            warnings.filterwarnings("ignore", "bf16 and fp16 are mixed", UserWarning)
            return _STATE.compiled(ts[0].device.type)(ts, plan)
    except Exception as err:
        layout = _layout(ts)
        with _STATE.lock:
            _STATE.layouts.discard(layout)
            _STATE.failed.add(layout)
        if _STATE.kernel is Kernel.FUSED:
            raise FusedKernelUnavailable(f"torch.compile failed: {err}") from err
        _log.warning(
            "fingerprint: torch.compile failed for this layout; it runs the eager kernel",
            exc_info=err,
            extra={"tensors": len(ts)},
        )
        return None


def _eager(ts: list[torch.Tensor]) -> torch.Tensor:
    device = ts[0].device
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for t in ts:
        n = t.numel()
        if n:
            s, tt = _eager_local(t)
            a = a + s
            b = b + offset * s + tt
        offset += n
    return torch.stack([a, b])


def fingerprint_on_device(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The two aggregates as a 2-element int64 tensor on the tensors' device (two's-complement
    views of ``A`` and ``B``), with no host synchronisation, ready to all-gather.
    :func:`fingerprint_from_tensor` turns it into a :class:`Fingerprint`. No tensors: zeros."""
    ts = _prepare(tensors)
    if not ts:
        return torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        if _use_fused(ts):
            out = _fused(ts)
            if out is not None:
                return out
        return _eager(ts)


def weight_fingerprint(tensors: Iterable[torch.Tensor]) -> Fingerprint:
    """The fingerprint of ``tensors`` as host integers (one synchronisation)."""
    return fingerprint_from_tensor(fingerprint_on_device(tensors))


def fingerprint_from_tensor(t: torch.Tensor) -> Fingerprint:
    """Read a :func:`fingerprint_on_device` result (or an all-gathered row of one) back."""
    if t.numel() != 2 or t.dtype != torch.int64:
        raise ValueError(f"expected 2 int64 values, got {t.dtype} of shape {tuple(t.shape)}")
    a, b = (int(v) & _MASK64 for v in t.reshape(-1).tolist())
    return Fingerprint(a, b)


_STATE = _FusedState()
