"""Persistent buffers (BatchNorm running statistics, counters) under the fingerprint.

Buffers are part of what a checkpoint holds, yet replicas' buffers are *not* equal at the end of
a step the way weights are: each rank's forward pass updates BatchNorm running statistics from
its own micro-batch, and DDP (``broadcast_buffers=True``, the default) overwrites every replica's
buffers with the authoritative rank's (rank 0) at the start of the next forward. A vote on
end-of-step buffers would alarm on every step; no vote at all let a flipped running statistic on
rank 0 spread to every replica and into a ``verified`` checkpoint. So the buffers are checked
where an invariant holds, each with a device fingerprint and no host synchronisation:

* **after the last forward → end of the step** (every rank): nothing but a forward pass may
  change a persistent buffer, so the fingerprint taken after the step's last forward must equal
  the one at the end of the step; a difference names that rank, at that step. Activation
  checkpointing (``torch.utils.checkpoint``) runs a block's forward again inside the backward,
  and a BatchNorm there updates its running statistics a second time: when a module owning
  buffers ran its forward outside the model's (:meth:`BufferWatch.owner_ran`), the reference is
  taken again at the end of the step's last backward (:meth:`BufferWatch.after_backward`), so
  the check still covers the optimizer's part of the step.
* **end of the previous step → this step's first forward**: the buffers the forward starts
  from are what the source left — rank 0's, broadcast by DDP, or (``broadcast_buffers=False``)
  the rank's own. The source rank checks that its buffers did not change in between.
* **right after DDP's broadcast** every replica holds the same buffers: a vote among them.

The end-of-step buffer fingerprint of rank 0 (the rank DDP broadcasts from and whose buffers a
checkpoint written by rank 0 holds) is added to the weight fingerprint for the checkpoint
record: buffers sit after the parameters in one global numbering, so the sum of the two is the
fingerprint of ``parameters + persistent buffers`` that
:func:`detection.weights.load_check.verify_after_load`
checks after a load. A forward pass outside a guarded step (an evaluation pass, a BatchNorm
recalibration, of the whole model or of one submodule owning buffers) or a checkpoint load
legitimately changes buffers between steps: it clears the previous-step reference, so the next
step checks nothing across that gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from detection.row.words import on_host, wrap64
from detection.weights.fingerprint import to_fingerprint
from detection.weights.plan import FingerprintPlan
from detection.weights.state import persistent_buffers
from detection.weights.vote import majority_vote

__all__ = ["BUFFER_ROW", "BufferWatch", "buffer_finding", "buffer_owners"]

# Row layout of a rank's buffer evidence, int64 pairs (a, b): the fingerprint right after DDP's
# broadcast, the rank's own end-of-step fingerprint, (after the last forward) - (end of step),
# and (end of the previous step) - (after the broadcast). A difference is non-zero exactly when
# the buffers changed: plain subtractions, the cheapest device ops there are.
BUFFER_ROW = 8

# A fingerprint as the step took it: two host ints on a CPU job's host path, a device tensor
# of 2 otherwise (a job keeps to one path; either is read as the other where it is not).
_Print = torch.Tensor | list[int]


def _words(fp: _Print) -> list[int]:
    return fp if isinstance(fp, list) else fp.tolist()


class BufferWatch:
    """The three buffer fingerprints of one rank's step (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        start: int,
        broadcast: bool,
        rank: int,
        device: torch.device,
    ) -> None:
        self.buffers = persistent_buffers(module)
        # buffers are numbered after the parameters (``start``): one global numbering
        self._plan = FingerprintPlan(self.buffers, start=start)
        self._broadcast = broadcast
        self._source = not broadcast or rank == 0
        self._device = device
        self._at_broadcast: _Print | None = None
        self._after_forward: _Print | None = None
        self._previous_end: _Print | None = None
        self._in_forward = False  # inside the model's forward, between its two hooks
        self._stale = False  # a buffer owner ran a forward after the reference was taken
        self._zeros = torch.zeros(2, dtype=torch.int64, device=device)

    @property
    def broadcast(self) -> bool:
        """Whether DDP overwrites the replicas' buffers with rank 0's at every forward."""
        return self._broadcast

    def _fingerprint(self) -> _Print:
        if on_host(self._device):
            return self._plan.words()
        return self._plan().to(self._device)

    def _tensor(self, fp: _Print) -> torch.Tensor:
        if isinstance(fp, torch.Tensor):
            return fp
        return torch.tensor(fp, dtype=torch.int64, device=self._device)

    def begin_step(self) -> None:
        self._at_broadcast = None
        self._after_forward = None
        self._stale = False

    def forward_started(self, in_step: bool) -> None:
        """The module's forward pre-hook: DDP's broadcast has just run."""
        if not self.buffers:
            return
        self._in_forward = True
        if not in_step:
            self._previous_end = None  # buffers may change legitimately outside steps
        elif self._at_broadcast is None:
            self._at_broadcast = self._fingerprint()

    def forward_finished(self, in_step: bool) -> None:
        if not self.buffers:
            return
        self._in_forward = False
        if not in_step:
            self._previous_end = None
        else:
            self._after_forward = self._fingerprint()
            self._stale = False

    def owner_ran(self) -> None:
        """A forward hook of each module that owns persistent buffers, in a guarded step and
        outside a replay: run outside the model's own forward, it is a recomputation (activation
        checkpointing, inside the backward) or a submodule called on its own, and either may
        update the buffers after the reference was taken."""
        if not self._in_forward:
            self._stale = True

    def after_backward(self) -> None:
        """The end of the step's last backward: the reference again if a buffer owner ran
        since it was taken (the recomputations of activation checkpointing are over by now)."""
        if self._stale and self._after_forward is not None:
            self._after_forward = self._fingerprint()
            self._stale = False

    def forget_previous(self) -> None:
        """After a checkpoint load: the buffers changed on purpose since the last step."""
        self._previous_end = None

    def row_on_host(self) -> list[int]:
        """:meth:`row` as host ints, for a CPU job's row (:mod:`detection.row.words`): the same
        words, the differences wrapped as int64 arithmetic wraps them."""
        if not self.buffers:
            return [0] * BUFFER_ROW
        end = self._fingerprint()
        ends = _words(end)
        after = [0, 0]
        if self._after_forward is not None and not self._stale:
            after = [wrap64(a - b) for a, b in zip(_words(self._after_forward), ends, strict=True)]
        between = [0, 0]
        if self._source and self._previous_end is not None and self._at_broadcast is not None:
            between = [
                wrap64(a - b)
                for a, b in zip(_words(self._previous_end), _words(self._at_broadcast), strict=True)
            ]
        self._previous_end = end
        received = (
            _words(self._at_broadcast)
            if self._broadcast and self._at_broadcast is not None
            else [0, 0]
        )
        return [*received, *ends, *after, *between]

    def row(self) -> torch.Tensor:
        """This rank's ``BUFFER_ROW`` int64 values for the step's all-gather (on the device)."""
        if not self.buffers:
            return torch.zeros(BUFFER_ROW, dtype=torch.int64, device=self._device)
        end = self._tensor(self._fingerprint())
        zero2 = self._zeros
        after = (
            self._tensor(self._after_forward) - end
            if self._after_forward is not None and not self._stale
            else zero2
        )
        between = zero2
        if self._source and self._previous_end is not None and self._at_broadcast is not None:
            between = self._tensor(self._previous_end) - self._tensor(self._at_broadcast)
        self._previous_end = end
        received = (
            self._tensor(self._at_broadcast)
            if self._broadcast and self._at_broadcast is not None
            else None
        )
        return torch.cat([received if received is not None else zero2, end, after, between])


