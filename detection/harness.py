"""``sdcguard train``: a local DDP job (CPU, gloo on 127.0.0.1) with sdcguard's detection.

``run(TrainConfig(...))`` starts ``world_size`` rank processes, trains the built-in model
(:mod:`detection.model`) and returns the DESIGN report; ``main(argv)`` is the command line
(argparse, stdlib only, so ``python -m detection.harness`` works in a bare training image).

Determinism contract (the recovery demo rests on it): model init is seeded by ``seed``; data and
dropout are seeded per (seed, step, rank); every rank runs ``threads`` intra-op threads. So the
same seed gives bitwise the same final fingerprint run after run, and resuming from the
checkpoint of step ``s`` (the state after step ``s``) replays steps ``s+1…`` bitwise.

Processes: ranks are forked from a ``forkserver`` that has torch preloaded (fast start, no
fork of a threaded parent; started before this module imports torch, so the two imports overlap:
:mod:`detection.forkserver`), rendezvous through a TCPStore the launcher owns (its port is
picked by the kernel, so parallel jobs never race for one). SIGTERM to the launcher's process
group ends every rank (the step in progress unwinds; rank 0 still reports, as of its last
complete step: :mod:`detection.termination`); the launcher then reaps them and exits 143.
"""

# No ``from __future__ import annotations`` here: DDP compares a comm hook's annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects when it is registered.

import sys

if __name__ == "__main__":  # ``python -m detection.harness``: the ranks' imports start now
    from detection.forkserver import start_early

    start_early(sys.argv[1:])

import argparse
import contextlib
import importlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from detection.audit import AuditMode, seed_rng, step_seed
from detection.faults import FaultSpec
from detection.fingerprint import Fingerprint, fingerprint_on_device, weight_fingerprint
from detection.forkserver import PRELOAD
from detection.gate import CheckpointGate, StepOutcome
from detection.guard import GuardConfig, SDCGuard
from detection.identity import RankIdentity
from detection.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.termination import (
    StopRequest,
    Terminated,
    run_pending_handlers,
    unwind_on_sigterm,
)
from detection.vote import (
    all_gather_rows,
    model_state_tensors,
    to_fingerprint,
    verify_after_load,
)

__all__ = [
    "HarnessConfigError",
    "HarnessError",
    "RankFailedError",
    "TrainConfig",
    "main",
    "run",
]

_log = logging.getLogger(__name__)
_SECRET_ENV = "SDCGUARD_WEBHOOK_SECRET"
_KEY_ID_ENV = "SDCGUARD_WEBHOOK_KEY_ID"  # which of the webhook's scoped keys the secret is
_TERMINATED = 128 + signal.SIGTERM
_PRELOAD = PRELOAD  # what the ranks' fork server imports (detection.forkserver)


class HarnessError(RuntimeError):
    """The job could not run to its end."""


class HarnessConfigError(HarnessError, ValueError):
    """The options contradict each other or name something that is not there."""


class RankFailedError(HarnessError):
    """A rank process died; the others were stopped."""

    def __init__(self, rank: int, exitcode: int | None, tail: str) -> None:
        super().__init__(f"rank {rank} exited with code {exitcode}{': ' + tail if tail else ''}")
        self.rank = rank
        self.exitcode = exitcode


