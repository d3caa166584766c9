"""detection.native's ABFT passes for ``nn.Linear`` and the affine normalisations
(:mod:`detection.stepcheck.abft_layers`): each fused pass against the float64 value of what it
replaces,
and the Linear forward ratio against its definition — small on a clean layer, the corrupted
element's own size when one is flipped."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detection import native
from detection.faults.injector import flip_bit_
from detection.stepcheck.abft import LinearChecksums
from detection.stepcheck.abft_layers import TINY, unit

SHAPES = [(1, 1), (5, 17), (33, 8), (64, 256), (300, 1000)]


@pytest.fixture(autouse=True)
def _kernels() -> None:
    assert native.available(), native.unavailable_reason()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_column_sums_norm_and_bias_sums_are_the_float64_values(
    shape: tuple[int, int], bias: bool
) -> None:
    rows, k = shape
    w = torch.randn(rows, k, generator=_gen(rows * k)) * 3.0
    b = torch.randn(rows, generator=_gen(k)) if bias else None
    got = native.col_sums(w, b).double()
    wd = w.double()
    torch.testing.assert_close(got[:k], wd.sum(0), rtol=1e-6, atol=1e-6 * rows)
    assert got[k].item() == pytest.approx(wd.norm().item(), rel=1e-6)
    if b is None:
        assert got[k + 1 :].tolist() == [0.0, 0.0]
    else:
        assert got[k + 1].item() == pytest.approx(b.double().sum().item(), rel=1e-5, abs=1e-5)
        assert got[k + 2].item() == pytest.approx(b.double().abs().sum().item(), rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_row_sums_and_the_frobenius_norm_are_the_float64_values(shape: tuple[int, int]) -> None:
    rows, n = shape
    d = torch.randn(rows, n, generator=_gen(rows + n))
    r, norm = native.row_sums(d)
    dd = d.double()
    # float32 lanes: the error of a float32 sum, a few units of its magnitude at most
    bound = 4 * n * unit(torch.float32) * dd.abs().sum(-1)
    assert ((r.double() - dd.sum(-1)).abs() <= bound).all()
    assert norm.item() == pytest.approx(dd.norm().item(), rel=1e-6)


def _layer(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = _gen(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    b = torch.randn(n, generator=gen)
    return x, w, b, F.linear(x, w, b)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> float:
    """The forward ratio as LinearCheck defines it, in float64 from the same inputs."""
    k, n = x.shape[1], w.shape[0]
    xd, wd, bd, yd = x.double(), w.double(), b.double(), y.double()
    residual = yd.sum(-1) - xd @ wd.sum(0) - bd.sum()
    c = unit(torch.float32) * math.sqrt(k)
    scale = xd.norm(dim=-1) * (wd.norm() * math.sqrt(n) * c) + bd.abs().sum() * c + TINY
    return float((residual.abs() / scale).max())


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 1, 1), (7, 19, 33), (256, 256, 1024)])
def test_the_forward_ratio_stays_small_when_clean_and_is_the_flip_when_one_is_flipped(
    rows: int, k: int, n: int
) -> None:
    x, w, b, y = _layer(rows, k, n, rows + k + n)
    sums = native.col_sums(w, b)
    c = unit(torch.float32) * math.sqrt(k)
    clean = native.linear_forward(x, y, sums, c * math.sqrt(n), c, TINY)
    assert clean[0].item() < 1.0  # rounding only: far below the tolerance's unit
    assert clean[1].item() == pytest.approx(x.double().norm().item(), rel=1e-6)
    flat = y.view(-1)
    element = int(flat.abs().argmax())
    flip_bit_(flat, element, 28)  # a large change: the residual is the flip's own size
    flipped = native.linear_forward(x, y, sums, c * math.sqrt(n), c, TINY)
    assert flipped[0].item() == pytest.approx(_reference(x, w, b, y), rel=1e-3)
    assert flipped[0].item() > 1e3


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_non_finite_output_makes_the_forward_ratio_non_finite_as_torchs_amax(
    value: float,
) -> None:
    """inf stays inf; one NaN row makes the maximum NaN whatever the other rows hold (the
    checksums count it as inf)."""
    x, w, b, y = _layer(9, 20, 30, 3)
    sums = native.col_sums(w, b)
    y[4, 7] = value
    got = native.linear_forward(x, y, sums, 1e-6, 1e-7, TINY)[0].item()
    assert got == value if math.isinf(value) else math.isnan(got)


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    x, w, b, y = _layer(4, 8, 6, 5)
    assert not native.abft_ok(x.t())  # not contiguous
    assert not native.abft_ok(x.double())
    with pytest.raises(ValueError, match="contiguous CPU"):
        native.row_sums(y.t())
    with pytest.raises(ValueError, match="sums"):
        native.linear_forward(x, y, native.col_sums(w[:, :4].contiguous(), None), 1.0, 1.0, TINY)
    with pytest.raises(ValueError, match="bias"):
        native.col_sums(w, b[:3])


@pytest.mark.parametrize("shape", SHAPES)
def test_the_normalisation_gradient_sums_are_the_float64_values(shape: tuple[int, int]) -> None:
    rows, width = shape
    gen = _gen(rows * 7 + width)
    d, xh = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    got = native.norm_grad(d, xh).double()
    dd, xd = d.double(), xh.double()
    p = dd * xd
    want = torch.stack([p.sum(0), p.abs().sum(0) + dd.abs().sum(0), dd.sum(0), dd.abs().sum(0)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="two equal matrices"):
        native.norm_grad(d, torch.zeros(rows, width + 1))


class _TransposedInput(nn.Module):
    """A Linear fed a transposed view: its input rows are not contiguous, so the forward check
    takes torch's ops on the weight sums the kernel made."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)
        self.transposed = transposed

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = a.t()
        return self.lin(x if self.transposed else x.contiguous())


@pytest.mark.parametrize("transposed", [True, False])
def test_a_linear_whose_input_the_kernel_cannot_read_is_still_checked(transposed: bool) -> None:
    torch.manual_seed(0)
    model = _TransposedInput(transposed)
    flip: list[int] = []

    def corrupt(_m: nn.Module, _i: Any, y: torch.Tensor) -> None:
        if flip:
            flip_bit_(y.detach().view(-1), flip[0], 30)

    model.lin.register_forward_hook(corrupt)  # before the checksum's hook: it sees the flip
    abft = LinearChecksums(model, list(model.parameters()))
    a = torch.randn(8, 16)
    for corrupted in (False, True):
        flip[:] = [37] if corrupted else []
        abft.open()
        with torch.no_grad():
            model(a)
        abft.close()
        forward = abft.ratios().view(-1, 2)[0, 0].item()
        assert (forward > 1e3) if corrupted else (forward < 1.0), (transposed, forward)
