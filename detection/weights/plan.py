"""The fingerprint of one fixed list of tensors, taken every step (:class:`FingerprintPlan`).

The definition and its proofs are :mod:`detection.weights.fingerprint`'s; a plan gives the same
bits as
:func:`~detection.weights.fingerprint.fingerprint_on_device` for the same list, only for less per
call.
On a CPU where :mod:`detection.native` builds, under ``auto`` (and under ``native``), a plan
holds its list as the C function's pointer arrays and each call is one call of it, whatever the
list's size (:func:`~detection.weights.fingerprint_kernels.use_native`). Otherwise it holds the
multipliers of
its positions (8 bytes an element) and picks, once per layout:

* the **eager table** for small lists (up to ``PLAN_EAGER_MAX`` elements, or any list the
  ``eager`` kernel is asked for): one widening copy into a reused int64 buffer, one mask, two
  reductions (on CPU, up to ``_PAIR_MAX`` words, one matrix-vector product for both) — a
  fixed handful of ops whatever the number of tensors;
* the **compiled table** on a CPU without a native 64-bit vector multiply (AVX2, NEON), for
  lists the fused kernel would take, up to ``TABLE_MAX`` elements: ``torch.compile`` of one
  pass per tensor that reads each word and its multiplier, with no temporaries. Recomputing
  splitmix64 per word (the fused kernel) costs three 64-bit multiplications a word, which
  there makes that kernel compute-bound; reading the multiplier costs one and 8 bytes of
  bandwidth (2.7M float32 words on one AVX2 core: 2.1 ms against 5.3 ms fused and 0.55 ms for
  ``torch.sum``; ``benchmarks/fingerprint.py``). If compiling fails it logs a warning and the
  plan takes the eager table (under ``fused`` it raises
  :class:`~detection.weights.fingerprint_kernels.FusedKernelUnavailable`);
* :func:`~detection.weights.fingerprint.fingerprint_on_device` otherwise: the fused kernel on a GPU,
  where the arithmetic is cheap and a table of a large model's positions is not, and on a CPU
  that multiplies 64-bit lanes natively (AVX-512, SVE), where the vectorised kernel outruns the
  table's extra 8 bytes a word (2.7M words on one Zen 5 core: 0.66 against 0.99 ms); lists
  beyond the table; non-contiguous tensors. When the fused kernel has no room left for another
  layout (``MAX_FUSED_LAYOUTS``), such a CPU takes the compiled table after all; when
  compiling the fused kernel fails (under ``auto``), the eager table from the next call on.

Each call checks that every tensor still has the same storage address, shape, stride and dtype
(a parameter whose ``.data`` was replaced, an optimizer state created later) and rebuilds when
one changed, so the result is always that of the live tensors.

On a GPU, whichever kernel a plan runs, its ops are captured once as a CUDA graph
(:class:`~detection.weights.device_graph.GraphedCall`) and replayed from then on: one launch a call
instead of one an op, two a tensor for the fused kernel. That check is what makes the replay
exact: a rebuild drops the graph.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

from detection import native
from detection.weights.device_graph import GraphedCall
from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.fingerprint_kernels import (
    FUSED_DTYPES,
    FUSED_MIN_ELEMENTS,
    FUSED_STATE,
    INT64_VECTOR_CAPABILITIES,
    MAX_FUSED_LAYOUTS,
    MULTIPLIER_TABLE,
    PLAN_EAGER_MAX,
    TABLE_MAX,
    WORD_MASK,
    Kernel,
    compile_failed,
    cpu_compile_options,
    dot,
    flat_words,
    global_offsets,
    layout_of,
    multipliers,
    prepare,
    use_fused,
    use_native,
)

__all__ = ["FingerprintPlan"]

# What a plan is built for: each tensor's address and size, and whether all are contiguous.
# Enough to know the words a build reads are still the tensors' words: a new storage moves the
# address, a narrowed or re-typed view changes the size, a transposed one the contiguity; a
# contiguous view of another shape over the same memory has the same words in the same order.
# Read with map() over torch's methods (no shape objects made): a per-call cost on small models.
_Key = tuple[list[int], list[int], bool]
_TableFn = Callable[[list[torch.Tensor], torch.Tensor, tuple[int, ...]], torch.Tensor]


def _table_list(
    tensors: list[torch.Tensor], mult: torch.Tensor, starts: tuple[int, ...]
) -> torch.Tensor:
    """``(A, B)`` of a list whose multipliers, in the list's order, are ``mult``: tensor ``k``'s
    words meet ``mult[starts[k]:]``. Traced by ``torch.compile``: one pass per tensor."""
    a = torch.zeros((), dtype=torch.int64, device=mult.device)
    b = torch.zeros((), dtype=torch.int64, device=mult.device)
    for t, at in zip(tensors, starts, strict=True):
        n = t.numel()
        if not n:
            continue
        words = flat_words(t)
        w = words.to(torch.int64)
        if words.element_size() < 8:
            w = w & WORD_MASK[words.element_size()]
        a = a + w.sum()
        b = b + (w * mult[at : at + n]).sum()
    return torch.stack([a, b])


class _TableKernels:
    """The compiled table kernel per CPU thread count (its loops are specialised for it), and
    the layouts compiled so far: at most ``MAX_FUSED_LAYOUTS``, under the compiler's limit
    of graphs per function; later layouts take the eager table."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.layouts: set[tuple[object, ...]] = set()
        self.failed: set[tuple[object, ...]] = set()
        self._fns: dict[int, _TableFn] = {}

    def admit(self, layout: tuple[object, ...]) -> bool:
        with self.lock:
            if layout in self.layouts:
                return True
            if layout in self.failed or len(self.layouts) >= MAX_FUSED_LAYOUTS:
                return False
            self.layouts.add(layout)
            return True

    def fail(self, layout: tuple[object, ...]) -> None:
        with self.lock:
            self.layouts.discard(layout)
            self.failed.add(layout)

    def fn(self) -> _TableFn:
        threads = torch.get_num_threads()
        with self.lock:
            fn = self._fns.get(threads)
            if fn is None:
                fn = torch.compile(
                    _table_list, fullgraph=True, dynamic=False, options=cpu_compile_options()
                )
                self._fns[threads] = fn
            return fn


