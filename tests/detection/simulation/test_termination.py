"""SIGTERM as a stop (:mod:`detection.simulation.termination`): counted whatever the main thread
was doing,
and never raised into the cleanup that writes a stopped job's report.

The race these tests pin down is the one a stopped job meets: SIGTERM reaches every rank at
once, a peer leaves first, and a rank waiting inside a collective sees the peer's failure
before its own (deferred) handler has run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from detection.simulation.termination import StopRequest, Terminated, unwind_on_sigterm
from tests.detection.conftest import run_ranks


def _cleanup_after(error: BaseException) -> str:
    """Stands for the loop's cleanup: Python calls that would run a deferred handler."""
    return type(error).__name__


def _wait_while_the_peer_leaves(rank: int, world: int, scratch: str, signal_it: bool) -> object:
    """Rank 0 waits in an all-reduce that rank 1 never joins; rank 1 sends SIGTERM to rank 0
    (or not) while rank 0 waits, then leaves the group, which fails rank 0's wait."""
    waiting = Path(scratch) / "rank0-waiting"
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    stop = StopRequest()
    if rank == 0:
        signal.signal(signal.SIGTERM, stop.on_sigterm)
    dist.barrier()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not waiting.exists():
            assert time.monotonic() < deadline, "rank 0 never began its wait"
            time.sleep(0.01)
        time.sleep(0.5)  # rank 0 is inside work.wait(), in C++, when the signal lands
        if signal_it:
            os.kill(pids[0], signal.SIGTERM)
            time.sleep(0.2)
        return None  # leaving the group closes its connections: rank 0's wait fails
    try:
        work = dist.all_reduce(torch.ones(1), async_op=True)
        waiting.touch()
        work.wait()
    except BaseException as error:
        stopped = stop.settle()
        return stopped, _cleanup_after(error), stop.asked
    return "the all-reduce completed without its peer"


def test_a_stop_that_lands_in_a_collective_is_counted_when_the_peer_left_first(
    tmp_path: Path,
) -> None:
    results = run_ranks(_wait_while_the_peer_leaves, 2, str(tmp_path), True, timeout_s=120)
    stopped, error, asked = results[0]
    # The wait failed on the peer's departure, not on the signal: the handler was deferred...
    assert error != "Terminated", "the handler ran before the collective failed: race not met"
    # ...and still the stop is counted, and no Terminated escaped into the cleanup.
    assert stopped is True
    assert asked is True


def test_a_collective_failing_with_no_stop_is_a_failure(tmp_path: Path) -> None:
    results = run_ranks(_wait_while_the_peer_leaves, 2, str(tmp_path), False, timeout_s=120)
    stopped, error, asked = results[0]
    assert error != "Terminated"
    assert stopped is False
    assert asked is False


@pytest.fixture
def stop() -> Iterator[StopRequest]:
    request = StopRequest()
    previous = signal.signal(signal.SIGTERM, request.on_sigterm)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)


def _deliver_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    # A signal sent to itself is delivered before kill() returns; the handler runs at the next
    # bytecode check at the latest, which this call makes certain of.
    time.sleep(0)


def test_the_first_sigterm_unwinds_and_a_second_does_not_interrupt(stop: StopRequest) -> None:
    with pytest.raises(Terminated):
        _deliver_sigterm()
    assert stop.asked
    _deliver_sigterm()  # the unwinding (and the report) is not interrupted again
    assert stop.settle() is True


def test_a_sigterm_while_an_exception_is_handled_is_recorded_and_raised_at_the_next_step(
    stop: StopRequest,
) -> None:
    try:
        raise ValueError("a library handling an error of its own")
    except ValueError:
        _deliver_sigterm()  # recorded, not raised into the except block
    assert stop.asked
    with pytest.raises(Terminated):
        stop.check()  # where the loop begins its next step


def test_no_sigterm_no_stop(stop: StopRequest) -> None:
    assert stop.settle() is False
    stop.check()  # nothing recorded: the step goes on
    assert stop.asked is False


def _signalled_while_handling_an_error() -> None:
    try:
        raise EOFError("a library reading a pipe that closed")
    except EOFError:
        _deliver_sigterm()


def test_the_launchers_handler_unwinds_even_inside_an_except_and_only_once() -> None:
    """The launcher has no step boundary to check a recorded stop at: it unwinds at once,
    wherever the signal lands, and a second SIGTERM does not interrupt it stopping the ranks."""
    previous = signal.signal(signal.SIGTERM, unwind_on_sigterm)
    try:
        with pytest.raises(Terminated):
            _signalled_while_handling_an_error()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        _deliver_sigterm()  # ignored
    finally:
        signal.signal(signal.SIGTERM, previous)
