"""The guard's per-step CPU kernels in C: one pass and one call where torch takes several ops.

Why: on a CPU the checks a guard runs every step are a few passes over memory that torch splits
into separate ops — a bucket's sum, its norm and its peak are three passes; the fingerprint's
splitmix64 runs in Inductor's generic vector code; an optimizer state of sixty tensors is sixty
sums. ``kernels.c`` does each in one pass and one call over a list of raw pointers
(one thread, data in cache: 2.4M float32 gradient elements' three statistics in 0.54 ms
against 1.5 ms; 2.7M weights fingerprinted in 1.7-2.1 ms against 2.8 ms; in a training step,
where the data come from memory, the gain is smaller: ``benchmarks/overhead.py``, row
``torch ops, native kernels off``). The ABFT checksums' passes
(:mod:`detection.stepcheck.abft_layers`)
are here for the same reason: a Linear's forward check reads ``x`` and ``y`` once instead of
three passes, its gradient check ``dy`` once instead of two, a normalisation's four channel
sums are one pass instead of eight ops (row ``ABFT, native kernels off``). So is a deferred
decision row's trip through the gradient all-reduce (:mod:`detection.native.carry`).

How it is built: on first use, by the C compiler the Python build names (``CC`` overrides it),
with ``-O3 -march=native``, into ``$SDCGUARD_CACHE_DIR`` (default ``~/.cache/sdcguard``; the
temporary directory where that is not writable) under a name hashed from the source, the
compiler, its flags and this CPU's feature flags, written atomically (ranks that start together
race harmlessly). Where that fails — no compiler in the image, no writable directory — a
warning says why once and every caller keeps its torch path; ``SDCGUARD_NATIVE=0`` switches
the kernels off. GPU tensors never come here.

Invariants the callers rely on:

* every result is a function of the input values alone, the same on every CPU and build (see
  the C file: fixed lanes, no contraction), so ranks compare the reduced sums bit for bit;
* the fingerprint is exactly :mod:`detection.weights.fingerprint`'s (integer arithmetic, any order);
* a caller passes only contiguous CPU tensors of a kind :func:`stats_kind_ok` /
  :func:`nonfinite_kind` admits (any 1-, 2-, 4- or 8-byte element for the fingerprint), and
  keeps them alive while it uses them;
* whether a caller takes the kernels is decided when it builds its :class:`PointerList` (a
  plan, a state flag): switching them off later stops new callers, not a list already built.

Every rank of a job must agree on whether the kernels run, since a torch sum and a native sum of
the same bucket can differ in the last bit: the guard gathers :func:`available` with the rest of
the replay environment at start and refuses to start on a mismatch.
"""

from detection.native.build import (
    NativeUnavailable,
    available,
    is_enabled,
    set_enabled,
    unavailable_reason,
)
from detection.native.kernels import (
    PointerList,
    abft_ok,
    col_sums,
    fingerprint,
    fingerprint_words,
    linear_forward,
    nonfinite,
    nonfinite_kind,
    norm_grad,
    row_sums,
    stats_f32,
    stats_kind_ok,
    sum_f32,
)

__all__ = [
    "NativeUnavailable",
    "PointerList",
    "abft_ok",
    "available",
    "col_sums",
    "fingerprint",
    "fingerprint_words",
    "is_enabled",
    "linear_forward",
    "nonfinite",
    "nonfinite_kind",
    "norm_grad",
    "row_sums",
    "set_enabled",
    "stats_f32",
    "stats_kind_ok",
    "sum_f32",
    "unavailable_reason",
]
