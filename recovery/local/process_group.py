"""Process groups of local training runs: the supervisor that records each exit, and liveness.

A local job is one process group whose leader is :data:`SUPERVISOR`. Whether the job still
runs is whether a live (non-zombie) process is left in that group, and the leader's start time
tells a recycled pid from ours; so any process that reads the job's state file can tell, not
only the one that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

# The supervisor every local job runs under, as its process-group leader: it runs the real
# command, waits for it, and records the exit status in a file, so any process (the flow, the
# demo, the webhook) can tell "succeeded" from "failed" later — not only the one that started
# it. It survives the SIGTERM that stops the group (a Python handler, which — unlike SIG_IGN —
# is not inherited across exec), so the child's status is still written; only SIGKILL of the
# whole group leaves no record, and stop() records that itself.
SUPERVISOR = """\
import json, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGINT, lambda *_: None)
exit_path = sys.argv[1]
try:
    returncode = subprocess.Popen(sys.argv[2:]).wait()
except OSError as err:
    print(f"sdcguard: cannot start {sys.argv[2]!r}: {err}", file=sys.stderr, flush=True)
    returncode = 127
with open(exit_path + ".tmp", "w") as handle:
    json.dump({"returncode": returncode}, handle)
os.replace(exit_path + ".tmp", exit_path)
sys.exit(returncode if returncode >= 0 else 128 - returncode)
"""

# Processes this Python process started: polled so that they never linger as zombies, which
# would still count as members of their process group.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CHILDREN_LOCK = threading.Lock()


def track_child(process: subprocess.Popen[bytes]) -> None:
    """Remember a process this Python process started, so that it is reaped once it ends."""
    with _CHILDREN_LOCK:
        _CHILDREN[process.pid] = process


def tracked_child(pid: int) -> subprocess.Popen[bytes] | None:
    """The process with ``pid`` if this Python process started it and has not reaped it."""
    with _CHILDREN_LOCK:
        return _CHILDREN.get(pid)


def reap_children() -> None:
    with _CHILDREN_LOCK:
        for pid, process in list(_CHILDREN.items()):
            if process.poll() is not None:
                del _CHILDREN[pid]


def read_returncode(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["returncode"])
    except FileNotFoundError:
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    # starttime is field 22 of stat; fields[0] here is field 3 (state).
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def group_alive(pgid: int) -> bool:
    """True if a live (non-zombie) process is still in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        # fields: state, ppid, pgrp, …; a zombie has exited and only awaits its parent.
        if (
            fields is not None
            and len(fields) > 2
            and int(fields[2]) == pgid
            and fields[0] not in ("Z", "X")
        ):
            return True
    return False


_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block and deliver them after it.

    Starting a job and recording it must be one step: a Ctrl-C or SIGTERM that unwinds the
    caller between the fork and the saved record leaves a process group nobody knows of, which
    no ``stop()`` can find (the demo stopped by SIGTERM left its training running that way).
    Held here, the signal is raised again once the record is on disk, so the caller's cleanup
    finds the job. Only the main thread receives Python signals; elsewhere this does nothing.
    An ignored signal, and a handler installed outside Python (``getsignal`` returns None), are
    left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        pending.append(signum)

    previous: dict[int, signal._HANDLER] = {}
    try:
        for signum in _DEFERRED_SIGNALS:
            handler = signal.getsignal(signum)
            if handler is None or handler == signal.SIG_IGN:
                continue
            previous[signum] = signal.signal(signum, hold)
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for arrived in dict.fromkeys(pending):  # each once, in arrival order
            signal.raise_signal(arrived)