def buffer_owners(module: nn.Module, *, besides: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The submodules of ``module`` that own persistent buffers themselves, each once, except
    ``besides`` (the modules whose forward is the model's own)."""
    skip = {id(m) for m in besides}
    return [
        m
        for m in module.modules()
        if id(m) not in skip
        and any(
            b is not None and name not in m._non_persistent_buffers_set
            for name, b in m._buffers.items()
        )
    ]


def buffer_finding(
    rows: Sequence[Sequence[int]], broadcast: bool
) -> tuple[tuple[int, ...], dict[str, Any]] | None:
    """``(suspect ranks, alarm detail)`` from every rank's buffer row, or ``None`` when all
    three invariants hold."""
    after_forward = tuple(r for r, row in enumerate(rows) if row[4] or row[5])
    between = tuple(r for r, row in enumerate(rows) if row[6] or row[7])
    received = [tuple(row[0:2]) for row in rows]
    verdict = majority_vote(received) if broadcast else None
    split = verdict is not None and not verdict.unanimous
    if not (after_forward or between or split):
        return None
    suspects = set(after_forward) | set(between)
    detail: dict[str, Any] = {
        "diverged": "buffers",
        "buffers_changed_after_forward": list(after_forward),
        "buffers_changed_between_steps": list(between),
    }
    if verdict is not None and split:
        suspects |= set(verdict.divergent)
        detail["buffers_after_broadcast"] = {
            str(r): to_fingerprint(*v).hex() for r, v in enumerate(received)
        }
        if not verdict.culprit_known:
            detail["culprit"] = "unknown"
    return tuple(sorted(suspects)), detail
