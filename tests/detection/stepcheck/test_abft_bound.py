"""The checksums' tolerance derived from the arithmetic (:mod:`detection.stepcheck.abft_bound`):
its value per dtype, the unit of the inputs' rounding under autocast, TF32 and
``float32_matmul_precision``, and clean layers that stay under it — heavy-tailed values,
cancellation, long reductions, fp32 and bf16 — while a raising flip of bit 27 or above goes over
it on the first step."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from detection.faults.injector import flip_bit_
from detection.stepcheck.abft import LinearChecksums
from detection.stepcheck.abft_bound import U32, compute_unit, tolerance

BF16 = 2.0**-8


def test_the_tolerance_per_dtype() -> None:
    # float32 Linear, K = N = 32: worst case (5 + 128)·u32, over u32·√32
    assert tolerance(32, 32, U32, 0.0) == pytest.approx(
        (5 * U32 + 4 * 32 * U32 / (1 - 32 * U32)) / (U32 * math.sqrt(32)), rel=1e-9
    )
    assert tolerance(32, 32, U32, 0.0) == pytest.approx(23.5, abs=0.1)
    # bf16 autocast: the bf16 roundings dominate
    assert tolerance(32, 32, BF16, BF16) == pytest.approx(0.884, abs=1e-3)
    # long reductions: the probabilistic bound (λ = 10) takes over from the worst case
    long = tolerance(1 << 20, 1 << 12, U32, 0.0)
    assert long == pytest.approx(
        (5 * U32 + 10 * (2 * 1024 + 2 * 64) * U32) / (U32 * 1024), rel=1e-9
    )


@pytest.fixture
def precision() -> Iterator[None]:
    was, tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    yield
    torch.set_float32_matmul_precision(was)
    torch.backends.cuda.matmul.allow_tf32 = tf32


def test_the_unit_of_the_inputs_rounding(precision: None) -> None:
    assert compute_unit("cpu", torch.float32) == 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_unit("cpu", torch.float32) == BF16
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert compute_unit("cuda", torch.float32) == 0.0
    torch.backends.cuda.matmul.allow_tf32 = True
    assert compute_unit("cuda", torch.float32) == 2.0**-11  # TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("high")
    assert compute_unit("cuda", torch.float32) == 2.0**-11
    torch.set_float32_matmul_precision("medium")
    assert compute_unit("cuda", torch.float32) == BF16
    assert compute_unit("cuda", torch.bfloat16) == BF16  # split-K may reduce in bf16
    assert compute_unit("cpu", torch.bfloat16) == 0.0


def _ratios(model: nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    abft = LinearChecksums(model, list(model.parameters()))
    abft.open()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    abft.on_local_gradient([(p, p.grad) for p in model.parameters() if p.grad is not None])
    abft.close()
    ratios = abft.ratios().view(-1, 2)
    abft.close_hooks()
    return ratios


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [7, 512, 4096])
def test_clean_layers_stay_under_the_bound_from_the_first_step(autocast: bool, k: int) -> None:
    """Heavy-tailed inputs (log-normal magnitudes over 8 decades), half of them cancelling:
    the first step's ratios, with nothing learnt, stay at most 1 (the bound)."""
    g = torch.Generator().manual_seed(k)
    model = nn.Sequential(nn.Linear(k, 64), nn.LayerNorm(64), nn.Linear(64, 16))
    x = torch.randn(96, k, generator=g) * torch.exp(3 * torch.randn(96, k, generator=g))
    x[:, 1::2] = -x[:, 0:-1:2] * (1 + 1e-3 * torch.randn(96, k // 2, generator=g))
    ratios = _ratios(model, x, autocast)
    assert (ratios > 0).any()
    assert ratios.max().item() <= 1.0, ratios.tolist()


def test_a_raising_high_bit_flip_of_an_output_goes_over_the_bound_on_the_first_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(64, 256)
    element: dict[str, int] = {}
    for bit in (27, 28, 29, 30):

        def flip(_m: nn.Module, _i: object, out: torch.Tensor, bit: int = bit) -> None:
            flat = out.detach().view(-1)
            # an element whose bit is 0: the flip multiplies it by 2^(2^(bit-23))
            candidates = (flat.view(torch.int32) >> bit) & 1
            element["i"] = i = int(torch.nonzero(candidates == 0)[0])
            flip_bit_(flat, i, bit)

        handle = model[0].register_forward_hook(flip)
        ratios = _ratios(model, x, False)
        handle.remove()
        assert ratios[0, 0].item() > 1.0, (bit, element, ratios.tolist())
