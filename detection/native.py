"""The guard's per-step CPU kernels in C: one pass and one call where torch takes several ops.

Why: on a CPU the checks a guard runs every step are a few passes over memory that torch splits
into separate ops — a bucket's sum, its norm and its peak are three passes; the fingerprint's
splitmix64 runs in Inductor's generic vector code; an optimizer state of sixty tensors is sixty
sums. ``native_kernels.c`` does each in one pass and one call over a list of raw pointers
(one thread, data in cache: 2.4M float32 gradient elements' three statistics in 0.54 ms
against 1.5 ms; 2.7M weights fingerprinted in 1.7-2.1 ms against 2.8 ms; in a training step,
where the data come from memory, the gain is smaller: ``benchmarks/overhead.py``, row
``torch ops, native kernels off``). The ABFT checksums' passes (:mod:`detection.abft_layers`)
are here for the same reason: a Linear's forward check reads ``x`` and ``y`` once instead of
three passes, its gradient check ``dy`` once instead of two, a normalisation's four channel
sums are one pass instead of eight ops (row ``ABFT, native kernels off``). So is a deferred
decision row's trip through the gradient all-reduce (:mod:`detection.native_carry`).

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
* the fingerprint is exactly :mod:`detection.fingerprint`'s (integer arithmetic, any order);
* a caller passes only contiguous CPU tensors of a kind :func:`stats_kind_ok` /
  :func:`nonfinite_kind` admits (any 1-, 2-, 4- or 8-byte element for the fingerprint), and
  keeps them alive while it uses them;
* whether a caller takes the kernels is decided when it builds its :class:`PointerList` (a
  plan, a state flag): switching them off later stops new callers, not a list already built.

Every rank of a job must agree on whether the kernels run, since a torch sum and a native sum of
the same bucket can differ in the last bit: the guard gathers :func:`available` with the rest of
the replay environment at start and refuses to start on a mismatch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

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

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native_kernels.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_TUNE = ("-march=native", "-mprefer-vector-width=512")
_NONFINITE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_STATS_ALL = 3
_STATS_SUM = 1


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here (the reason is the message)."""


class _Loader:
    """Builds and loads the library once per process, under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self.enabled = os.environ.get("SDCGUARD_NATIVE", "1").strip().lower() not in (
            "0",
            "false",
            "no",
            "off",
        )

    def get(self) -> ctypes.CDLL | None:
        if not self.enabled:
            return None
        if self.lib is not None or self.error is not None:
            return self.lib
        with self.lock:
            if self.lib is None and self.error is None:
                try:
                    self.lib = _declare(ctypes.CDLL(str(_build())))
                except (NativeUnavailable, OSError) as err:
                    self.error = str(err)
                    _log.warning(
                        "sdcguard native CPU kernels unavailable, the torch ops run instead: %s",
                        err,
                    )
        return self.lib


_LOADER = _Loader()


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _cache_dirs() -> list[Path]:
    """Where the library may go, in order: ``$SDCGUARD_CACHE_DIR`` (or ``~/.cache/sdcguard``),
    then the temporary directory (a read-only home, as in a locked-down container)."""
    root = os.environ.get("SDCGUARD_CACHE_DIR")
    first = Path(root) if root else Path.home() / ".cache" / "sdcguard"
    fallback = Path(tempfile.gettempdir()) / f"sdcguard-{os.getuid()}"
    return [first / "native", fallback / "native"]


def _scratch(targets: list[Path]) -> tuple[Path, str]:
    """The first of ``targets`` whose directory takes a new file, and a scratch file in it."""
    errors = []
    for target in targets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        except OSError as err:
            errors.append(f"{target.parent}: {err}")
            continue
        os.close(fd)
        return target, scratch
    raise NativeUnavailable("no writable cache: " + "; ".join(errors))


def _build() -> Path:
    """The compiled library's path, compiling it when this source, compiler and CPU have none."""
    source = _SOURCE.read_bytes()
    cc = _compiler()
    for tune in (_TUNE, ()):
        key = hashlib.sha256(
            b"\0".join([source, " ".join(cc + list(_FLAGS + tune)).encode(), _cpu_flags().encode()])
        ).hexdigest()[:20]
        targets = [d / f"kernels-{key}.so" for d in _cache_dirs()]
        for built in targets:
            if built.exists():
                return built
        target, scratch = _scratch(targets)
        command = [*cc, *_FLAGS, *tune, str(_SOURCE), "-o", scratch, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            Path(scratch).unlink(missing_ok=True)
            raise NativeUnavailable(f"{shlex.join(command)}: {err}") from err
        if done.returncode == 0:
            os.replace(scratch, target)  # atomic: a rank racing this one loads either copy
            return target
        Path(scratch).unlink(missing_ok=True)
        if tune:
            continue  # a compiler without -march=native: build the portable way
        raise NativeUnavailable(f"{shlex.join(command)} failed: {done.stderr.strip()[-500:]}")
    raise AssertionError("unreachable")  # pragma: no cover


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.sdc_stats_f32.argtypes = [p, i64, i64, i32, p]
    lib.sdc_stats_f32.restype = None
    lib.sdc_nonfinite.argtypes = [i64, p, p, p]
    lib.sdc_nonfinite.restype = i32
    lib.sdc_fingerprint.argtypes = [i64, p, p, p, p, p]
    lib.sdc_fingerprint.restype = i32
    f = ctypes.c_float
    lib.sdc_linear_forward_f32.argtypes = [p, p, p, i64, i64, i64, f, f, f, p]
    lib.sdc_linear_forward_f32.restype = None
    lib.sdc_row_sums_f32.argtypes = [p, i64, i64, p, p]
    lib.sdc_row_sums_f32.restype = None
    lib.sdc_col_sums_f32.argtypes = [p, i64, i64, p, p, p]
    lib.sdc_col_sums_f32.restype = None
    lib.sdc_norm_grad_f32.argtypes = [p, p, i64, i64, p]
    lib.sdc_norm_grad_f32.restype = None
    lib.sdc_carry_join_f32.argtypes = [p, i64, i64, p, i64, i64, p]
    lib.sdc_carry_join_f32.restype = None
    lib.sdc_carry_table_f32.argtypes = [p, i64, i64, p]
    lib.sdc_carry_table_f32.restype = i32
    return lib


def available() -> bool:
    """Whether the kernels run in this process (built, loaded and not switched off)."""
    return _LOADER.get() is not None


def set_enabled(enabled: bool) -> None:
    """Switch the kernels on or off for this process (``SDCGUARD_NATIVE`` sets the default).
    Every rank must do the same: the guard refuses to start when ranks disagree."""
    _LOADER.enabled = enabled


def is_enabled() -> bool:
    """Whether the kernels are switched on (they may still be unavailable: :func:`available`)."""
    return _LOADER.enabled


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    if not _LOADER.enabled:
        return "switched off (SDCGUARD_NATIVE=0 or set_enabled(False))"
    _LOADER.get()
    return _LOADER.error


def _lib() -> ctypes.CDLL:
    """The loaded library: once loaded it stays usable for the lists built with it, even after
    :func:`set_enabled` switched the kernels off for new callers."""
    lib = _LOADER.lib or _LOADER.get()
    if lib is None:
        raise NativeUnavailable(unavailable_reason() or "unavailable")
    return lib


def _check(t: torch.Tensor) -> None:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"native kernels take contiguous CPU tensors, not {t.device} {t.shape}")


