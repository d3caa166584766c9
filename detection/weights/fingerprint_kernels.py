"""How the fingerprint of :mod:`detection.weights.fingerprint` is computed: the kernels.

The definition and its proofs are :mod:`detection.weights.fingerprint`'s; every kernel here gives
its bits. :mod:`detection.weights.plan` builds on these names for the per-step list.

Kernels
-------
Each tensor is reduced on its own to ``S = Σ_j w_j`` and ``T = Σ_j m_(o + j)·w_j`` over its
local index ``j`` and global offset ``o``; its share of the fingerprint is ``A += S``,
``B += T``. Multipliers are computed on the device from the position (never stored per
element), except by ``eager`` on small lists, which reads them from a cached table.

* ``eager`` runs anywhere torch runs. Lists of at most ``TABLE_MAX`` positions gather all
  words of one element size with one ``torch.cat`` and reduce them against a slice of a cached
  multiplier table (a handful of ops for the whole list: the fixed per-step cost of a small
  model). Larger lists go tensor by tensor in chunks of ``CHUNK`` words widened to int64,
  their multipliers computed on the fly; memory overhead is bounded by a few int64 chunks.
* ``fused`` traces the same arithmetic for one list layout with ``torch.compile`` (C++/OpenMP
  on CPU, Triton on CUDA) into one pass per tensor with no temporaries. Words narrower than
  64 bits are read as packed int64 lanes and split with shifts and masks. Its first call for a
  layout compiles for seconds; afterwards the per-word splitmix64 (two multiplications and
  three shift-xors) makes it compute-bound where ``torch.sum`` is bandwidth-bound
  (``benchmarks/fingerprint.py`` measures the ratio). At most ``MAX_FUSED_LAYOUTS`` layouts
  are compiled per process (more would hit the compiler's recompile limit); other layouts, and
  element types outside ``FUSED_DTYPES`` (complex, float8), use ``eager``.
* ``native`` (CPU only): :mod:`detection.native`'s C function, one call for a whole list of
  any word sizes, the arithmetic above in eight 64-bit lanes; no compilation per layout, one
  thread. Under ``native`` an unbuildable library raises :class:`FingerprintError`.
* ``auto`` (the default) uses ``native`` for contiguous CPU lists where the library builds
  (except a list ``fused`` would take while torch runs several intra-op threads, which the
  compiled kernel's threads run faster); otherwise ``fused`` for lists of at least
  ``FUSED_MIN_ELEMENTS`` elements, where compiling pays off, and ``eager`` below. If compiling
  a layout fails (no C++ compiler in the image, say) it logs a warning and runs that layout on
  ``eager``; under ``fused`` the failure raises :class:`FusedKernelUnavailable`.

On a CPU whose vector unit has no 64-bit multiply (AVX2, NEON: see
:func:`cpu_compile_options`) the compiled kernels are scalar code, which runs them about twice
as fast as Inductor's emulated vector lanes. The per-step :class:`FingerprintPlan` (a guard's
weights, buffers) goes further on such a CPU: for a list ``fused`` would take it compiles one
pass per tensor that reads each word's multiplier from a table it holds (one multiplication a
word instead of three, 8 bytes an element; :mod:`detection.weights.plan`). Where the vector
unit multiplies 64-bit lanes natively, the plan keeps the vectorised fused kernel, which is
faster there.

Neither kernel reads a value back to the host: ``fingerprint_on_device`` returns a device
tensor, so the vote can all-gather it without a synchronisation. All device-side sums and
products wrap two's-complement at 64 bits, which is what torch's int64 arithmetic does on every
backend; the tests hold both kernels to a Python-integer reference on inputs where the sums
overflow (on CPU). On CUDA, ``benchmarks/fingerprint.py --device cuda`` checks every kernel
against the CPU's eager result for the same words (bit-identical on an H200 at 2.7M-100M).
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any

import torch

from detection import native

__all__ = [
    "CHUNK",
    "FUSED_DTYPES",
    "FUSED_MIN_ELEMENTS",
    "FUSED_STATE",
    "INT64_VECTOR_CAPABILITIES",
    "MAX_FUSED_LAYOUTS",
    "MULTIPLIER_TABLE",
    "PLAN_EAGER_MAX",
    "TABLE_MAX",
    "WORD_MASK",
    "FingerprintError",
    "FusedKernelUnavailable",
    "Kernel",
    "compile_failed",
    "cpu_compile_options",
    "dot",
    "eager_fingerprint",
    "flat_words",
    "fused_fingerprint",
    "get_kernel",
    "global_offsets",
    "layout_of",
    "multipliers",
    "prepare",
    "set_kernel",
    "use_fused",
    "use_native",
]

_log = logging.getLogger(__name__)

# Signed integer views of each element size; the unsigned word is the view masked to its width.
_WORD_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
WORD_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
# Positions the eager kernel keeps a multiplier table for (8 bytes each, per device).
TABLE_MAX = 1 << 22  # > FUSED_MIN_ELEMENTS: under auto, eager lists never take the chunked path
# Words per eager step: two int64 temporaries of this length (4 MiB) bound the overhead.
CHUNK = 1 << 18
_GPU_CHUNK = 1 << 22  # 32 MiB int64 temporaries: a GPU has the memory, launches cost
# ``auto`` compiles only for lists at least this large. On one CPU core the fused kernel
# overtakes the eager table at ~0.3M elements (1M: 0.47 against 1.05 ms, 2M: 0.70 against
# 2.73 ms, cold caches); at 1M the one-time compile (~5 s) is paid back within ~10,000 steps.
FUSED_MIN_ELEMENTS = 1 << 20
# A per-step plan of at most this many elements (a model's buffers, a small model) takes the
# eager table whatever the kernel: a compiled call's fixed dispatch (~0.3 ms for a few
# tensors) is many times its arithmetic there, and the fingerprint is the same.
PLAN_EAGER_MAX = 1 << 16
# torch.compile keeps at most 8 graphs per function before it silently runs it uncompiled.
MAX_FUSED_LAYOUTS = 4
# Element types the fused kernel is traced for; others (complex, float8) take the eager kernel.
FUSED_DTYPES = frozenset(
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
    NATIVE = "native"


_FusedFn = Callable[[list[torch.Tensor], tuple[tuple[int, int], ...], torch.Tensor], torch.Tensor]


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
        self._offsets: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def offsets(self, offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The global offsets as a device tensor, copied to the device once per list (a host
        to device copy every step would cost a synchronisation on CUDA)."""
        key = (offsets, device)
        with self.lock:
            value = self._offsets.get(key)
            if value is None:
                if len(self._offsets) >= 64:
                    self._offsets.clear()
                value = torch.tensor(offsets, dtype=torch.int64, device=device)
                self._offsets[key] = value
            return value

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
            options = cpu_compile_options() if device_type == "cpu" else {}
            fn = torch.compile(_fused_list, fullgraph=True, dynamic=False, options=options)
            self._compiled[(device_type, threads)] = fn
        return fn


