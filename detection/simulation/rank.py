"""One rank of ``sdcguard train``: a process that trains the built-in model under the guard.

:func:`rank_entry` is the body of a rank process the launcher (:mod:`detection.simulation.launch`)
starts: it joins the gloo group, :func:`train` runs the steps, and rank 0 returns the DESIGN
report. Determinism contract (the recovery demo rests on it): model init is seeded by ``seed``;
data and dropout are seeded per (seed, step, rank); every rank runs ``threads`` intra-op
threads. So the same seed gives bitwise the same final fingerprint run after run, and resuming
from the checkpoint of step ``s`` (the state after step ``s``) replays steps ``s+1…`` bitwise.

SIGTERM ends a rank as a stop, not a failure: the step in progress unwinds and rank 0 still
reports, as of its last complete step (:mod:`detection.simulation.termination`).
"""

# No ``from __future__ import annotations`` here: DDP compares a comm hook's annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects when it is registered.

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from detection.audit.ring import seed_rng, step_seed
from detection.gate import StepOutcome
from detection.simulation.config import TrainConfig
from detection.simulation.diagnostics import Probe, open_trace, trace_step, write_probe
from detection.simulation.model import loss_fn
from detection.simulation.parallel import is_sharded
from detection.simulation.rank_setup import RankJob, guard_config_of, set_up
from detection.simulation.report import Progress, build_report, write_report
from detection.simulation.sharded import final_fingerprint, write_checkpoint
from detection.simulation.termination import TERMINATED, StopRequest, Terminated
from detection.weights.fingerprint import weight_fingerprint
from detection.weights.state import model_state_tensors

__all__ = ["TERMINATED", "guard_config_of", "rank_entry", "train"]

_log = logging.getLogger(__name__)
_RANK_STOP = StopRequest()  # a rank is a process of its own: one stop request per process


def rank_entry(
    rank: int,
    config: TrainConfig,
    ports: Any,
    result_path: str,
    error_path: str,
    secret: str | None,
) -> None:
    """Body of a rank process: exits 0, 143 on SIGTERM, 1 on any error (written for the
    launcher to quote).

    Rank 0 serves the job's rendezvous store, on a port the kernel picks (no race for a free
    port), and hands the port to the other ranks through ``ports`` (a queue the launcher
    made): the launcher itself then needs no torch, a second import of it on every start of a
    job, a replay or a resumed run."""
    signal.signal(signal.SIGTERM, _RANK_STOP.on_sigterm)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(config.threads)
    code = 0
    try:
        store = _rendezvous(rank, config.world_size, ports)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=120),
        )
        try:
            report = train(rank, config, secret)
        finally:
            with contextlib.suppress(Exception):  # peers may be gone already when stopped
                dist.destroy_process_group()
        if "stopped_after_step" in report:
            code = TERMINATED  # rank 0 wrote its report itself: the launcher is gone
        elif rank == 0:
            Path(result_path).write_text(json.dumps(report))
    except Terminated:
        code = TERMINATED
    except Exception as err:
        if _RANK_STOP.settle():  # the peers, stopped first, broke a collective: still a stop
            code = TERMINATED
        else:
            _log.exception("rank %d failed", rank, extra={"rank": rank})
            Path(error_path).write_text(f"{type(err).__name__}: {err}")
            code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rendezvous(rank: int, world_size: int, ports: Any) -> dist.TCPStore:
    """The job's store: served by rank 0, joined by the others once rank 0 has said where.
    A rank waits a bounded time for the port (the launcher stops every rank when one fails)."""
    timeout = timedelta(seconds=60)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False
        )
        for _ in range(world_size - 1):
            ports.put(store.port)
        return store
    port = ports.get(timeout=timeout.total_seconds())
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)


def train(rank: int, config: TrainConfig, secret: str | None) -> dict[str, Any]:
    """Train this rank's steps and return the report (rank 0 also writes it)."""
    job = set_up(rank, config, secret)
    progress = Progress()
    job.trace = open_trace(config, rank)
    try:
        for step in range(job.start, config.steps):
            _RANK_STOP.check()
            if not _step(job, step, progress):
                break
        # Every step is done: a stop arriving now (the incident flow stops training right after
        # the alarm) must not cost the report, so the little that is left runs to its end.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except BaseException:
        # Once a stop was asked for, whatever ends the loop is the stop: the signal itself, or
        # a collective failing because the peers already left. The spool keeps what is not
        # sent (the stopper will not wait); only rank 0 reports. The stop may still be pending
        # (the peers left while this rank waited in a collective): settle it first.
        if not _RANK_STOP.settle():
            raise
        progress.terminating = True
        if rank != 0:
            raise Terminated() from None
    finally:
        _close(job, progress.terminating)
    final = None
    if is_sharded(config):  # the weights are spread over the ranks: sum the parts
        final = progress.completed_fp if progress.terminating else None
        final = final or final_fingerprint(job.model, collective=not progress.terminating)
    report = build_report(
        job.config, job.nodes, job.model, job.guard, job.gate, progress, final=final
    )
    if rank == 0:
        # Written here, before the webhook flush, not by the launcher: a launcher that is
        # stopped meanwhile would lose it.
        write_report(config, report)
    if job.sender is not None and not progress.terminating:
        job.sender.close(timeout_s=10.0)  # what is not delivered by then stays spooled
    return report