@dataclass
class TrainConfig:
    """The options of ``sdcguard train`` (DESIGN names, ARCHITECTURE extensions)."""

    world_size: int = 4
    ranks_per_node: int = 1
    nodes: list[str] | None = None
    seed: int = 0
    steps: int = 200
    audit_every: int = 10
    audit_mode: str = "loss"
    inject: list[str] = field(default_factory=list)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume_from: Path | None = None
    webhook: str | None = None
    report: Path | None = None
    plain: bool = False
    job_id: str | None = None
    threads: int = 1
    trace: Path | None = None
    probe_step: int | None = None
    probe: Path | None = None
    halt_on_alarm: bool = False
    abft: bool | None = None  # None: GuardConfig's default (on for the eager model)
    skip_update_on_alarm: bool = False
    defer_decision: bool = False
    hold_after_halt_s: float = 0.0
    """With ``halt_on_alarm``: how long a halted job stays alive, training no further, for its
    stop (as a job halted by its guard waits for its operator); 0 ends it at once."""

    def guard_config(self) -> GuardConfig:
        """The guard's configuration for this job, the same on every rank."""
        return GuardConfig(
            audit_every=self.audit_every,
            audit_mode=AuditMode(self.audit_mode),
            seed=self.seed,
            halt_on_alarm=self.halt_on_alarm,
            inject=_injected(self),
            abft=self.abft,
            skip_update_on_alarm=self.skip_update_on_alarm,
            defer_decision=self.defer_decision,
        )

    def node_names(self) -> list[str]:
        """Node of each rank: ``nodes`` if given, else ``node-{rank // ranks_per_node}``."""
        if self.nodes is not None:
            return list(self.nodes)
        return [f"node-{r // self.ranks_per_node}" for r in range(self.world_size)]

    @property
    def job(self) -> str:
        return self.job_id or f"local-{self.seed}"

    def validate(self) -> None:
        """Raise :class:`HarnessConfigError` naming the first contradiction."""
        checks: list[tuple[bool, str]] = [
            (self.world_size >= 1, "--world-size must be ≥ 1"),
            (self.ranks_per_node >= 1, "--ranks-per-node must be ≥ 1"),
            (self.steps >= 0, "--steps must be ≥ 0"),
            (self.audit_every >= 0, "--audit-every must be ≥ 0"),
            (self.audit_mode in {m.value for m in AuditMode}, "--audit-mode is loss|gradient"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be ≥ 0"),
            (
                self.checkpoint_every == 0 or self.checkpoint_dir is not None,
                "--checkpoint-every needs --checkpoint-dir",
            ),
            (self.threads >= 1, "--threads must be ≥ 1"),
            (
                (self.probe_step is None) == (self.probe is None),
                "--probe-step and --probe go together",
            ),
            (not (self.plain and self.inject), "--plain runs no sdcguard: it cannot --inject"),
            (not (self.plain and self.webhook), "--plain runs no sdcguard: it has no --webhook"),
            (
                self.nodes is None or len(self.nodes) == self.world_size,
                f"--nodes must name one node per rank ({self.world_size})",
            ),
            (self.nodes is None or all(self.nodes), "--nodes names must not be empty"),
            (
                self.resume_from is None or self.resume_from.is_file(),
                f"--resume-from {self.resume_from}: no such checkpoint file",
            ),
            (
                self.webhook is None or bool(os.environ.get(_SECRET_ENV)),
                f"--webhook needs the secret in {_SECRET_ENV}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise HarnessConfigError(message)
        for spec in self.inject:
            try:
                FaultSpec.parse(spec)
            except ValueError as err:
                raise HarnessConfigError(str(err)) from err


def _injected(config: TrainConfig) -> tuple[str, ...]:
    """The faults this run suffers. A resumed run recomputes steps a run already computed, and
    a transient upset (``KIND@RANK:STEP``) does not repeat: only the nodes' persistent faults
    follow it, as they follow a diagnostic replay."""
    if config.resume_from is None:
        return tuple(config.inject)
    return tuple(s for s in config.inject if FaultSpec.parse(s).persistent)


def _hold(seconds: float, extra: dict[str, Any]) -> None:
    """Stay alive, computing nothing, until SIGTERM (which unwinds as a stop: the report is
    still written) or ``seconds`` pass."""
    _log.warning("halted: holding up to %.0f s for the job's stop", seconds, extra=extra)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
    _log.warning("no stop within %.0f s: ending the halted job", seconds, extra=extra)


# -- the launcher ---------------------------------------------------------------------------------
def run(config: TrainConfig) -> dict[str, Any]:
    """Run the job and return the report (also written to ``config.report`` if set).

    Raises :class:`HarnessConfigError` before starting anything if the options are wrong, and
    :class:`RankFailedError` if a rank dies (the other ranks are stopped first).
    """
    config.validate()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    entry = importlib.import_module("detection.harness")._rank_entry
    # Ranks fork from a server started earlier, with the environment of that moment: hand the
    # webhook secret over explicitly.
    secret = os.environ.get(_SECRET_ENV) if config.webhook is not None else None
    with tempfile.TemporaryDirectory(prefix="sdcguard-train-") as scratch:
        result_path = Path(scratch) / "report.json"
        errors = Path(scratch)
        procs = [
            ctx.Process(
                target=entry,
                args=(
                    rank,
                    config,
                    store.port,
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


def _write_report(config: TrainConfig, report: dict[str, Any]) -> None:
    if config.report is None:
        return
    config.report.parent.mkdir(parents=True, exist_ok=True)
    temp = config.report.with_name(config.report.name + ".tmp")
    temp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(temp, config.report)


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


# -- one rank -------------------------------------------------------------------------------------
_RANK_STOP = StopRequest()  # a rank is a process of its own: one stop request per process


def _rank_entry(
    rank: int, config: TrainConfig, port: int, result_path: str, error_path: str, secret: str | None
) -> None:
    """Body of a rank process: exits 0, 143 on SIGTERM, 1 on any error (written for the
    launcher to quote)."""
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
        store = dist.TCPStore(
            "127.0.0.1", port, config.world_size, False, timeout=timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=120),
        )
        try:
            report = _train(rank, config, secret)
        finally:
            with contextlib.suppress(Exception):  # peers may be gone already when stopped
                dist.destroy_process_group()
        if "stopped_after_step" in report:
            code = _TERMINATED  # rank 0 wrote its report itself: the launcher is gone
        elif rank == 0:
            Path(result_path).write_text(json.dumps(report))
    except Terminated:
        code = _TERMINATED
    except Exception as err:
        if _RANK_STOP.settle():  # the peers, stopped first, broke a collective: still a stop
            code = _TERMINATED
        else:
            _log.exception("rank %d failed", rank, extra={"rank": rank})
            Path(error_path).write_text(f"{type(err).__name__}: {err}")
            code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _sender(config: TrainConfig, rank: int, secret: str | None) -> Any:
    if config.webhook is None:
        return None
    if not secret:
        raise HarnessConfigError(f"--webhook needs the secret in {_SECRET_ENV}")
    from detection.sender import AlarmSender  # imported only when asked: it needs httpx

    base = (
        config.checkpoint_dir / ".spool"
        if config.checkpoint_dir is not None
        else Path(tempfile.gettempdir()) / "sdcguard-spool" / config.job
    )
    spool = base / f"rank-{rank}"
    spool.mkdir(parents=True, exist_ok=True)
    key_id = os.environ.get(_KEY_ID_ENV) or "default"
    return AlarmSender(config.webhook, secret, config.job, spool, key_id=key_id)


class _LocalGradientCapture:
    """Comm hook for ``--trace``: keeps a copy of each local gradient before all-reduce (a
    diagnostic that may cost), then all-reduces like DDP's default."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.grads: dict[int, torch.Tensor] = {}

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self.grads[self._index[id(p)]] = g.detach().clone()
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def fingerprint(self) -> torch.Tensor:
        tensors = [self.grads.get(i, torch.zeros_like(p)) for i, p in enumerate(self.params)]
        self.grads.clear()
        return fingerprint_on_device(tensors)


class _Probe:
    """Per-submodule fingerprints of forward outputs and of gradients w.r.t. module inputs at
    one step. The first call per module wins, so an audit replay later in the step is ignored."""

    def __init__(self, module: nn.Module) -> None:
        # Modules fed only integer tokens (embeddings) have no input gradient; the hook then
        # fires with None and we record nothing for them, which is what we want.
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
            self._handles.append(sub.register_forward_hook(self._on_forward(name)))
            self._handles.append(sub.register_full_backward_hook(self._on_backward(name)))

    @staticmethod
    def _hex(values: Any) -> str | None:
        items = values if isinstance(values, tuple | list) else (values,)
        tensors = [t.detach() for t in items if isinstance(t, torch.Tensor)]
        return weight_fingerprint(tensors).hex() if tensors else None

    def _on_forward(self, name: str) -> Any:
        def hook(_m: nn.Module, _inputs: Any, output: Any) -> None:
            if name not in self.forward:
                value = self._hex(output)
                if value is not None:
                    self.forward[name] = value
                    self.order.append(name)

        return hook

    def _on_backward(self, name: str) -> Any:
        def hook(_m: nn.Module, grad_input: Any, _grad_output: Any) -> None:
            if name not in self.backward:
                value = self._hex(grad_input)
                if value is not None:
                    self.backward[name] = value

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _local_rank(nodes: Sequence[str], rank: int) -> int:
    return sum(1 for r in range(rank) if nodes[r] == nodes[rank])


def _train(rank: int, config: TrainConfig, secret: str | None) -> dict[str, Any]:
    world = config.world_size
    nodes = config.node_names()
    node = nodes[rank]
    extra = {"job": config.job, "rank": rank, "node": node}
    cfg = ModelConfig()
    device = torch.device("cpu")
    torch.manual_seed(config.seed)
    model = TinyTransformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    expected: str | None = None
    if config.resume_from is not None:
        state = torch.load(config.resume_from, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
        expected = str(state["fingerprint"])
    ddp = DistributedDataParallel(model)
    # DDP rebuilds its gradient buckets once, after the first backward, in the order gradients
    # became ready; gloo's ring sums each element in an order that depends on its position in the
    # bucket. A resumed run's first step would reduce with the initial layout and differ in the
    # last bits from the run it continues, so fix the layout before the first step (the same
    # call DDP's Join support makes): every step of every run then reduces with one layout.
    ddp.reducer._push_all_rebuilt_params()
    params = list(model.parameters())
    if expected is not None:
        verify_after_load(model_state_tensors(model), expected)
        _log.info("resumed from %s at step %d", config.resume_from, start, extra=extra)

    def microbatch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, config.seed, step, r, device)

    capture = _LocalGradientCapture(params) if config.trace is not None else None
    sender = None if config.plain else _sender(config, rank, secret)
    gate = None
    if rank == 0:
        gate = CheckpointGate(
            config.checkpoint_dir,
            audit_every=config.audit_every,
            nodes=nodes,
            sink=sender,
            job_id=config.job,
        )
    guard: SDCGuard | None = None
    if config.plain:
        if capture is not None:
            ddp.register_comm_hook(None, capture.hook)
    else:
        guard = SDCGuard(
            ddp,
            optimizer,
            microbatch=microbatch,
            loss_fn=loss_fn,
            config=config.guard_config(),
            identity=RankIdentity.detect(rank, _local_rank(nodes, rank), world, node=node),
            sender=sender,
            gate=gate,
            job_id=config.job,
            comm_hook=capture.hook if capture is not None else None,
        )
    trace = _open_trace(config, rank)
    durations: list[float] = []
    terminating = False
    completed: int | None = None  # the last step whose update finished
    completed_fp: Fingerprint | None = None
    try:
        for step in range(start, config.steps):
            _RANK_STOP.check()
            probe = _Probe(model) if step == config.probe_step else None
            began = time.perf_counter()
            checkpoint_due = bool(config.checkpoint_every) and step % config.checkpoint_every == 0
            if guard is not None:
                with guard.step(step):
                    optimizer.zero_grad(set_to_none=True)
                    loss = loss_fn(ddp, microbatch(step, rank))
                    guard.backward(loss)
                    optimizer.step()
                if checkpoint_due or trace is not None or capture is not None:
                    guard.flush()  # these record this step's outcome (deferred: decide it now)
                outcome = guard.last_outcome
            else:
                seed_rng(step_seed(config.seed, step, rank), device)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(ddp, microbatch(step, rank))
                loss.backward()
                optimizer.step()
                outcome = None
            durations.append(time.perf_counter() - began)
            if probe is not None:
                probe.close()
                _write_probe(config, rank, probe)
            if trace is not None or capture is not None:
                _trace_step(trace, step, loss, capture, model_state_tensors(model), outcome)
            # After its trace line: a stopped run's report matches its trace. A deferred
            # decision reports the last step decided, with that step's fingerprint.
            completed = step if outcome is None else outcome.step
            completed_fp = outcome.fingerprint if outcome is not None else None
            if gate is not None and checkpoint_due:
                if outcome is None:  # plain DDP: a record with no evidence stays pending
                    outcome = StepOutcome(
                        step=step,
                        ranks=tuple(range(world)),
                        fingerprint=weight_fingerprint(model_state_tensors(model)),
                        vote_passed=False,
                    )
                    gate.observe(outcome)
                _write_checkpoint(gate, step, model, optimizer, outcome.fingerprint, config)
            if guard is not None and guard.halted:
                _log.warning("halted after the alarm at step %d", step, extra=extra)
                if config.hold_after_halt_s > 0:
                    _hold(config.hold_after_halt_s, extra)
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
        terminating = True
        if rank != 0:
            raise Terminated() from None
    finally:
        if trace is not None:
            trace.close()
        with _quiet_if(terminating):  # peers may be gone: cleanup must not hide the report
            if guard is not None:
                guard.close()
            if gate is not None:
                gate.flush()
    # A stopped run reports the weights after its last complete step: the signal may have
    # landed inside an update, so the live tensors are not a state any step produced.
    if terminating and completed_fp is not None:
        final = completed_fp
    else:
        final = weight_fingerprint(model_state_tensors(model))
    alarms = guard.alarms if guard is not None else []
    report: dict[str, Any] = {
        "world_size": world,
        "steps": config.steps,
        "nodes": {str(r): n for r, n in enumerate(nodes)},
        "alarms": [a.to_report() for a in alarms],
        "checkpoints": [r.to_report() for r in gate.records] if gate is not None else [],
        "final_fingerprint": final.hex(),
        "step_ms": _step_ms(durations),
    }
    if terminating:
        # Stopped (the incident flow stops training): rank 0 still reports what the job did up
        # to its last complete step — its alarms and checkpoints are the incident's evidence.
        report["stopped_after_step"] = completed
    if rank == 0:
        # Written here, before the webhook flush, not by the launcher: a launcher that is
        # stopped meanwhile would lose it.
        _write_report(config, report)
    if sender is not None and not terminating:
        sender.close(timeout_s=10.0)  # what is not delivered by then stays spooled
    return report


@contextlib.contextmanager
def _quiet_if(stopping: bool) -> Iterator[None]:
    try:
        yield
    except Exception:
        if not stopping:
            raise
        _log.warning("cleanup after the stop failed", exc_info=True)


def _step_ms(durations: Sequence[float]) -> dict[str, float]:
    if not durations:
        return {"median": 0.0, "p90": 0.0}
    ordered = sorted(d * 1000.0 for d in durations)
    p90 = ordered[min(len(ordered) - 1, max(0, round(0.9 * len(ordered)) - 1))]
    return {"median": round(statistics.median(ordered), 3), "p90": round(p90, 3)}


def _write_checkpoint(
    gate: CheckpointGate,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fingerprint: Fingerprint,
    config: TrainConfig,
) -> None:
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

    gate.write(step, writer)


def _open_trace(config: TrainConfig, rank: int) -> Any:
    if config.trace is None or rank != 0:
        return None
    config.trace.parent.mkdir(parents=True, exist_ok=True)
    mode = "a" if config.resume_from is not None and config.trace.exists() else "w"
    return config.trace.open(mode)


def _trace_step(
    trace: Any,
    step: int,
    loss: torch.Tensor,
    capture: _LocalGradientCapture | None,
    params: Sequence[torch.Tensor],
    outcome: StepOutcome | None,
) -> None:
    """One JSON line per step (rank 0 writes): losses and local-gradient fingerprints of every
    rank, rank 0's weights after the step. A diagnostic: one extra collective per step."""
    grad = capture.fingerprint() if capture is not None else torch.zeros(2, dtype=torch.int64)
    row = torch.cat([loss.detach().reshape(1).to(torch.float64).view(torch.int64), grad])
    rows = all_gather_rows(row)
    if trace is None:
        return
    weights = outcome.fingerprint if outcome is not None else weight_fingerprint(params)
    losses = [torch.tensor([r[0]], dtype=torch.int64).view(torch.float64).item() for r in rows]
    trace.write(
        json.dumps(
            {
                "step": step,
                "losses": losses,
                "grad_fingerprints": [to_fingerprint(r[1], r[2]).hex() for r in rows],
                "weight_fingerprint": weights.hex(),
            }
        )
        + "\n"
    )
    trace.flush()


def _write_probe(config: TrainConfig, rank: int, probe: _Probe) -> None:
    mine = {"forward": probe.forward, "backward": probe.backward}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0 or config.probe is None:
        return
    body = {
        "step": config.probe_step,
        "ranks": {str(r): v for r, v in enumerate(everyone)},
        "order": probe.order,
        "kinds": probe.kinds,
    }
    config.probe.parent.mkdir(parents=True, exist_ok=True)
    config.probe.write_text(json.dumps(body, indent=1) + "\n")


# -- the command line -----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdcguard train",
        description="A local DDP job on CPU (gloo) with sdcguard's detection; "
        "prints a one-line summary, writes the report with --report.",
    )
    d = TrainConfig()
    p.add_argument("--world-size", type=int, default=d.world_size, help="rank processes")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=d.ranks_per_node,
        help="ranks per simulated node (node-0, node-1, ...)",
    )
    p.add_argument(
        "--nodes",
        type=lambda s: [n.strip() for n in s.split(",")],
        default=None,
        help="explicit node name per rank, comma-separated (overrides --ranks-per-node)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps, help="steps 0..N-1")
    p.add_argument(
        "--audit-every",
        type=int,
        default=d.audit_every,
        help="ring audit on steps with step %% K == 0 (0: no audit)",
    )
    p.add_argument("--audit-mode", choices=[m.value for m in AuditMode], default=d.audit_mode)
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="KIND@RANK:STEP[:BIT] or KIND@node=NAME[:from=STEP] (repeatable)",
    )
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="checkpoint after steps with step %% C == 0 (0: none)",
    )
    p.add_argument("--resume-from", type=Path, default=None, help="checkpoint file to resume")
    p.add_argument("--webhook", default=None, help=f"alarm webhook URL (secret: ${_SECRET_ENV})")
    p.add_argument("--report", type=Path, default=None, help="write the report JSON here")
    p.add_argument("--plain", action="store_true", help="plain DDP, no sdcguard (baseline)")
    p.add_argument("--job-id", default=None, help="default local-<seed>")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per rank")
    p.add_argument("--trace", type=Path, default=None, help="JSON lines, one per step")
    p.add_argument("--probe-step", type=int, default=None)
    p.add_argument("--probe", type=Path, default=None, help="per-submodule fingerprints")
    p.add_argument("--halt-on-alarm", action="store_true", help="stop after the first alarm")
    abft = p.add_mutually_exclusive_group()
    abft.add_argument(
        "--abft",
        dest="abft",
        action="store_const",
        const=True,
        default=None,
        help="layer checksums on every step (the default)",
    )
    abft.add_argument(
        "--no-abft",
        dest="abft",
        action="store_const",
        const=False,
        help="no layer checksums: the per-step statistics alone",
    )
    p.add_argument(
        "--skip-update-on-alarm",
        action="store_true",
        help="a step the per-step layer finds corrupted updates no weight, on every rank",
    )
    p.add_argument(
        "--defer-decision",
        action="store_true",
        help="decide each step at the end of the next: its all-gather overlaps that step "
        "(alarms name their step, one step later)",
    )
    p.add_argument(
        "--hold-after-halt",
        type=float,
        default=d.hold_after_halt_s,
        metavar="SECONDS",
        help="with --halt-on-alarm: stay alive, training no further, up to SECONDS for a stop",
    )
    return p


def _summary(config: TrainConfig, report: dict[str, Any]) -> str:
    alarms = report["alarms"]
    first = ""
    if alarms:
        a = alarms[0]
        first = (
            f" (first: {a['layer']}/{a['phase']} at step {a['step']}, suspects "
            f"{a['suspect_ranks'] or 'unknown'})"
        )
    ckpts = report["checkpoints"]
    verified = sum(1 for c in ckpts if c["status"] == "verified")
    mode = (
        "plain DDP" if config.plain else f"audit every {config.audit_every} ({config.audit_mode})"
    )
    return (
        f"sdcguard train {config.job}: {report['world_size']} ranks on "
        f"{len(set(report['nodes'].values()))} node(s), {report['steps']} steps, {mode}: "
        f"{len(alarms)} alarm(s){first}, {len(ckpts)} checkpoint(s) ({verified} verified), "
        f"final fingerprint {report['final_fingerprint']}, step "
        f"{report['step_ms']['median']:.1f} ms median"
    )


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGTERM, unwind_on_sigterm)
    except ValueError:  # not the main thread: leave signal handling to the caller
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of a ``sdcguard train`` command line (``SystemExit`` on bad
    options, as argparse does)."""
    args = _parser().parse_args(argv)
    return TrainConfig(
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        nodes=args.nodes,
        seed=args.seed,
        steps=args.steps,
        audit_every=args.audit_every,
        audit_mode=args.audit_mode,
        inject=list(args.inject),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume_from=args.resume_from,
        webhook=args.webhook,
        report=args.report,
        plain=args.plain,
        job_id=args.job_id,
        threads=args.threads,
        trace=args.trace,
        probe_step=args.probe_step,
        probe=args.probe,
        halt_on_alarm=args.halt_on_alarm,
        abft=args.abft,
        skip_update_on_alarm=args.skip_update_on_alarm,
        defer_decision=args.defer_decision,
        hold_after_halt_s=args.hold_after_halt,
    )


def main(argv: list[str] | None = None) -> int:
    """``sdcguard train``. Returns 0 when the job ran (alarms are results, not errors), 2 for
    bad options, 1 when the job failed, 143 when stopped by SIGTERM."""
    try:
        config = parse_config(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2
    try:
        with _sigterm_unwinds():
            report = run(config)
    except HarnessConfigError as err:
        print(f"sdcguard train: {err}", file=sys.stderr)
        return 2
    except HarnessError as err:
        print(f"sdcguard train: failed: {err}", file=sys.stderr)
        return 1
    except Terminated:
        print("sdcguard train: stopped by SIGTERM", file=sys.stderr)
        return _TERMINATED
    print(_summary(config, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
