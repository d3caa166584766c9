"""The C kernels' Python faces: each checks what it is given and makes one call.

What each computes, and the invariants every caller relies on, are in the C file
(``kernels.c``) and :mod:`detection.native`; building and loading it is
:mod:`detection.native.build`.
"""

from __future__ import annotations

import ctypes

import torch

from detection.native.build import available, library

__all__ = [
    "PointerList",
    "abft_ok",
    "col_sums",
    "fingerprint",
    "fingerprint_words",
    "linear_forward",
    "nonfinite",
    "nonfinite_kind",
    "norm_grad",
    "row_sums",
    "stats_f32",
    "stats_kind_ok",
    "sum_f32",
]

_NONFINITE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_STATS_ALL = 3
_STATS_SUM = 1


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
    library().sdc_stats_f32(flat.data_ptr(), flat.numel(), chunk, _STATS_ALL, out.data_ptr())
    return out


def sum_f32(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Σ of a float32 CPU tensor as a float64 scalar tensor (float32 chunks in float64)."""
    _check(flat)
    out = torch.empty(1, dtype=torch.float64)
    library().sdc_stats_f32(flat.data_ptr(), flat.numel(), chunk, _STATS_SUM, out.data_ptr())
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
    got = library().sdc_nonfinite(pointers.count, pointers.ptrs, pointers.numels, pointers.codes)
    if got < 0:
        raise ValueError("a tensor of a kind the non-finite kernel has no code for")
    return bool(got)


def fingerprint_words(pointers: PointerList) -> list[int]:
    """:func:`fingerprint` as two host ints, for a CPU job's row: the C call writes into a
    small array of its own, with no tensor made and none read back."""
    out = (ctypes.c_int64 * 2)()
    got = library().sdc_fingerprint(
        pointers.count, pointers.ptrs, pointers.numels, pointers.codes, pointers.offsets, out
    )
    if got < 0:
        raise ValueError("a tensor whose element size the fingerprint kernel has no code for")
    return list(out)


def fingerprint(pointers: PointerList) -> torch.Tensor:
    """The fingerprint ``(A, B)`` of the listed tensors (codes: element sizes, offsets: global
    positions) as a new int64 tensor of 2 (a caller may keep it across steps)."""
    out = torch.empty(2, dtype=torch.int64)
    got = library().sdc_fingerprint(
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
    library().sdc_linear_forward_f32(
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
    library().sdc_row_sums_f32(d.data_ptr(), rows, n, out.data_ptr(), out[rows:].data_ptr())
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
    library().sdc_col_sums_f32(
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
    library().sdc_norm_grad_f32(d.data_ptr(), xh.data_ptr(), rows, width, out.data_ptr())
    return out
