"""The guard's last collectives, kept referenced from Python after they complete.

Why: a process group runs a collective on a thread of its own (gloo's worker threads; NCCL's
watchdog keeps its works too), which holds the work object until just after it completes. The
work holds its tensors, and a tensor Python ever saw has a Python object, which only a thread
holding the GIL may release. When the training thread has dropped its references first, the
backend thread's release is the last one: it must take the GIL to free the tensors. In a running
job that is a GIL handover on the backend's thread; while the interpreter finalizes — a script
that returns right after the guard's last collective, e.g. once an alarm halted it or
``guard.close()`` decided the deferred last step — a thread that asks for the GIL is ended on
the spot, the unwind runs through the work's destructor, and the process aborts ("terminate
called without an active exception", SIGABRT) instead of exiting with its own status.

Invariant: the last :data:`HELD` works the guard started are referenced here, so no backend
thread's release of one of them is the last: they are freed on the thread that pushes them out
with a later collective (it holds the GIL) or, the very last, when the interpreter tears this
module down on its main thread. A work pushed out while a backend thread the scheduler kept
waiting still holds it is freed by that thread while the job runs: a GIL handover, nothing
more (at the very end of a script only if that thread was kept waiting through ``HELD``
later collectives and the rest of the script). What this keeps alive: at most
``HELD`` works' tensors, the largest being a bucket joined with a carried row
(``detection.guard.carry``; DDP's first bucket, 1 MiB by default).
"""

from __future__ import annotations

import collections
from typing import Any, TypeVar

__all__ = ["HELD", "held", "hold"]

HELD = 4

_W = TypeVar("_W")
_RECENT: collections.deque[Any] = collections.deque(maxlen=HELD)


def hold(work: _W) -> _W:
    """Keep ``work`` (a ``torch.distributed`` work object, or ``None`` for a collective that
    returned none) referenced among the last :data:`HELD`; returns it, for use inline."""
    if work is not None:
        _RECENT.append(work)  # one bytecode-level append: safe from any thread under the GIL
    return work


def held() -> tuple[Any, ...]:
    """The works held now, oldest first (for tests and diagnostics)."""
    return tuple(_RECENT)
