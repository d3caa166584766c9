"""Replay mode: the guard inside the user's own job recomputes the suspect steps and traces them.

A diagnostic replay runs the user's job template (image, command, env, volumes) pinned to one
node; the control plane sets ``SDCGUARD_RESUME_FROM`` (the checkpoint the job loads, as on any
resume) and the ``SDCGUARD_REPLAY_*`` variables below. The user's script needs no change: the
guard sees the variables and

- fingerprints every step's local gradients (before the all-reduce) and gathers every rank's
  loss and gradient fingerprint, with rank 0's weight fingerprint after the step;
- at ``SDCGUARD_REPLAY_PROBE_STEP``, fingerprints every submodule's forward output and input
  gradient (the per-submodule probe);
- sends no alarm and records no checkpoint (a replay on a suspect node must not open a new
  incident nor overwrite the job's checkpoints);
- after ``SDCGUARD_REPLAY_END`` prints the trace and probe between marker lines on stdout —
  the pod log is how the results come back — and ends the process (:class:`TraceFinished`,
  a ``SystemExit(0)``), so the script's own loop length does not matter; the process exits
  with status 0 once the script has unwound, before the interpreter's teardown.

Invariant: the trace holds exactly the steps ``SDCGUARD_REPLAY_START..SDCGUARD_REPLAY_END``
the job ran, one line each, in the format of ``sdcguard train --trace``. The module imports
torch only when replay mode is on, so the control plane may import the marker constants.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "END",
    "PROBE_BEGIN",
    "REPLAY_END_ENV",
    "REPLAY_PROBE_STEP_ENV",
    "REPLAY_START_ENV",
    "TRACE_BEGIN",
    "TraceFinished",
    "TraceMode",
]

TRACE_BEGIN = "=== sdcguard replay trace ==="
PROBE_BEGIN = "=== sdcguard replay probe ==="
END = "=== sdcguard replay end ==="

REPLAY_START_ENV = "SDCGUARD_REPLAY_START"
REPLAY_END_ENV = "SDCGUARD_REPLAY_END"
REPLAY_PROBE_STEP_ENV = "SDCGUARD_REPLAY_PROBE_STEP"


class TraceFinished(SystemExit):
    """The replay reached its last step: the process ends with status 0.

    The script's ``finally`` blocks still run as the exception unwinds; the interpreter's
    teardown does not (:func:`_end_now`)."""

    def __init__(self) -> None:
        super().__init__(0)


def _end_now() -> None:
    """End a finished replay before the interpreter tears itself down.

    The trace is out and every collective is done: nothing is left for the process to do. Its
    teardown is where a native thread of the job's libraries can abort it ("terminate called
    without an active exception", status 134 — seen on a replay pod after its trace); that turns
    a finished replay into a failed pod and its evidence into "inconclusive". So the streams
    and log handlers are flushed and the process exits with status 0 at once.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):  # a stream the script closed or lost
            stream.flush()
    logging.shutdown()
    os._exit(0)


@dataclass
class TraceMode:
    """The replay settings of one rank, and the trace it gathers (rank 0 keeps it)."""

    start: int
    end: int
    probe_step: int | None
    rank: int
    lines: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    _probe_hooks: Any = None

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> TraceMode | None:
        """Replay mode when ``SDCGUARD_REPLAY_END`` is set, else None (a normal run)."""
        environ: Mapping[str, str] = os.environ if env is None else env
        end = environ.get(REPLAY_END_ENV)
        if not end:
            return None
        probe = environ.get(REPLAY_PROBE_STEP_ENV)
        return cls(
            start=int(environ.get(REPLAY_START_ENV) or 0),
            end=int(end),
            probe_step=int(probe) if probe else None,
            rank=rank,
        )

    # -- the guard's hooks ----------------------------------------------------------------------
    def begin_step(self, step: int, module: nn.Module) -> None:
        if step == self.probe_step:
            self._probe_hooks = _Probe(module)

    def after_step(
        self,
        step: int,
        loss: torch.Tensor,
        grad_fingerprint: torch.Tensor,
        weight_fingerprint: str,
        group: Any,
        out: TextIO | None = None,
    ) -> None:
        """Gather this step's trace line (collective); after the last step, print and finish."""
        import torch

        from detection.row.gather import all_gather_rows
        from detection.weights.fingerprint import to_fingerprint

        row = torch.cat(
            [
                loss.detach().reshape(1).to(torch.float64).view(torch.int64),
                grad_fingerprint.to(loss.device),
            ]
        )
        rows = all_gather_rows(row, group)
        if step >= self.start:
            losses = [
                torch.tensor([r[0]], dtype=torch.int64).view(torch.float64).item() for r in rows
            ]
            self.lines.append(
                {
                    "step": step,
                    "losses": losses,
                    "grad_fingerprints": [to_fingerprint(r[1], r[2]).hex() for r in rows],
                    "weight_fingerprint": weight_fingerprint,
                }
            )
        if self._probe_hooks is not None and step == self.probe_step:
            self.probe = self._probe_hooks.gather(step, group)
            self._probe_hooks.close()
            self._probe_hooks = None
        if step >= self.end:
            if self.rank == 0:
                self.print(out or sys.stdout)
            atexit.register(_end_now)  # registered last, so it runs first of the atexit handlers
            raise TraceFinished()

    def print(self, out: TextIO) -> None:
        """The trace (and probe) between the marker lines the control plane looks for."""
        out.write(f"\n{TRACE_BEGIN}\n")
        for line in self.lines:
            out.write(json.dumps(line) + "\n")
        if self.probe is not None:
            out.write(f"{PROBE_BEGIN}\n{json.dumps(self.probe)}\n")
        out.write(f"{END}\n")
        out.flush()


class _Probe:
    """Per-submodule fingerprints of forward outputs and input gradients at one step (first call
    per module wins, so an audit's re-execution later in the step is ignored)."""

    def __init__(self, module: nn.Module) -> None:
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.forward: dict[str, str] = {}
        self.backward: dict[str, str] = {}
        self.order: list[str] = []
        self.kinds: dict[str, str] = {}
        self._handles: list[Any] = []
        for name, sub in module.named_modules():
            if not name:
                continue
            self.kinds[name] = type(sub).__name__
            self._handles.append(sub.register_forward_hook(self._hook(name, self.forward, True)))
            self._handles.append(
                sub.register_full_backward_hook(self._hook(name, self.backward, False))
            )

    def _hook(self, name: str, into: dict[str, str], forward: bool) -> Any:
        def hook(_m: Any, first: Any, second: Any) -> None:
            values = second if forward else first  # forward: output; backward: grad_input
            if name in into:
                return
            value = _hex(values)
            if value is not None:
                into[name] = value
                if forward:
                    self.order.append(name)

        return hook

    def gather(self, step: int, group: Any) -> dict[str, Any]:
        import torch.distributed as dist

        mine = {"forward": self.forward, "backward": self.backward}
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        return {
            "step": step,
            "ranks": {str(r): v for r, v in enumerate(everyone)},
            "order": self.order,
            "kinds": self.kinds,
        }

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _hex(values: Any) -> str | None:
    import torch

    from detection.weights.fingerprint import weight_fingerprint

    items = values if isinstance(values, tuple | list) else (values,)
    tensors = [t.detach() for t in items if isinstance(t, torch.Tensor)]
    return weight_fingerprint(tensors).hex() if tensors else None
