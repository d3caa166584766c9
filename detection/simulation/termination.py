"""SIGTERM as a stop: the training loop unwinds, and a stopped job still reports.

The incident flow stops a job by sending SIGTERM to its process group: every rank and the
launcher get it at once. Each rank's handler raises :class:`Terminated`, which unwinds the step
(every ``finally`` runs); rank 0 then writes the report as of its last complete step.

Two facts about CPython's signal handling shape this module:

* A Python handler does not run when the signal arrives. The C-level handler only marks it
  pending, and the interpreter runs the Python handler at a later bytecode of the main thread.
  A rank whose main thread waits inside a collective (in C++) when SIGTERM arrives runs its
  handler only after the wait returns — and when the peers, stopped by the same signal, left
  first, the wait returns with *their* failure ("connection closed by peer"). That exception
  reaches the loop's handler while the stop is still unrecorded: without :meth:`StopRequest.
  settle` the rank would report a failure, and rank 0 would write no report.
* The deferred handler then runs at whatever Python call comes next: inside the loop's
  ``except`` block or its cleanup. Raising there would abort the very cleanup that writes the
  report. So the handler records the stop but does not raise while an exception is being
  handled; the loop checks :attr:`StopRequest.asked` where it begins a step, so a stop
  recorded while library code handled some exception of its own still ends the job.

Invariant: a SIGTERM that has arrived is counted, whatever the main thread was doing, and
once the loop is unwinding no handler interrupts it.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from types import FrameType

__all__ = ["TERMINATED", "StopRequest", "Terminated", "run_pending_handlers", "unwind_on_sigterm"]

#: The exit status of a rank, or of the launcher, stopped by SIGTERM (as a shell reports it).
TERMINATED = 128 + signal.SIGTERM

_check_signals = ctypes.pythonapi.PyErr_CheckSignals
_check_signals.argtypes = []
_check_signals.restype = ctypes.c_int


class Terminated(BaseException):
    """SIGTERM arrived: unwind (every ``finally`` runs) and exit 143.

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` in the loop or a
    library may take a stop for an error and carry on."""


def run_pending_handlers() -> None:
    """Run now the Python handlers of signals that have arrived but whose handlers the
    interpreter has deferred (``PyErr_CheckSignals``); raises what a handler raises."""
    _check_signals()


def unwind_on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    """The handler of a process with nothing to finish after a stop but its children (the
    launcher): raise :class:`Terminated` at once, wherever the main thread is — inside an
    ``except`` of a library too, since no step boundary would check later — and ignore any
    later SIGTERM, so the children are stopped to the end."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


class StopRequest:
    """The SIGTERM handler of one process and what it recorded."""

    def __init__(self) -> None:
        self.asked = False

    def on_sigterm(self, _signum: int, _frame: FrameType | None) -> None:
        """Record the stop; raise :class:`Terminated` the first time, unless an exception is
        being handled already (the loop is unwinding: its cleanup must run to the end)."""
        first = not self.asked
        self.asked = True
        if first and sys.exc_info()[1] is None:
            raise Terminated()

    def settle(self) -> bool:
        """Whether a stop was asked for, counting a SIGTERM that arrived while the main thread
        waited in C++ and whose handler has not run yet. Call it where an exception is being
        handled (there the handler records, and does not raise)."""
        run_pending_handlers()
        return self.asked

    def check(self) -> None:
        """Raise :class:`Terminated` if a stop was recorded but not raised (the handler ran
        while some code handled an exception of its own): called where a step begins."""
        if self.asked:
            raise Terminated()
