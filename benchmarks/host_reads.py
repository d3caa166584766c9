"""Where a loop would block the host on a GPU, counted on the CPU (:class:`HostReads`).

A guarded step may synchronise the host with the device once: the read-back of the
all-gathered decision row. Every further synchronisation stalls the launch queue in the middle
of a step. The profiler counts them on a GPU (``benchmarks/cuda_syncs.py``); this mode counts
the torch calls that cause them on any machine, so the budget is held by the tests where no GPU
is at hand. It sees three kinds:

* **read-backs** of a tensor not already on the host (``.item()``, ``.tolist()``, ``.cpu()``,
  ``bool(t)``, …). On the CPU every tensor stands in for a device tensor, so the mode taints
  what a read-back returned (and what is computed from it) as host-side: work on a copy already
  made is not counted twice;
* **host-to-device copies** from Python data (``torch.tensor(..., device=...)``), which are
  blocking copies on CUDA;
* **operators that synchronise inside**: their output size, or a check of their arguments,
  depends on device values (``nonzero``, boolean indexing, ``segment_reduce`` unless called
  with ``unsafe=True``, …). These are invisible in Python code and in any CPU timing.

It watches at two levels, because neither sees everything: Python-level calls (``tolist``,
``cpu``, ``numpy`` of a CPU tensor never reach the dispatcher) through a
:class:`~torch.overrides.TorchFunctionMode`, and operators through a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`, which also reaches the code that runs
inside backward (DDP's comm hook, tensor hooks) where the function mode is not in force. Scalar
read-backs (``item``, ``bool``, ``float``) are counted once, as the operator they dispatch to.

It cannot see a copy of a host tensor to a device (``.to(device)`` of a CPU tensor): on the
CPU both sides are the same device. Nor ``.tolist()``/``.cpu()`` called inside backward: those
never reach the dispatcher on a CPU tensor, and the function mode is not in force there (scalar
read-backs and the operators above are seen). The profiler on a GPU remains the measurement.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

# Python-level read-backs that never reach the dispatcher on a CPU tensor.
_READ_BACK = frozenset({"tolist", "cpu", "numpy"})
_FROM_HOST = frozenset({"tensor", "as_tensor"})
# Operators whose result's size, or whose argument check, needs device values on the host.
_SYNC_INSIDE = frozenset(
    {
        "nonzero",
        "argwhere",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",
        "equal",
        "is_nonzero",
    }
)


def _op_name(func: Any) -> str:
    """``aten.segment_reduce.default`` -> ``segment_reduce``."""
    packet = getattr(func, "overloadpacket", None)
    return str(getattr(packet, "__name__", getattr(func, "__name__", func))).split(".")[-1]


def _syncs_inside(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in _SYNC_INSIDE:
        return True
    if name == "segment_reduce":  # validates the lengths on the host unless unsafe
        return not kwargs.get("unsafe", False)
    if name == "repeat_interleave":  # tensor repeats: the output size, unless told
        return kwargs.get("output_size") is None and any(
            isinstance(a, torch.Tensor) and a.dtype != torch.bool for a in args
        )
    if name in ("index", "index_put", "index_put_"):  # boolean masks among the indices
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class HostReads:
    """Counts, by kind, the torch calls made under it that would block the host on a device.

    Use as a context manager. ``counts`` keys read ``"read back (item)"``,
    ``"host to device (tensor)"`` or ``"synchronises inside (segment_reduce)"``. ``host`` holds
    the tensors already on the host side of a read-back (and what is computed from them),
    weakly, by id."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._modes: list[Any] = []

    def __enter__(self) -> HostReads:
        self._modes = [_FunctionSide(self), _DispatchSide(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def on_host(self, tensors: list[torch.Tensor]) -> bool:
        return any(self.host.get(id(t)) is t for t in tensors)

    def mark(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = t


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


class _FunctionSide(TorchFunctionMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = _tensors(args, kwargs)
        on_host = self.reads.on_host(tensors)
        out = func(*args, **kwargs)
        if name in _READ_BACK and tensors and not on_host:
            self.reads.counts[f"read back ({name})"] += 1
            on_host = True
            if any(out is t for t in tensors):  # ``.cpu()`` of a CPU tensor is the tensor:
                out = out.view_as(out)  # a copy on a GPU, so only the alias counts as host
        elif name in _FROM_HOST and kwargs.get("device") is not None:
            self.reads.counts[f"host to device ({name})"] += 1
        if on_host:
            self.reads.mark(out)
        return out


class _DispatchSide(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        on_host = self.reads.on_host(_tensors(args, kwargs))
        if not on_host:
            if name == "_local_scalar_dense":
                self.reads.counts["read back (item)"] += 1
            elif _syncs_inside(name, tuple(args), kwargs):
                self.reads.counts[f"synchronises inside ({name})"] += 1
        out = func(*args, **kwargs)
        if on_host:
            self.reads.mark(out)
        return out