def _step(job: RankJob, step: int, progress: Progress) -> bool:
    """Run one step and what follows it (probe, trace, checkpoint); ``False`` once the guard
    halted the job."""
    config, guard = job.config, job.guard
    probe = Probe(job.model) if step == config.probe_step else None
    began = time.perf_counter()
    checkpoint_due = bool(config.checkpoint_every) and step % config.checkpoint_every == 0
    loss, outcome = _train_step(job, step, flush=checkpoint_due)
    progress.durations.append(time.perf_counter() - began)
    if probe is not None:
        probe.close()
        write_probe(config, job.rank, probe)
    if job.trace is not None or job.capture is not None:
        state = model_state_tensors(job.model)
        trace_step(job.trace, step, loss, job.capture, state, outcome)
    # After its trace line: a stopped run's report matches its trace. A deferred decision
    # reports the last step decided, with that step's fingerprint.
    progress.completed = step if outcome is None else outcome.step
    progress.completed_fp = outcome.fingerprint if outcome is not None else None
    if job.gate is not None and checkpoint_due:
        _checkpoint(job, step, outcome)
    if guard is not None and guard.halted:
        _log.warning("halted after the alarm at step %d", step, extra=job.extra)
        if config.hold_after_halt_s > 0:
            _hold(config.hold_after_halt_s, job.extra)
        return False
    return True


def _train_step(job: RankJob, step: int, *, flush: bool) -> tuple[torch.Tensor, StepOutcome | None]:
    """One step of the training loop a user writes: under the guard, or as plain DDP."""
    guard = job.guard
    if guard is None:
        seed_rng(step_seed(job.config.seed, step, job.rank), torch.device("cpu"))
        job.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(job.ddp, job.microbatch(step, job.rank))
        loss.backward()
        job.optimizer.step()
        return loss, None
    faults = job.faults
    if faults is not None:
        faults.begin_step(step)
    try:
        with guard.step(step):
            job.optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(job.ddp, job.microbatch(step, job.rank))
            guard.backward(loss)
            job.optimizer.step()
    finally:
        if faults is not None:
            faults.end_step()
    if flush or job.trace is not None or job.capture is not None:
        guard.flush()  # these record this step's outcome (deferred: decide it now)
    return loss, guard.last_outcome


def _checkpoint(job: RankJob, step: int, outcome: StepOutcome | None) -> None:
    assert job.gate is not None
    if is_sharded(job.config):
        ranks = range(job.config.world_size)
        write_checkpoint(job.gate, job.model, job.optimizer, step, outcome, ranks)
        return
    if outcome is None:  # plain DDP: a record with no evidence stays pending
        outcome = StepOutcome(
            step=step,
            ranks=tuple(range(job.config.world_size)),
            fingerprint=weight_fingerprint(model_state_tensors(job.model)),
            vote_passed=False,
        )
        job.gate.observe(outcome)
    model, optimizer, fingerprint, config = (
        job.model,
        job.optimizer,
        outcome.fingerprint,
        job.config,
    )

    def writer(path: Path) -> None:
        torch.save(
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "fingerprint": fingerprint.hex(),
                "seed": config.seed,
                "world_size": config.world_size,
            },
            path,
        )

    job.gate.write(step, writer)


def _close(job: RankJob, terminating: bool) -> None:
    if job.trace is not None:
        job.trace.close()
    if job.faults is not None:
        job.faults.close()
    with _quiet_if(terminating):  # peers may be gone: cleanup must not hide the report
        if job.guard is not None:
            job.guard.close()
        if job.gate is not None:
            job.gate.flush()


def _hold(seconds: float, extra: dict[str, Any]) -> None:
    """Stay alive, computing nothing, until SIGTERM (which unwinds as a stop: the report is
    still written) or ``seconds`` pass."""
    _log.warning("halted: holding up to %.0f s for the job's stop", seconds, extra=extra)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
    _log.warning("no stop within %.0f s: ending the halted job", seconds, extra=extra)


@contextlib.contextmanager
def _quiet_if(stopping: bool) -> Iterator[None]:
    try:
        yield
    except Exception:
        if not stopping:
            raise
        _log.warning("cleanup after the stop failed", exc_info=True)
