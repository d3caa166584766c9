"""The per-step reductions replayed as CUDA graphs (``detection.weights.device_graph``).

The CPU tests run everywhere: there nothing is captured and every call is the function's own.
The others need a GPU (``make bench-cuda`` machines run them): they show that a replay answers
what the eager ops would after the tensors changed in place, that a rebuild recaptures, that a
replay is one launch, and that a capture which cannot work leaves the call eager and correct.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from detection.weights import device_graph
from detection.weights import fingerprint_kernels as fk
from detection.weights.device_graph import GraphedCall
from detection.weights.fingerprint import fingerprint_from_tensor
from detection.weights.fingerprint_kernels import Kernel
from detection.weights.optstate import StateFlag
from detection.weights.plan import FingerprintPlan
from tests.detection.weights.test_fingerprint import SIGNED_VIEW, random_bits, reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    kernel, enabled = fk.get_kernel(), device_graph.graphs_enabled()
    yield
    fk.set_kernel(kernel)
    device_graph.set_graphs_enabled(enabled)


def test_on_the_cpu_every_call_is_the_functions_own_and_nothing_is_captured() -> None:
    calls = []
    x = torch.arange(4.0)

    def total() -> torch.Tensor:
        calls.append(1)
        return x.sum().reshape(1)

    graphed = GraphedCall(total, what="test")
    first = graphed()
    x.add_(1.0)
    assert [graphed().item() for _ in range(3)] == [10.0, 10.0, 10.0]
    assert first.item() == 6.0
    assert len(calls) == 4
    assert not graphed.captured


def test_a_cpu_plan_and_flag_still_answer_through_the_wrapper() -> None:
    """Each call reads the tensors as they are now: the wrapper keeps no result on a CPU."""
    fk.set_kernel(Kernel.EAGER)
    layer = nn.Linear(6, 4)
    optimizer = torch.optim.Adam(layer.parameters())
    plan = FingerprintPlan(layer.parameters())
    flag = StateFlag(optimizer, list(layer.parameters()), torch.device("cpu"))
    for _ in range(3):
        layer(torch.randn(5, 6)).sum().backward()
        optimizer.step()
        assert fingerprint_from_tensor(plan()) == reference(list(layer.parameters()))
        assert flag().tolist() == [0]
    optimizer.state[layer.bias]["exp_avg_sq"][1] = math.inf
    assert flag().tolist() == [1]
    assert not plan._graphed.captured
    assert not flag._graphed.captured


def _cuda_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).cuda()


def _launches(fn: object) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    names = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    return {e.key: e.count for e in prof.key_averages() if e.key in names}


@cuda
@pytest.mark.parametrize("kernel", [Kernel.EAGER, Kernel.FUSED], ids=["table", "fused"])
def test_a_replayed_plan_follows_in_place_updates_and_keeps_earlier_results(
    kernel: Kernel,
) -> None:
    fk.set_kernel(kernel)
    gen = torch.Generator().manual_seed(3)
    # a plan takes the table up to 65,536 words whatever the kernel: the fused list is longer
    width = 33 if kernel is Kernel.EAGER else 300
    tensors = [
        random_bits((257, width), torch.float32, gen).cuda(),
        random_bits((101,), torch.bfloat16, gen).cuda(),
        random_bits((5,), torch.int64, gen).cuda(),
    ]
    plan = FingerprintPlan(tensors, start=7)
    offsets = [7, 7 + 257 * width, 7 + 257 * width + 101]
    results = []
    for step in range(4):
        results.append(plan())
        assert (plan._words is None) is (kernel is Kernel.FUSED)  # the path the id names
        assert fingerprint_from_tensor(results[-1]) == reference(
            [t.cpu() for t in tensors], offsets
        )
        # in place (the graph reads the same address), one word up by one: always a new value
        bump = tensors[step % 3].view(-1)
        words = bump.view(SIGNED_VIEW[bump.element_size()])
        words[step] += 1
    assert plan._graphed.captured
    # every earlier answer is its own tensor, not the graph's output overwritten since
    assert len({fingerprint_from_tensor(r) for r in results}) == 4
    launches = _launches(plan)
    assert launches.get("cudaGraphLaunch") == 1
    assert sum(n for k, n in launches.items() if k != "cudaGraphLaunch") <= 1  # the copy out


@cuda
def test_a_plan_whose_tensor_moved_recaptures_over_the_new_address() -> None:
    fk.set_kernel(Kernel.EAGER)
    model = _cuda_model()
    plan = FingerprintPlan(model.parameters())
    for _ in range(3):
        plan()
    assert plan._graphed.captured
    model[0].bias.data = torch.randn(32, device="cuda")  # a new storage
    for _ in range(3):
        got = fingerprint_from_tensor(plan())
        assert got == reference([p.detach().cpu() for p in model.parameters()])
    assert plan._graphed.captured


@cuda
def test_the_replayed_state_flag_sees_a_non_finite_value_written_in_place() -> None:
    model = _cuda_model()
    optimizer = torch.optim.Adam(model.parameters())
    params = list(model.parameters())
    flag = StateFlag(optimizer, params, torch.device("cuda", torch.cuda.current_device()))
    for _ in range(3):
        model(torch.randn(8, 16, device="cuda")).sum().backward()
        optimizer.step()
        assert flag().tolist() == [0]
    assert flag._graphed.captured
    optimizer.state[params[2]]["exp_avg_sq"][3] = math.inf
    assert flag().tolist() == [1]
    optimizer.state[params[2]]["exp_avg_sq"][3] = 0.0
    assert flag().tolist() == [0]
    optimizer.state[params[0]]["exp_avg"] = torch.full_like(params[0], math.nan)  # swapped in
    assert flag().tolist() == [1]


@cuda
def test_a_capture_that_cannot_work_is_logged_and_the_call_stays_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = torch.ones(4, device="cuda")

    def synchronising() -> torch.Tensor:
        total = x.sum()
        return torch.full((1,), total.item(), device="cuda")  # a host read: not capturable

    graphed = GraphedCall(synchronising, what="test call")
    with caplog.at_level(logging.WARNING, logger="detection.weights.device_graph"):
        assert [graphed().item() for _ in range(3)] == [4.0, 4.0, 4.0]
        x.add_(1.0)
        assert graphed().item() == 8.0
    assert not graphed.captured
    assert "test call: capturing a CUDA graph failed" in caplog.text
    assert torch.ones(1, device="cuda").item() == 1.0  # the device is still usable


@cuda
def test_switched_off_nothing_is_captured() -> None:
    device_graph.set_graphs_enabled(False)
    x = torch.ones(3, device="cuda")
    graphed = GraphedCall(lambda: x.sum().reshape(1), what="test")
    assert [graphed().item() for _ in range(3)] == [3.0, 3.0, 3.0]
    assert not graphed.captured