# CPU capabilities whose vector units multiply 64-bit lanes (AVX-512DQ's vpmullq, SVE). Elsewhere
# (AVX2, NEON) Inductor emulates each lane's product and its vectorised loop is about twice as
# slow as the scalar one (2.7M float32 words on one AVX2 core: 9.9 against 5.3 ms).
INT64_VECTOR_CAPABILITIES = frozenset({"AVX512", "SVE", "SVE128", "SVE256", "SVE512"})


def cpu_compile_options() -> dict[str, str | int | bool | Callable[..., Any]]:
    """``torch.compile`` options for the integer kernels on CPU: a C++ wrapper, and scalar code
    where the vector unit has no 64-bit multiply. Per compiled function: the user's own
    compiled model keeps Inductor's defaults."""
    options: dict[str, str | int | bool | Callable[..., Any]] = {"cpp_wrapper": True}
    if torch.backends.cpu.get_cpu_capability() not in INT64_VECTOR_CAPABILITIES:
        options["cpp.simdlen"] = 1  # no ISA is 1 bit wide: Inductor emits scalar loops
    return options


def set_kernel(kernel: Kernel | str) -> None:
    """Choose the kernel for this process (default ``auto``); the fingerprint does not change."""
    with FUSED_STATE.lock:
        FUSED_STATE.kernel = Kernel(kernel)


def get_kernel() -> Kernel:
    return FUSED_STATE.kernel