def stats_kind_ok(t: torch.Tensor) -> bool:
    """Whether :func:`stats_f32` takes ``t``: float32, contiguous, on the CPU."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def stats_f32(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[Σ, ‖·‖₂, max |·|]`` of a float32 CPU tensor as a float64 tensor of 3, one pass
    (the sum as float32 chunks of ``chunk`` elements added in float64; ``chunk=0``: every
    element added in float64)."""
    _check(flat)
    out = torch.empty(3, dtype=torch.float64)
    _lib().sdc_stats_f32(flat.data_ptr(), flat.numel(), chunk, _STATS_ALL, out.data_ptr())
    return out


def sum_f32(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Σ of a float32 CPU tensor as a float64 scalar tensor (float32 chunks in float64)."""
    _check(flat)
    out = torch.empty(1, dtype=torch.float64)
    _lib().sdc_stats_f32(flat.data_ptr(), flat.numel(), chunk, _STATS_SUM, out.data_ptr())
    return out.reshape(())


def nonfinite_kind(t: torch.Tensor) -> int | None:
    """The kernel's code for ``t``'s dtype, or ``None`` when it has none (float8, integers)."""
    return _NONFINITE_KINDS.get(t.dtype)


class PointerList:
    """A fixed list of contiguous CPU tensors as the C arrays one call takes (built once; the
    caller rebuilds it when a tensor's address changes, and keeps the tensors alive)."""

    def __init__(
        self, tensors: list[torch.Tensor], codes: list[int], offsets: list[int] | None = None
    ) -> None:
        for t in tensors:
            _check(t)
        n = len(tensors)
        self.tensors = tensors
        self.count = n
        self.ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in tensors))
        self.numels = (ctypes.c_int64 * n)(*(t.numel() for t in tensors))
        self.codes = (ctypes.c_int32 * n)(*codes)
        self.offsets = (ctypes.c_int64 * n)(*(offsets or [0] * n))


def nonfinite(pointers: PointerList) -> bool:
    """Whether any element of the listed floating-point tensors is NaN or ±Inf (codes:
    :func:`nonfinite_kind`)."""
    got = _lib().sdc_nonfinite(pointers.count, pointers.ptrs, pointers.numels, pointers.codes)
    if got < 0:
        raise ValueError("a tensor of a kind the non-finite kernel has no code for")
    return bool(got)


