"""Fault specs (DESIGN syntax) and where each fault kind lands, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from detection.faults.injector import FaultInjector, flip_bit_
from detection.faults.spec import (
    Computation,
    FaultInjectionError,
    FaultKind,
    FaultSpec,
    FaultSpecError,
    element_index,
)


def test_one_shot_spec_defaults_to_bit_30() -> None:
    spec = FaultSpec.parse("grad-flip@2:37")
    assert (spec.kind, spec.rank, spec.step, spec.bit, spec.node) == (
        FaultKind.GRAD_FLIP,
        2,
        37,
        30,
        None,
    )
    assert not spec.persistent
    assert FaultSpec.parse("weight-flip@0:5:3").bit == 3


def test_persistent_spec_defaults_to_step_0() -> None:
    spec = FaultSpec.parse("act-flip@node=node-2")
    assert (spec.node, spec.step, spec.rank, spec.persistent) == ("node-2", 0, None, True)
    assert FaultSpec.parse("reduced-flip@node=ip-10-0-0-1.ec2:from=12").step == 12


def test_act_flip_takes_a_module_suffix() -> None:
    assert FaultSpec.parse("act-flip@1:4/blocks.0.mlp.fc").module == "blocks.0.mlp.fc"
    assert FaultSpec.parse("act-flip@node=n1:from=2/head").module == "head"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("grad-flip", "expected KIND@"),
        ("bit-flip@1:2", "unknown kind"),
        ("grad-flip@1", "neither"),
        ("grad-flip@x:2", "neither"),
        ("grad-flip@-1:2", "neither"),
        ("grad-flip@1:2:32", "0..31"),
        ("grad-flip@1:2:3:4", "neither"),
        ("grad-flip@node=", "neither"),
        ("grad-flip@node=n1:to=3", "neither"),
        ("weight-flip@1:2/head", "only act-flip"),
        ("act-flip@1:2/", "qualified name"),
        ("act-flip@1:2:in=elsewhere", "names no computation"),
        ("weight-flip@1:2:in=recompute", "runs no weight-flip"),
        ("reduced-flip@1:2:30:in=recompute", "runs no reduced-flip"),
        ("act-flip@node=n1:in=recompute", "neither"),
    ],
)
def test_malformed_specs_are_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(FaultSpecError, match=says) as caught:
        FaultSpec.parse(text)
    assert repr(text) in str(caught.value)


def test_transient_faults_skip_replays_and_persistent_ones_follow_the_node() -> None:
    one = FaultSpec.parse("grad-flip@2:5")
    assert one.applies(rank=2, node="n", step=5, replay=False)
    assert not one.applies(rank=2, node="n", step=5, replay=True)
    assert not one.applies(rank=1, node="n", step=5, replay=False)
    assert not one.applies(rank=2, node="n", step=6, replay=False)
    node = FaultSpec.parse("grad-flip@node=n1:from=3")
    assert node.applies(rank=0, node="n1", step=3, replay=True)
    assert node.applies(rank=7, node="n1", step=99, replay=False)
    assert not node.applies(rank=0, node="n1", step=2, replay=False)
    assert not node.applies(rank=0, node="n2", step=5, replay=False)


def test_a_transient_fault_in_a_recomputation_spares_the_rank_s_own_step() -> None:
    spec = FaultSpec.parse("act-flip@0:10:in=recompute")
    assert (spec.rank, spec.step, spec.bit, spec.computation) == (0, 10, 30, Computation.RECOMPUTE)
    assert spec.applies(rank=0, node="n", step=10, replay=True)
    assert not spec.applies(rank=0, node="n", step=10, replay=False)
    assert not spec.applies(rank=1, node="n", step=10, replay=True)
    assert not spec.applies(rank=0, node="n", step=11, replay=True)
    assert str(spec) == "act-flip@0:10:30:in=recompute"
    assert FaultSpec.parse(str(spec)) == spec
    gradient = FaultSpec.parse("grad-flip@2:5:27:in=recompute")
    assert (gradient.bit, gradient.computation) == (27, Computation.RECOMPUTE)
    assert FaultSpec.parse("act-flip@3:4:in=own") == FaultSpec.parse("act-flip@3:4")
    assert FaultSpec.parse("act-flip@1:4:in=recompute/head").module == "head"


def test_element_index_is_deterministic_and_in_range() -> None:
    assert element_index(0, 10) == 0
    assert element_index(3, 100) == (3 * 7919) % 100
    assert all(0 <= element_index(s, 17) < 17 for s in range(50))
    with pytest.raises(FaultInjectionError):
        element_index(1, 0)


def test_flip_bit_30_keeps_the_float32_position_across_widths() -> None:
    x32 = torch.tensor([0.5, 0.25])
    flip_bit_(x32, 1, 30)
    assert x32[0] == 0.5
    assert x32[1] == 0.25 * 2.0**128
    x64 = torch.tensor([0.5], dtype=torch.float64)
    flip_bit_(x64, 0, 30)  # bit 62: the top exponent bit of float64
    half = int(torch.tensor([0.5], dtype=torch.float64).view(torch.int64).item())
    assert int(x64.view(torch.int64).item()) == half ^ (1 << 62)
    bf = torch.tensor([0.5], dtype=torch.bfloat16)
    flip_bit_(bf, 0, 31)  # the sign bit
    assert bf.item() == -0.5
    with pytest.raises(FaultInjectionError, match="no counterpart"):
        flip_bit_(torch.tensor([1.0], dtype=torch.float16), 0, 3)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mid = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.mid(self.first(x)))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _outputs(net: nn.Module, injector: FaultInjector, step: int) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda _m, _i, o, n=n: seen.__setitem__(n, o.detach()))
        for n, m in net.named_modules()
        if n
    ]
    injector.begin_step(step)
    net(torch.ones(3, 4))
    injector.end_step()
    for h in hooks:
        h.remove()
    return seen


def test_act_flip_defaults_to_the_last_linear_and_flips_one_element() -> None:
    clean = _outputs(_net(), FaultInjector([], rank=0, node="n"), 2)
    net = _net()
    injector = FaultInjector([FaultSpec.parse("act-flip@0:2")], rank=0, node="n")
    injector.bind(net)
    faulty = _outputs(net, injector, 2)
    assert torch.equal(faulty["mid"], clean["mid"])
    diff = (faulty["last"] != clean["last"]).flatten().nonzero().flatten().tolist()
    assert diff == [element_index(2, clean["last"].numel())]
    assert torch.equal(_outputs(net, injector, 3)["last"], _net()(torch.ones(3, 4)).detach())


def test_act_flip_module_suffix_names_another_submodule() -> None:
    clean = _outputs(_net(), FaultInjector([], rank=0, node="n"), 1)
    net = _net()
    injector = FaultInjector([FaultSpec.parse("act-flip@0:1/mid.0")], rank=0, node="n")
    injector.bind(net)
    faulty = _outputs(net, injector, 1)
    assert torch.equal(faulty["first"], clean["first"])
    assert not torch.equal(faulty["mid.0"], clean["mid.0"])
    with pytest.raises(FaultInjectionError, match="no submodule 'nope'"):
        FaultInjector([FaultSpec.parse("act-flip@0:1/nope")], rank=0, node="n").bind(_net())


def test_weight_and_optimizer_state_flips_hit_one_element_after_the_step() -> None:
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in net.parameters()]
    state_before = [
        t.clone() for p in net.parameters() for k, t in sorted(opt.state[p].items()) if k != "step"
    ]
    injector = FaultInjector(
        [FaultSpec.parse("weight-flip@1:3"), FaultSpec.parse("optim-flip@1:3")], rank=1, node="n"
    )
    injector.bind(net)
    injector.begin_step(3)
    injector.after_optimizer_step(opt)
    changed = sum(int((a != b).sum()) for a, b in zip(before, net.parameters(), strict=True))
    state_after = [
        t for p in net.parameters() for k, t in sorted(opt.state[p].items()) if k != "step"
    ]
    changed_state = sum(int((a != b).sum()) for a, b in zip(state_before, state_after, strict=True))
    assert (changed, changed_state) == (1, 1)
    assert [s for s, _, _ in injector.injected] == [3, 3]


def test_gradient_faults_hit_the_documented_element_and_nan_is_nan() -> None:
    net = _net()
    grads = [torch.zeros_like(p) for p in net.parameters()]
    total = sum(g.numel() for g in grads)
    injector = FaultInjector([FaultSpec.parse("grad-nan@0:4")], rank=0, node="n")
    injector.bind(net)
    injector.begin_step(4)
    injector.on_local_gradient(list(enumerate(grads)))
    flat = torch.cat([g.flatten() for g in grads])
    assert flat.isnan().nonzero().flatten().tolist() == [element_index(4, total)]
    with injector.recomputing():  # a transient fault does not strike a replay
        before = torch.cat([g.flatten() for g in grads]).clone()
        injector.on_local_gradient(list(enumerate(grads)))
        assert torch.equal(torch.cat([g.flatten() for g in grads]).isnan(), before.isnan())


def test_a_recomputation_fault_strikes_the_replay_and_not_the_own_step() -> None:
    net = _net()
    injector = FaultInjector([FaultSpec.parse("act-flip@0:2:in=recompute")], rank=0, node="n")
    injector.bind(net)
    x = torch.randn(3, 4)
    clean = net(x)
    injector.begin_step(2)
    assert not injector.any_active()  # the rank's own step is clean
    assert torch.equal(net(x), clean)
    with injector.recomputing():
        assert not torch.equal(net(x), clean)
    injector.end_step()
    assert injector.injected == [(2, "act-flip@0:2:30:in=recompute", True)]
