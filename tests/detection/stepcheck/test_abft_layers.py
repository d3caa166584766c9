"""The checksums beyond ``nn.Linear`` (:mod:`detection.stepcheck.abft_layers`): Embedding,
LayerNorm and
BatchNorm (the built-in model), BatchNorm1d (the plain MLP).

With them every parameter of both models is covered, clean ratios stay below their rounding
bound derived from the arithmetic (a ratio of 1, :mod:`detection.stepcheck.abft_bound`) in
float32 and bf16, and a flip that makes one gradient element *smaller* — exponent bit
29 going 1 → 0 divides it by 2^64, which no norm test can see — breaks its layer's checksum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from detection.faults.injector import flip_bit_
from detection.simulation.model import ModelConfig, TinyTransformer, make_batch
from detection.simulation.model import loss_fn as tiny_loss
from detection.simulation.workloads import PlainMLP, _mlp_batch, _mlp_loss
from detection.stepcheck.abft import LinearChecksums

Step = Callable[[nn.Module, int, bool], torch.Tensor]


def _tiny() -> tuple[nn.Module, Step]:
    cfg = ModelConfig()
    return TinyTransformer(cfg), lambda m, s, _ac: tiny_loss(m, make_batch(cfg, 0, s, 0))


def _mlp() -> tuple[nn.Module, Step]:
    return PlainMLP(), lambda m, s, _ac: _mlp_loss(m, _mlp_batch(0, s, 0, 0))


def _step(model: nn.Module, abft: LinearChecksums, loss: Step, s: int, autocast: bool) -> None:
    abft.open()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        value = loss(model, s, autocast)
    value.backward()


def _check(model: nn.Module, abft: LinearChecksums) -> torch.Tensor:
    abft.on_local_gradient([(p, p.grad) for p in model.parameters() if p.grad is not None])
    abft.close()
    return abft.ratios().view(-1, 2)


@pytest.mark.parametrize("build", [_tiny, _mlp], ids=["builtin", "mlp"])
def test_every_parameter_is_covered_and_clean_ratios_stay_small(build: Any, kernels: str) -> None:
    torch.manual_seed(0)
    model, loss = build()
    abft = LinearChecksums(model, list(model.parameters()))
    covered = {id(p) for layer in abft.layers for p, _ in layer.checked_parameters()}
    assert covered == {id(p) for p in model.parameters()}
    for autocast in (False, True):
        worst = torch.zeros(len(abft.layers), 2, dtype=torch.float64)
        for s in range(2):
            _step(model, abft, loss, s, autocast)
            worst = torch.maximum(worst, _check(model, abft))
        assert worst.max().item() < 1.0, (autocast, abft.names, worst.tolist())


@pytest.mark.parametrize(
    ("build", "module"),
    [
        (_tiny, "embed"),
        (_tiny, "pos"),
        (_tiny, "blocks.0.norm1"),  # LayerNorm
        (_tiny, "blocks.0.norm2"),  # BatchNorm over (batch, time, features)
        (_mlp, "1"),  # BatchNorm1d
        (_tiny, "blocks.0.mlp.fc"),  # Linear, weight and bias
        (_tiny, "head"),
        (_mlp, "4"),
    ],
)
def test_a_gradient_flip_that_shrinks_an_element_breaks_its_layers_checksum(
    build: Any, module: str, kernels: str
) -> None:
    torch.manual_seed(0)
    model, loss = build()
    abft = LinearChecksums(model, list(model.parameters()))
    index = abft.names.index(module)
    _step(model, abft, loss, 1, False)
    for param in model.get_submodule(module).parameters():
        grad = param.grad
        assert grad is not None
        flat = grad.view(-1)
        element = int(flat.abs().argmax())
        assert 2.0**-63 <= abs(flat[element].item()) < 2.0  # bit 29 set: the flip shrinks it
        before = flat[element].item()
        flip_bit_(flat, element, 29)
        assert abs(flat[element].item()) < abs(before) * 2.0**-60
    ratios = _check(model, abft)
    # ratios count in units of each layer's rounding bound: 10 bounds is no rounding
    assert ratios[index, 1].item() > 10.0, ratios.tolist()
    others = [i for i in range(len(abft.layers)) if i != index]
    assert ratios[others].max().item() < 1.0


def test_an_empty_batch_is_no_call_and_the_next_one_is_checked(kernels: str) -> None:
    """A forward over no rows (an empty last batch) contributes nothing to either identity: it
    notes no ratio and raises nothing (torch's ``amax`` of nothing would), and a real batch in
    the same step is still checked, gradient included."""
    torch.manual_seed(0)
    model, loss = _mlp()
    abft = LinearChecksums(model, list(model.parameters()))
    abft.open()
    model.zero_grad(set_to_none=True)
    first = model.get_submodule("0")
    assert isinstance(first, nn.Linear)
    first(torch.zeros(0, first.in_features))
    loss(model, 0, False).backward()
    ratios = _check(model, abft)
    linear = [i for i, layer in enumerate(abft.layers) if isinstance(layer.module, nn.Linear)]
    assert (ratios[:, 1] > 0).all(), ratios.tolist()  # every gradient checked
    assert (ratios[linear, 0] > 0).all(), ratios.tolist()  # every Linear's forward too
    assert ratios.max().item() < 1.0


def test_a_rotation_checks_each_layer_on_its_turn_exactly_as_full_coverage(kernels: str) -> None:
    """``every=3``: on step ``s`` the layers with ``index % 3 == s % 3`` report the ratios full
    coverage reports for them, the others 0; over three steps every layer is checked once."""
    torch.manual_seed(0)
    model, loss = _tiny()
    params = list(model.parameters())
    full, rotation = LinearChecksums(model, params), LinearChecksums(model, params, every=3)
    seen = set()
    for s in range(3):
        full.open(s)
        rotation.open(s)
        assert rotation.checked() == [n for i, n in enumerate(full.names) if i % 3 == s]
        model.zero_grad(set_to_none=True)
        loss(model, s, False).backward()
        pairs = [(p, p.grad) for p in params if p.grad is not None]
        for abft in (full, rotation):
            abft.on_local_gradient(pairs)
            abft.close()
        want, got = full.ratios().view(-1, 2), rotation.ratios().view(-1, 2)
        turn = torch.tensor([i % 3 == s for i in range(len(full.names))])
        assert torch.count_nonzero(got[~turn]) == 0
        torch.testing.assert_close(got[turn], want[turn], rtol=1e-6, atol=0.0)
        seen.update(rotation.checked())
    assert seen == set(full.names)