_KERNELS = _TableKernels()


def _recomputing_is_cheaper() -> bool:
    """Whether this CPU's vector unit multiplies 64-bit lanes natively (AVX-512, SVE). There the
    fused kernel's splitmix64 runs vectorised and beats reading 8 bytes of multiplier a word
    (2.7M float32 words on one AVX-512 core, Zen 5: 0.66 ms fused against 0.99 ms for the
    table, 0.20 ms for ``torch.sum``); without one the table takes less than half the time
    (AVX2: 2.1 against 5.3 ms). The bits are the same either way."""
    return torch.backends.cpu.get_cpu_capability() in INT64_VECTOR_CAPABILITIES


def _table_is_cheaper(ts: Sequence[torch.Tensor]) -> bool:
    """Whether a plan under ``auto`` leaves this list to the compiled table rather than the C
    kernel: a list the compiled kernel takes (a million words or more, of its dtypes) on a CPU
    without 64-bit vector multiplies. There the C kernel's splitmix64 costs three emulated
    multiplications a word where the table costs a load and one (2.7M float32 words on one AVX2
    core: 3.5 ms against 2.3 ms). The bits are the same; where compiling fails the plan keeps
    the eager table, and where no more layouts are compiled it answers with the C kernel
    (:func:`~detection.weights.fingerprint.fingerprint_on_device`)."""
    return (
        FUSED_STATE.kernel is Kernel.AUTO
        and not _recomputing_is_cheaper()
        and sum(t.numel() for t in ts) >= FUSED_MIN_ELEMENTS
        and all(t.dtype in FUSED_DTYPES for t in ts)
    )


# A CPU plan of at most this many words takes ``A`` and ``B`` as one int64 matrix-vector
# product with ``[ones; multipliers]`` (wrapping like ``dot``): one op where the sum, the dot
# and their stack take three. A model's buffers are fingerprinted three times a step, so the
# ops are the cost there (1,026 words: 2.4 against 4.9 µs); on longer lists ``mv``'s loop is
# slower than ``sum`` and ``dot`` (17,440 words: 20.5 against 15.8 µs).
_PAIR_MAX = 1 << 12


