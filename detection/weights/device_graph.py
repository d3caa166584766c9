"""One fixed sequence of device ops, replayed as a CUDA graph (:class:`GraphedCall`).

On a GPU the guard's per-step reductions are small: a model's weights, buffers and optimizer
state read in a fraction of a millisecond. What they cost is the host issuing them, one kernel
launch per op and per tensor. On one H100, a 2.7M-parameter model's weight fingerprint (the fused
kernel: two Triton kernels per tensor, 70 launches) took 4.3 ms of host time for 0.14 ms of
device time, and the optimizer-state flag 1.2 ms for 0.13 ms (``benchmarks/cuda_launches.py``).
Those ops read the same tensors at the same addresses every step, which is what a CUDA graph
needs: captured once, the whole sequence is one launch.

:class:`GraphedCall` runs a zero-argument function that computes one device tensor. Its first
call runs it as it is (that fills every cache the function keeps: compiled kernels, offset
tables, buffers; a capture may not create them). The second, on a CUDA device, runs it once more
on a side stream, then captures it and replays the graph; every later call only replays. Each
call returns a fresh copy of the graph's output, so a result held by the caller is never
overwritten by the next replay.

Invariant: a replay computes exactly what the function would, *as long as it reads the same
tensors at the same addresses*. The owner (a fingerprint plan, the state flag) already checks
that before every call and must call :meth:`GraphedCall.reset` whenever it rebuilds. Anything
else stays eager: a function whose result is not on a CUDA device (a CPU plan, an empty list),
and one whose capture failed (logged once with the reason, never raised: the eager call still
answers). The capture is ``thread_local``: a user's thread that touches CUDA meanwhile is
not disturbed by it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

__all__ = ["GraphedCall", "graphs_enabled", "set_graphs_enabled"]

_log = logging.getLogger(__name__)


class _Switch:
    enabled = True


def set_graphs_enabled(enabled: bool) -> None:
    """Turn the capture on or off for every :class:`GraphedCall` created afterwards (on by
    default; off measures the eager path, or avoids graphs under a debugger). A call keeps the
    choice it was made with, through its resets."""
    _Switch.enabled = enabled


def graphs_enabled() -> bool:
    return _Switch.enabled


class GraphedCall:
    """``fn()`` on the first call, a replay of its CUDA graph from the second (see the module)."""

    def __init__(self, fn: Callable[[], torch.Tensor], *, what: str) -> None:
        self._fn = fn
        self._what = what
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._eager = not _Switch.enabled  # for good: captures failed or were switched off
        self._host = False  # the last build answered on the host: nothing to capture

    @property
    def captured(self) -> bool:
        """Whether calls now replay a graph."""
        return self._graph is not None

    def reset(self) -> None:
        """Forget the graph: the tensors it reads changed. The next call runs eagerly again,
        the one after captures afresh."""
        self._graph, self._out, self._calls = None, None, 0
        self._host = False

    def __call__(self) -> torch.Tensor:
        graph, out = self._graph, self._out
        if graph is not None and out is not None:
            graph.replay()
            return out.clone()
        if self._host:
            return self._fn()
        self._calls += 1
        if self._eager or self._calls < 2:
            return self._fn()
        result = self._fn()  # this call's answer, and the capture's first warm-up
        if result.device.type != "cuda":
            self._host = True  # nothing to capture (a CPU plan, an empty list) until a reset
            return result
        try:
            self._capture(result.device)
        except Exception as err:
            self._eager = True
            self._graph, self._out = None, None
            _log.warning(
                "%s: capturing a CUDA graph failed; it stays eager, one launch per op",
                self._what,
                exc_info=err,
            )
        return result

    def _capture(self, device: torch.device) -> None:
        """Warm up on a side stream, as a capture requires, then capture on it."""
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._fn()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self._fn()
            if not isinstance(out, torch.Tensor) or out.device != device:
                raise TypeError(f"the captured function returned {type(out).__name__}")
        self._graph, self._out = graph, out
