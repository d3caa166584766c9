"""``sdcguard train``: a local DDP job (CPU, gloo on 127.0.0.1) with sdcguard's detection.

``run(TrainConfig(...))`` starts ``world_size`` rank processes (:mod:`detection.simulation.rank`),
which train the built-in model (:mod:`detection.simulation.model`), and returns the DESIGN report.

Processes: ranks are forked from a ``forkserver`` that has torch preloaded (fast start, no
fork of a threaded parent: :mod:`detection.simulation.forkserver`); the launcher imports no
torch at all (a second import, seconds of CPU, on every start of a job, a replay or a resumed
run). The ranks rendezvous through a TCPStore rank 0 serves, on a port the kernel picks (so
parallel jobs never race for one), which rank 0 hands to the others through a queue the
launcher made. SIGTERM to the
launcher's process group ends every rank (the step in progress unwinds; rank 0 still reports,
as of its last complete step: :mod:`detection.simulation.termination`); the launcher then reaps
them and exits 143.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detection.simulation.config import SECRET_ENV, RankFailedError, TrainConfig
from detection.simulation.forkserver import PRELOAD
from detection.simulation.termination import run_pending_handlers

__all__ = ["run"]


def run(config: TrainConfig) -> dict[str, Any]:
    """Run the job and return the report (also written to ``config.report`` if set).

    Raises :class:`~detection.simulation.config.HarnessConfigError` before starting anything if
    the options are wrong, and :class:`RankFailedError` if a rank dies (the other ranks are
    stopped first).
    """
    config.validate()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    ports = ctx.Queue()  # rank 0 puts the port of the store it serves, once for each peer
    # Ranks fork from a server started earlier, with the environment of that moment: hand the
    # webhook secret over explicitly.
    secret = os.environ.get(SECRET_ENV) if config.webhook is not None else None
    with tempfile.TemporaryDirectory(prefix="sdcguard-train-") as scratch:
        result_path = Path(scratch) / "report.json"
        errors = Path(scratch)
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    config,
                    ports,
                    str(result_path),
                    str(errors / f"rank-{rank}.err"),
                    secret,
                ),
                name=f"sdcguard-rank-{rank}",
            )
            for rank in range(config.world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            _wait_all(procs, errors)
        finally:
            _stop_all(procs)
        report: dict[str, Any] = json.loads(result_path.read_text())
    return report  # rank 0 wrote it to config.report already


def _rank_main(*args: Any) -> None:
    """A rank's body, imported in the rank (the fork server has it preloaded), so that the
    launcher never imports torch."""
    from detection.simulation.rank import rank_entry

    rank_entry(*args)


def _wait_all(procs: Sequence[Any], errors: Path) -> None:
    pending = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while pending:
        for sentinel in multiprocessing.connection.wait(list(pending)):
            rank = pending.pop(sentinel)
            proc = procs[rank]
            proc.join()
            if proc.exitcode != 0:
                # A rank that ended on the SIGTERM this launcher got too is the stop, not a
                # failure: let a handler the interpreter deferred raise it first.
                run_pending_handlers()
                err_file = errors / f"rank-{rank}.err"
                tail = err_file.read_text()[-2000:] if err_file.exists() else ""
                raise RankFailedError(rank, proc.exitcode, tail.strip())


def _stop_all(procs: Sequence[Any], grace_s: float = 5.0) -> None:
    """Terminate what still runs, wait a bounded time, kill the rest: never leave a rank."""
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