def fingerprint_words(pointers: PointerList) -> list[int]:
    """:func:`fingerprint` as two host ints, for a CPU job's row: the C call writes into a
    small array of its own, with no tensor made and none read back."""
    out = (ctypes.c_int64 * 2)()
    got = _lib().sdc_fingerprint(
        pointers.count, pointers.ptrs, pointers.numels, pointers.codes, pointers.offsets, out
    )
    if got < 0:
        raise ValueError("a tensor whose element size the fingerprint kernel has no code for")
    return list(out)


def fingerprint(pointers: PointerList) -> torch.Tensor:
    """The fingerprint ``(A, B)`` of the listed tensors (codes: element sizes, offsets: global
    positions) as a new int64 tensor of 2 (a caller may keep it across steps)."""
    out = torch.empty(2, dtype=torch.int64)
    got = _lib().sdc_fingerprint(
        pointers.count,
        pointers.ptrs,
        pointers.numels,
        pointers.codes,
        pointers.offsets,
        out.data_ptr(),
    )
    if got < 0:
        raise ValueError("a tensor whose element size the fingerprint kernel has no code for")
    return out


def abft_ok(*tensors: torch.Tensor) -> bool:
    """Whether the ABFT kernels below take these tensors (float32, contiguous, on the CPU) and
    run here; the caller keeps its torch path otherwise."""
    return all(stats_kind_ok(t) for t in tensors) and available()


def linear_forward(
    x: torch.Tensor, y: torch.Tensor, sums: torch.Tensor, c_bound: float, c: float, tiny: float
) -> torch.Tensor:
    """The forward row checksum of ``y = x Wᵀ + b`` (``x``: rows x K, ``y``: rows x N,
    ``sums``: :func:`col_sums` of ``W`` and ``b``) in one pass over ``x`` and ``y``: a float32
    tensor of 2, ``[max_i |y_i.sum() - x_i @ W.sum(0) - Σb| / (‖x_i‖₂·‖W‖_F·c_bound +
    Σ|b|·c + tiny), ‖x‖_F]`` (NaN first when any row's ratio is NaN)."""
    for t in (x, y, sums):
        _check(t)
    rows, k = x.shape
    if y.shape[0] != rows or sums.numel() != k + 3:
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)}, sums {tuple(sums.shape)}")
    out = torch.empty(2, dtype=torch.float32)
    _lib().sdc_linear_forward_f32(
        x.data_ptr(),
        y.data_ptr(),
        sums.data_ptr(),
        rows,
        k,
        y.shape[1],
        c_bound,
        c,
        tiny,
        out.data_ptr(),
    )
    return out


def row_sums(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d.sum(-1), ‖d‖_F)`` of a float32 matrix in one pass (float32; the norm's square summed
    in float64)."""
    _check(d)
    rows, n = d.shape
    out = torch.empty(rows + 1, dtype=torch.float32)
    _lib().sdc_row_sums_f32(d.data_ptr(), rows, n, out.data_ptr(), out[rows:].data_ptr())
    return out[:rows], out[rows]


def col_sums(w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[w.sum(0), ‖w‖_F, Σ bias, Σ |bias|]`` of a float32 matrix (and its bias; zeros
    without) as one float32 tensor of ``K + 3``, one pass, accumulated in float64."""
    _check(w)
    rows, k = w.shape
    if bias is not None:
        _check(bias)
        if bias.numel() != rows:
            raise ValueError(f"bias of {bias.numel()} for {rows} rows")
    out = torch.empty(k + 3, dtype=torch.float32)
    work = torch.empty(k, dtype=torch.float64)
    _lib().sdc_col_sums_f32(
        w.data_ptr(),
        rows,
        k,
        None if bias is None else bias.data_ptr(),
        work.data_ptr(),
        out.data_ptr(),
    )
    return out


def norm_grad(d: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    """An affine normalisation's gradient checksums in one pass over the output gradient ``d``
    and the recomputed ``x̂`` (both rows x width): per channel ``[Σ d·x̂, Σ |d·x̂| + Σ |d|,
    Σ d, Σ |d|]`` as one float32 tensor of 4 x width (accumulated in float64)."""
    for t in (d, xh):
        _check(t)
    if d.dim() != 2 or d.shape != xh.shape:
        raise ValueError(f"d {tuple(d.shape)} and x̂ {tuple(xh.shape)}: two equal matrices")
    rows, width = d.shape
    out = torch.empty(4, width, dtype=torch.float32)
    _lib().sdc_norm_grad_f32(d.data_ptr(), xh.data_ptr(), rows, width, out.data_ptr())
    return out


if __name__ == "__main__":  # python -m detection.native: build, and say whether it works
    print("available" if available() else f"unavailable: {unavailable_reason()}")
    sys.exit(0 if available() else 1)
