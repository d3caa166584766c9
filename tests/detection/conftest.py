"""Detection test helpers: real rank processes in a real gloo group on 127.0.0.1.

Ranks are forked from a forkserver with torch preloaded, so a multi-process test pays the
torch import once per test session, not once per rank per test. A rank function must be a
module-level function (it is sent by reference) taking ``(rank, world_size, *args)``; what it
returns comes back pickled, in rank order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from detection import native
from detection.harness import TrainConfig, run
from detection.simulation.workloads import launch


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results."""
    return launch(fn, world_size, *args, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def clean_reference() -> dict[str, Any]:
    """A short clean 4-rank job every fault test compares its final fingerprint against."""
    return run(TrainConfig(world_size=4, steps=10, audit_every=4, seed=3))


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """A test both ways: :mod:`detection.native`'s C kernels (a CPU with a compiler, the
    default), and torch's ops (a GPU, a host without a C compiler, ``SDCGUARD_NATIVE=0``)."""
    was = native.is_enabled()
    native.set_enabled(request.param == "native")
    if request.param == "native":
        assert native.available(), native.unavailable_reason()
    yield request.param
    native.set_enabled(was)