class FingerprintPlan:
    """What :func:`~detection.weights.fingerprint.fingerprint_on_device` returns for ``tensors``
    (placed from ``start``), for a fraction of its per-call cost; see the module."""

    def __init__(self, tensors: Iterable[torch.Tensor], *, start: int = 0) -> None:
        self.tensors = list(tensors)
        self._start = start
        self._key: _Key | None = None
        # Per element size: the word views and where their int64 copies go in ``_words``.
        self._groups: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._words: torch.Tensor | None = None  # every word widened to int64, reused
        self._mult: torch.Tensor | None = None  # their multipliers, in the same order
        self._mask: int | torch.Tensor | None = None  # zero-extension of narrow words
        self._pair: torch.Tensor | None = None  # [ones; multipliers]: A and B in one op
        self._device: torch.device | None = None
        # The compiled table: multipliers in the list's order and each tensor's first one.
        self._ordered: torch.Tensor | None = None
        self._starts: tuple[int, ...] = ()
        self._layout: tuple[object, ...] | None = None
        self._live: list[torch.Tensor] = []  # the tensors, detached, as of the last build
        # The fused kernel's layout, when the plan runs on it (a GPU, a CPU with 64-bit lanes).
        self._fused: tuple[object, ...] | None = None
        # On a CPU with detection.native: the list as one call's pointer arrays.
        self._native: native.PointerList | None = None
        # On a GPU, the ops of one call captured as a CUDA graph: one launch a step.
        self._graphed = GraphedCall(self._compute, what="fingerprint plan")

    def _signature(self) -> _Key:
        ts = self.tensors
        return (
            list(map(torch.Tensor.data_ptr, ts)),
            list(map(torch.Tensor.numel, ts)),
            all(map(torch.Tensor.is_contiguous, ts)),
        )

    def _build(self, key: _Key) -> None:
        self._graphed.reset()  # a graph reads the old addresses and buffers
        ts = prepare(self.tensors)
        self._key, self._groups, self._words, self._mult = key, [], None, None
        self._pair = None
        self._ordered, self._layout, self._live, self._fused = None, None, [], None
        self._native = None
        self._device = ts[0].device if ts else None
        where = global_offsets(ts, None, self._start)
        contiguous = all(t.is_contiguous() for t in ts)  # else the view would be a copy
        if ts and contiguous and use_native(ts) and not _table_is_cheaper(ts):
            flat = [t.reshape(-1) for t in ts]
            self._native = native.PointerList(flat, [t.element_size() for t in flat], where)
            return
        numel = sum(t.numel() for t in ts)
        kernel = FUSED_STATE.kernel
        fused = kernel is Kernel.FUSED or (kernel is Kernel.AUTO and numel >= FUSED_MIN_ELEMENTS)
        if not ts or not contiguous or numel > TABLE_MAX:
            return
        if fused and numel > PLAN_EAGER_MAX:
            cpu = ts[0].device.type == "cpu"
            if cpu and _recomputing_is_cheaper() and use_fused(ts):
                self._fused = layout_of(ts)  # fingerprint_on_device's kernel, its layout admitted
                return
            compiled = (
                cpu and all(t.dtype in FUSED_DTYPES for t in ts) and _KERNELS.admit(layout_of(ts))
            )
            if compiled:
                self._build_compiled(ts, where)
            return  # else fingerprint_on_device, whose fused kernel a GPU runs well
        self._build_eager(ts, where)

    @staticmethod
    def _range(device: torch.device, first: int, n: int) -> torch.Tensor:
        """The multipliers of positions ``[first, first + n)``: a view of the shared table where
        it covers them; beyond it (a model's buffers, numbered after millions of parameters)
        computed once for these positions, 8 bytes an element."""
        if first + n <= TABLE_MAX:
            return MULTIPLIER_TABLE.get(device, first + n)[first : first + n]
        return multipliers(torch.arange(first, first + n, device=device))

    def _build_compiled(self, ts: list[torch.Tensor], where: list[int]) -> None:
        """The plan's positions are consecutive from ``start``, so one range of multipliers in
        the list's order serves every tensor: no copy of the shared table."""
        with torch.inference_mode(False):
            self._ordered = self._range(ts[0].device, where[0], sum(t.numel() for t in ts))
        self._starts = tuple(o - where[0] for o in where)
        self._layout = layout_of(ts)
        self._live = ts

    def _build_eager(self, ts: list[torch.Tensor], where: list[int]) -> None:
        self._graphed.reset()
        device = ts[0].device
        groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for t, o in zip(ts, where, strict=True):
            if t.numel():
                m = self._range(device, o, t.numel())
                groups.setdefault(t.element_size(), []).append((flat_words(t), m))
        if not groups:
            return
        # Normal tensors even when first made under inference mode, so that later calls
        # outside it may write into them (an inference tensor refuses in-place updates there).
        with torch.inference_mode(False):
            words = torch.empty(sum(t.numel() for t in ts), dtype=torch.int64, device=device)
            mults: list[torch.Tensor] = []
            masks: list[tuple[int, int]] = []
            at = 0
            for size, members in groups.items():
                n = sum(w.numel() for w, _ in members)
                self._groups.append(([w for w, _ in members], words[at : at + n]))
                at += n
                mults.extend(m for _, m in members)
                masks.append((n, WORD_MASK.get(size, -1)))
            self._words, self._mult = words, torch.cat(mults)
            if device.type == "cpu" and words.numel() <= _PAIR_MAX:
                self._pair = torch.stack([torch.ones_like(self._mult), self._mult])
            # One zero-extension for every narrow word: a scalar when all words share a width,
            # else a per-word mask (all ones over 8-byte words).
            widths = {m for _, m in masks}
            if widths == {-1}:
                self._mask = None
            elif len(widths) == 1:
                self._mask = widths.pop()
            else:
                self._mask = torch.cat(
                    [torch.full((n,), m, dtype=torch.int64, device=device) for n, m in masks]
                )

    def _compiled(self, ordered: torch.Tensor) -> torch.Tensor | None:
        """The compiled table's result, or ``None`` once compiling this layout failed under
        ``auto`` (the plan then keeps the eager table)."""
        ts = self._live
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "bf16 and fp16 are mixed", UserWarning)
                with torch.no_grad():
                    return _KERNELS.fn()(ts, ordered, self._starts)
        except Exception as err:
            if self._layout is not None:
                _KERNELS.fail(self._layout)
            compile_failed(err, len(ts), "this list takes the eager table")
            self._ordered = None
            self._build_eager(prepare(self.tensors), global_offsets(ts, None, self._start))
            return None

    def __call__(self) -> torch.Tensor:
        """The fingerprint of the live tensors, as a 2-element int64 device tensor."""
        key = self._signature()
        if key != self._key:
            self._build(key)
        return self._graphed()

    def words(self) -> list[int]:
        """:meth:`__call__` as two host ints, for a CPU job's row (:mod:`detection.row.words`):
        a plan on the C kernel answers straight from its call, any other reads its tensor."""
        key = self._signature()
        if key != self._key:
            self._build(key)
        if self._native is not None:
            return native.fingerprint_words(self._native)
        words: list[int] = self._graphed().tolist()
        return words

    def _compute(self) -> torch.Tensor:
        """One call's device work, for the tensors of the current build."""
        if self._device is None:
            return torch.zeros(2, dtype=torch.int64)
        if self._native is not None:
            return native.fingerprint(self._native)
        if self._fused is not None:
            if self._fused not in FUSED_STATE.failed:
                return fingerprint_on_device(self.tensors, start=self._start)
            # Compiling it failed (the fused kernel logged why, and its call still answered
            # with the eager kernel): this list takes the eager table from now on.
            self._fused = None
            ts = prepare(self.tensors)
            self._build_eager(ts, global_offsets(ts, None, self._start))
        if self._ordered is not None:
            out = self._compiled(self._ordered)
            if out is not None:
                return out
        words, mult = self._words, self._mult
        if words is None or mult is None:
            return fingerprint_on_device(self.tensors, start=self._start)
        for views, into in self._groups:
            into.copy_(views[0] if len(views) == 1 else torch.cat(views))
        if self._mask is not None:
            words.bitwise_and_(self._mask)
        if self._pair is not None:
            return torch.mv(self._pair, words)
        return torch.stack([words.sum(), dot(words, mult)])