# -- multipliers ---------------------------------------------------------------------------------
def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch multiplies by (same bits)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_SM_ADD = _signed(0x9E3779B97F4A7C15)
_SM_MUL1 = _signed(0xBF58476D1CE4E5B9)
_SM_MUL2 = _signed(0x94D049BB133111EB)
# int64 ``>>`` is arithmetic: a logical shift by s keeps the low 64 - s bits of it.
_LOW = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31)}


def multipliers(positions: torch.Tensor) -> torch.Tensor:
    """``splitmix64(i) | 1`` of int64 global positions, elementwise, on their device."""
    z = positions + _SM_ADD
    z = (z ^ ((z >> 30) & _LOW[30])) * _SM_MUL1
    z = (z ^ ((z >> 27) & _LOW[27])) * _SM_MUL2
    return (z ^ ((z >> 31) & _LOW[31])) | 1


class _Table:
    """Multipliers of positions ``[0, n)`` per device, grown by doubling up to ``TABLE_MAX``
    (8 bytes a position): what makes a small list's fingerprint a handful of ops."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, stop: int) -> torch.Tensor:
        with self.lock:
            table = self.tables.get(device)
            if table is None or table.numel() < stop:
                size = min(TABLE_MAX, max(1 << 12, 1 << (stop - 1).bit_length()))
                table = multipliers(torch.arange(size, dtype=torch.int64, device=device))
                self.tables[device] = table
            return table


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ a·b of two int64 vectors, wrapping: one fused op on CPU; CUDA's ``dot`` is BLAS-only
    (floating point), so elsewhere a product and a sum."""
    return torch.dot(a, b) if a.device.type == "cpu" else (a * b).sum()


def _chunk(device: torch.device) -> int:
    """Words per eager chunk: cache-sized on CPU; on GPUs large enough that a launch moves
    megabytes (a 100M-element model takes tens of launches, not hundreds)."""
    return CHUNK if device.type == "cpu" else _GPU_CHUNK


# -- per-tensor reductions -----------------------------------------------------------------------
def flat_words(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order as a 1-D signed integer view of the same width."""
    size = t.element_size()
    if size not in _WORD_VIEW:
        raise FingerprintError(f"cannot fingerprint {t.dtype}: {size}-byte elements")
    return t.detach().reshape(-1).view(_WORD_VIEW[size])


def _plain(
    words: torch.Tensor, first: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ w, Σ m_(first + j)·w)`` of a short 1-D word view, widened to int64. ``first`` is
    a device scalar, never a Python constant: the compiler would fold the multipliers of
    constant positions with unbounded integers instead of wrapping at 64 bits."""
    w = words.to(torch.int64)
    if bits < 64:
        w = w & WORD_MASK[bits // 8]
    idx = torch.arange(words.numel(), dtype=torch.int64, device=words.device) + first
    return w.sum(), (w * multipliers(idx)).sum()


def _eager_local(t: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, T)`` of one tensor in chunks of ``CHUNK`` words: bounded memory on any device.
    Each chunk allocates a few int64 temporaries (the widened words and their multipliers)."""
    words = flat_words(t)
    size = words.element_size()
    s = torch.zeros((), dtype=torch.int64, device=words.device)
    tt = torch.zeros((), dtype=torch.int64, device=words.device)
    step = _chunk(words.device)
    for start in range(0, words.numel(), step):
        chunk = words[start : start + step]
        w = chunk.to(torch.int64, copy=True)  # always a copy: it is modified in place below
        if size < 8:
            w.bitwise_and_(WORD_MASK[size])
        s += w.sum()
        first = offset + start
        idx = torch.arange(first, first + chunk.numel(), dtype=torch.int64, device=words.device)
        tt += w.mul_(multipliers(idx)).sum()
    return s, tt


def _packed_local(
    t: torch.Tensor, head: int, lanes: int, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, T)`` of one tensor at global ``offset`` (a device scalar), traced by
    ``torch.compile``.

    With ``r = 8 / element size`` words per int64 lane, the words are ``head`` loose words
    (up to the first 8-byte boundary), ``lanes`` packed lanes, and a loose tail. Lane ``l``
    holds local words ``j = head + r·l + q`` for ``q < r`` (little-endian): word ``q`` of every
    lane is split out with a shift and a mask and multiplied by ``m_(offset + j)``.
    """
    words = flat_words(t)
    size = words.element_size()
    bits = 8 * size
    n = words.numel()
    r = 8 // size
    if r == 1:
        return _plain(words, offset, bits)
    s = torch.zeros((), dtype=torch.int64, device=words.device)
    tt = torch.zeros((), dtype=torch.int64, device=words.device)
    if head:
        hs, ht = _plain(words[:head], offset, bits)
        s, tt = s + hs, tt + ht
    if lanes:
        v = words[head : head + r * lanes].view(torch.int64)
        mask = WORD_MASK[size]
        base = torch.arange(0, r * lanes, r, dtype=torch.int64, device=words.device)
        base = base + (offset + head)  # a runtime value: see _plain
        lane_sum = v & mask
        lane_weighted = lane_sum * multipliers(base)
        for q in range(1, r):
            wq = (v >> (q * bits)) & mask
            lane_sum = lane_sum + wq
            lane_weighted = lane_weighted + wq * multipliers(base + q)
        s = s + lane_sum.sum()
        tt = tt + lane_weighted.sum()
    done = head + r * lanes
    if done < n:
        ts_, tt_ = _plain(words[done:], offset + done, bits)
        s, tt = s + ts_, tt + tt_
    return s, tt


def _fused_list(
    tensors: list[torch.Tensor], plan: tuple[tuple[int, int], ...], offsets: torch.Tensor
) -> torch.Tensor:
    """The whole fingerprint of one layout; ``plan`` holds each tensor's ``(head, lanes)``,
    ``offsets`` (int64 on the device) their global offsets."""
    device = tensors[0].device
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    for k, (t, (head, lanes)) in enumerate(zip(tensors, plan, strict=True)):
        if t.numel():
            s, tt = _packed_local(t, head, lanes, offsets[k])
            a = a + s
            b = b + tt
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
def prepare(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
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


def layout_of(ts: Sequence[torch.Tensor]) -> tuple[object, ...]:
    """What a compiled graph is specialised for: every tensor's metadata and the thread count
    (global offsets are a runtime input, so they cost no recompilation)."""
    threads = torch.get_num_threads() if ts[0].device.type == "cpu" else 0
    return (threads, *((t.dtype, t.shape, t.stride(), t.storage_offset(), t.device) for t in ts))


def use_fused(ts: Sequence[torch.Tensor]) -> bool:
    kernel = FUSED_STATE.kernel
    if kernel is Kernel.EAGER or any(t.dtype not in FUSED_DTYPES for t in ts):
        return False
    if kernel is Kernel.AUTO and sum(t.numel() for t in ts) < FUSED_MIN_ELEMENTS:
        return False
    layout = layout_of(ts)
    with FUSED_STATE.lock:
        if layout in FUSED_STATE.layouts:
            return True
        if layout in FUSED_STATE.failed:
            if kernel is Kernel.FUSED:
                raise FusedKernelUnavailable("torch.compile failed for this layout before")
            return False
        if len(FUSED_STATE.layouts) + len(FUSED_STATE.failed) >= MAX_FUSED_LAYOUTS:
            if layout not in FUSED_STATE.refused:
                FUSED_STATE.refused.add(layout)
                _log.info(
                    "fingerprint: %d layouts already compiled; this one runs the eager kernel",
                    MAX_FUSED_LAYOUTS,
                    extra={"tensors": len(ts)},
                )
            return False
        FUSED_STATE.layouts.add(layout)
        return True


def use_native(ts: Sequence[torch.Tensor]) -> bool:
    """Whether ``ts`` take :mod:`detection.native`'s kernel: CPU tensors under ``native``, or
    under ``auto`` where the kernel is built and every tensor is contiguous (no copy a step) —
    unless torch runs several intra-op threads and the list is one the compiled kernel would
    take: the C kernel runs on one thread, and there the compiled one's threads outrun it
    (2.7M words, two threads: 2.4 against 3.0 ms)."""
    kernel = FUSED_STATE.kernel
    if kernel is Kernel.NATIVE:
        if ts and ts[0].device.type != "cpu":
            raise FingerprintError(f"the native kernel runs on the CPU, not {ts[0].device}")
        if not native.available():
            raise FingerprintError(f"native kernel: {native.unavailable_reason()}")
        return True
    return (
        kernel is Kernel.AUTO
        and bool(ts)
        and ts[0].device.type == "cpu"
        and all(t.is_contiguous() for t in ts)
        and (torch.get_num_threads() == 1 or sum(t.numel() for t in ts) < FUSED_MIN_ELEMENTS)
        and native.available()
    )


def fused_fingerprint(ts: list[torch.Tensor], offsets: Sequence[int]) -> torch.Tensor | None:
    """The fused result, or ``None`` when compiling this layout failed under ``auto``."""
    plan = tuple(_plan(t) for t in ts)
    try:
        with warnings.catch_warnings():
            # Inductor notes that it reads float16 and bfloat16 storage in one kernel; the words
            # are integer views, so the note is noise in a training log.
            warnings.filterwarnings("ignore", "bf16 and fp16 are mixed", UserWarning)
            where = FUSED_STATE.offsets(tuple(offsets), ts[0].device)
            return FUSED_STATE.compiled(ts[0].device.type)(ts, plan, where)
    except Exception as err:
        layout = layout_of(ts)
        with FUSED_STATE.lock:
            FUSED_STATE.layouts.discard(layout)
            FUSED_STATE.failed.add(layout)
        compile_failed(err, len(ts), "this layout runs the eager kernel")
        return None


def compile_failed(err: Exception, tensors: int, fallback: str) -> None:
    """A compiled kernel could not be built: under ``fused``, which asked for it, raise
    :class:`FusedKernelUnavailable`; under ``auto`` log a warning (the caller then takes
    ``fallback``, which gives the same bits)."""
    if FUSED_STATE.kernel is Kernel.FUSED:
        raise FusedKernelUnavailable(f"torch.compile failed: {err}") from err
    _log.warning(
        "fingerprint: torch.compile failed; %s", fallback, exc_info=err, extra={"tensors": tensors}
    )


def _eager_table(ts: list[torch.Tensor], offsets: Sequence[int], stop: int) -> torch.Tensor:
    """Small lists: per element size, one ``cat`` of the words, one slice (or ``cat`` of
    slices) of the multiplier table, one widening, two reductions."""
    device = ts[0].device
    table = MULTIPLIER_TABLE.get(device, stop)
    groups: dict[int, list[tuple[torch.Tensor, int]]] = {}
    for t, o in zip(ts, offsets, strict=True):
        if t.numel():
            groups.setdefault(t.element_size(), []).append((flat_words(t), o))
    parts: list[torch.Tensor] = []
    for size, members in groups.items():
        words = members[0][0] if len(members) == 1 else torch.cat([w for w, _ in members])
        first, contiguous = members[0][1], True
        for (w, o), (_, nxt) in itertools.pairwise(members):
            contiguous = contiguous and o + w.numel() == nxt
        mult = (
            table[first : first + words.numel()]
            if contiguous
            else torch.cat([table[o : o + w.numel()] for w, o in members])
        )
        w64 = words.to(torch.int64, copy=True)
        if size < 8:
            w64.bitwise_and_(WORD_MASK[size])
        parts.append(torch.stack([w64.sum(), dot(w64, mult)]))
    if not parts:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def eager_fingerprint(ts: list[torch.Tensor], offsets: Sequence[int]) -> torch.Tensor:
    stop = max(o + t.numel() for t, o in zip(ts, offsets, strict=True))
    if stop <= TABLE_MAX:
        return _eager_table(ts, offsets, stop)
    device = ts[0].device
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    for t, o in zip(ts, offsets, strict=True):
        if t.numel():
            s, tt = _eager_local(t, o)
            a = a + s
            b = b + tt
    return torch.stack([a, b])


def global_offsets(
    ts: Sequence[torch.Tensor], offsets: Sequence[int] | None, start: int
) -> list[int]:
    if offsets is None:
        out, position = [], start
        for t in ts:
            out.append(position)
            position += t.numel()
        return out
    if len(offsets) != len(ts):
        raise FingerprintError(f"{len(ts)} tensors but {len(offsets)} offsets")
    if any(o < 0 for o in offsets):
        raise FingerprintError("global offsets must be ≥ 0")
    return list(offsets)


FUSED_STATE = _FusedState()
MULTIPLIER_TABLE = _Table()
