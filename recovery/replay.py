"""Deep diagnostic replay: recompute a suspect step range on chosen nodes and give a verdict.

A replay is evidence only if it is deterministic: the same checkpoint, micro-batches, RNG state
(dropout), intra-op thread count, library versions and device model as the original. The
verdict therefore first checks that the replay is reproducible (two spare nodes, or the same
spare twice, must agree bit for bit) before it believes any difference between nodes.

Verdicts (DESIGN):
- ``hardware``: the mismatch follows the suspect node — spares agree with each other, the
  suspect node computes something else. The first diverging step is then replayed with a
  per-submodule probe to name the first submodule (and its operation kind) whose forward
  output or gradient differs.
- ``software``: every node computes the same thing but not what training recorded before the
  alarm could have happened (the environment or code differs), or the replays do not even agree
  with each other (nondeterminism): the replay is not evidence against any node.
- ``inconclusive``: no node reproduces a mismatch. A transient fault stays possible; the node is
  *not* cleared by this.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from recovery.errors import PermanentError, TemporaryError
from recovery.replay_batch import nodes_are_machines, replay_all

__all__ = [
    "JobSpec",
    "LocalReplayRunner",
    "ReplayRequest",
    "ReplayResult",
    "ReplayRunner",
    "StepRecord",
    "UserJobTemplate",
    "Verdict",
    "VerdictResult",
    "diagnose",
    "first_diverging_module",
    "first_mismatch",
    "harness_args",
    "load_trace",
]

log = logging.getLogger(__name__)


class Verdict(StrEnum):
    HARDWARE = "hardware"
    SOFTWARE = "software"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class StepRecord:
    """One step of a trace: per-rank losses and local gradient fingerprints, weights after it."""

    step: int
    losses: tuple[float, ...]
    grad_fingerprints: tuple[str, ...]
    weight_fingerprint: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepRecord:
        return cls(
            step=int(raw["step"]),
            losses=tuple(float(x) for x in raw["losses"]),
            grad_fingerprints=tuple(str(x) for x in raw.get("grad_fingerprints", [])),
            weight_fingerprint=str(raw["weight_fingerprint"]),
        )

    def same_as(self, other: StepRecord) -> bool:
        # Bitwise: float equality of the same bits is exact; a replay is evidence only if exact.
        return (
            self.losses == other.losses
            and self.grad_fingerprints == other.grad_fingerprints
            and self.weight_fingerprint == other.weight_fingerprint
        )


@dataclass(frozen=True)
class UserJobTemplate:
    """The user's own job, as read from the cluster: a replay runs *this* (its image, command,
    env and volumes), pinned to one node, with the guard told to trace (detection.replay_mode).

    ``pod_template`` is the pod template of the job's first replica (PyTorchJob ``Master``, or
    the batch/v1 Job's template); ``namespace`` is the job's, where its volumes and secrets are.
    """

    job_name: str
    namespace: str
    pod_template: Mapping[str, Any] = field(repr=False)
    gpus: int = 0


@dataclass(frozen=True)
class JobSpec:
    """What it takes to recompute a job's steps: the harness options that shape the computation,
    or (``template``) the user's own job to run in replay mode."""

    world_size: int
    seed: int
    threads: int = 1
    audit_mode: str = "loss"
    inject: tuple[str, ...] = ()
    template: UserJobTemplate | None = field(default=None, compare=False)

    def persistent_faults(self) -> tuple[str, ...]:
        """Only node-bound faults follow a replay; a transient fault does not recur."""
        return tuple(spec for spec in self.inject if "@node=" in spec)


@dataclass(frozen=True)
class ReplayRequest:
    job_id: str
    checkpoint_uri: str
    checkpoint_step: int
    end: int
    node: str
    spec: JobSpec
    probe_step: int | None = None

    @property
    def start(self) -> int:
        return self.checkpoint_step + 1


@dataclass(frozen=True)
class ReplayResult:
    node: str
    steps: tuple[StepRecord, ...]
    probe: dict[str, Any] | None = None
    log_path: str | None = None


@dataclass(frozen=True)
class VerdictResult:
    verdict: Verdict
    node: str | None
    first_step: int | None
    submodule: str | None = None
    op_kind: str | None = None
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "node": self.node,
            "first_step": self.first_step,
            "submodule": self.submodule,
            "op_kind": self.op_kind,
            "reason": self.reason,
            "detail": self.detail,
        }


class ReplayRunner(Protocol):
    """Runs one replay. A runner whose nodes are separate machines says so with a class
    attribute ``parallel = True``, and a diagnosis then runs its replays of different nodes
    at once (:mod:`recovery.replay_batch`); without it they run one after the other."""

    def replay(self, request: ReplayRequest) -> ReplayResult:
        """Recompute steps ``request.start .. request.end`` on ``request.node``."""
        ...


def harness_args(request: ReplayRequest, *, trace: Path | str, probe: Path | str) -> list[str]:
    """``sdcguard train`` options that recompute ``request``: every rank on the one node, from
    the checkpoint, with the job's own seed, thread count and node-bound (hardware) faults."""
    spec = request.spec
    args = [
        "--world-size", str(spec.world_size),
        "--nodes", ",".join([request.node] * spec.world_size),
        "--seed", str(spec.seed),
        "--steps", str(request.end + 1),
        "--audit-every", "0",
        "--audit-mode", spec.audit_mode,
        "--threads", str(spec.threads),
        "--resume-from", request.checkpoint_uri,
        "--job-id", f"{request.job_id}-replay-{request.node}",
        "--trace", str(trace),
    ]  # fmt: skip
    for fault in spec.persistent_faults():
        args += ["--inject", fault]
    if request.probe_step is not None:
        args += ["--probe-step", str(request.probe_step), "--probe", str(probe)]
    return args


def load_trace(path: Path) -> list[StepRecord]:
    records = []
    with path.open() as fh:
        for line in fh:
            if line.strip():
                records.append(StepRecord.from_dict(json.loads(line)))
    return records


def first_mismatch(a: Sequence[StepRecord], b: Sequence[StepRecord]) -> int | None:
    """The first step present in both traces whose records differ, or None."""
    by_step = {r.step: r for r in b}
    for record in sorted(a, key=lambda r: r.step):
        other = by_step.get(record.step)
        if other is not None and not record.same_as(other):
            return record.step
    return None


def first_diverging_module(
    probe_a: dict[str, Any], probe_b: dict[str, Any]
) -> tuple[str, str, str] | None:
    """(module, direction, op kind) of the first submodule, in execution order, whose forward
    output (then gradient) differs on any rank between two probes of the same step."""
    order: list[str] = list(probe_a.get("order") or [])
    kinds: dict[str, str] = dict(probe_a.get("kinds") or {})
    ranks_a: dict[str, Any] = probe_a.get("ranks", {})
    ranks_b: dict[str, Any] = probe_b.get("ranks", {})
    for direction, modules in (("forward", order), ("backward", list(reversed(order)))):
        for name in modules:
            for rank, rec_a in sorted(ranks_a.items()):
                rec_b = ranks_b.get(rank, {})
                va = rec_a.get(direction, {}).get(name)
                vb = rec_b.get(direction, {}).get(name)
                if va is not None and vb is not None and va != vb:
                    return name, direction, kinds.get(name, "unknown")
    return None


def diagnose(
    runner: ReplayRunner,
    base: ReplayRequest,
    suspect_nodes: Sequence[str],
    spare_nodes: Sequence[str],
    *,
    reference: Sequence[StepRecord] | None = None,
    alarm_step: int | None = None,
) -> VerdictResult:
    """Replay ``base`` on the spares and on every suspect node and decide who is at fault.

    Invariant: a node is named only when (1) the replay is reproducible — the two spare runs
    agree bit for bit — and (2) the suspect's replay differs from the spares'.

    A runner whose nodes are separate machines (``parallel``) replays in two rounds, the
    replays of different nodes at once (:func:`~recovery.replay_batch.replay_all`): the spares
    and every suspect, then the probes of the first differing suspect's first diverging step
    on it and on a spare. Any other replays one by one, each suspect only once the spares
    agree. The verdict reads the replays in the same order either way.
    """
    if not spare_nodes:
        raise PermanentError("replay", "diagnose", base.job_id, "no spare node to compare against")
    spare_a_node = spare_nodes[0]
    spare_b_node = spare_nodes[1] if len(spare_nodes) > 1 else spare_nodes[0]
    # Where the nodes are separate machines, the suspects replay beside the spares (one round);
    # elsewhere each suspect only once the spares agree, and only until one differs.
    at_once = nodes_are_machines(runner)
    first = replay_all(
        runner,
        [
            replace(base, node=node, probe_step=None)
            for node in (spare_a_node, spare_b_node, *(suspect_nodes if at_once else ()))
        ],
    )
    spare_a, spare_b = first[0], first[1]
    on_suspects: Iterator[ReplayResult] = (
        iter(first[2:])
        if at_once
        else (runner.replay(replace(base, node=s, probe_step=None)) for s in suspect_nodes)
    )
    replayed = {spare_a_node: _summary(spare_a)}
    nondet = first_mismatch(spare_a.steps, spare_b.steps)
    if nondet is not None:
        return VerdictResult(
            Verdict.SOFTWARE,
            node=None,
            first_step=nondet,
            reason=(
                f"replays on healthy spares {spare_a_node} and {spare_b_node} disagree from step "
                f"{nondet}: the computation is not deterministic, so no replay is evidence"
            ),
            detail={"replays": replayed},
        )

    for suspect, result in zip(suspect_nodes, on_suspects, strict=True):
        replayed[suspect] = _summary(result)
        step = first_mismatch(result.steps, spare_a.steps)
        if step is None:
            continue
        probe_s, probe_p = replay_all(
            runner,
            [
                replace(base, node=suspect, end=step, probe_step=step),
                replace(base, node=spare_a_node, end=step, probe_step=step),
            ],
        )
        where = None
        if probe_s.probe is not None and probe_p.probe is not None:
            where = first_diverging_module(probe_s.probe, probe_p.probe)
        module, direction, kind = where if where else (None, None, None)
        return VerdictResult(
            Verdict.HARDWARE,
            node=suspect,
            first_step=step,
            submodule=module,
            op_kind=kind,
            reason=(
                f"the mismatch follows {suspect}: spares agree, {suspect} differs from step {step}"
                + (f", first in {module} ({kind}, {direction})" if module else "")
            ),
            detail={"replays": replayed, "direction": direction},
        )

    if reference:
        step = first_mismatch(spare_a.steps, reference)
        if step is not None and (alarm_step is None or step < alarm_step):
            return VerdictResult(
                Verdict.SOFTWARE,
                node=None,
                first_step=step,
                reason=(
                    f"every node computes the same result, and it differs from the training "
                    f"record at step {step}, before the alarm: the environment or code differs"
                ),
                detail={"replays": replayed},
            )
        if step is not None:
            return VerdictResult(
                Verdict.INCONCLUSIVE,
                node=None,
                first_step=step,
                reason=(
                    f"training diverged at step {step} but no node reproduces it: a transient "
                    "fault stays possible; the suspect node is not cleared"
                ),
                detail={"replays": replayed},
            )
    return VerdictResult(
        Verdict.INCONCLUSIVE,
        node=None,
        first_step=None,
        reason="no mismatch on any node: the suspect node is not cleared (a transient fault?)",
        detail={"replays": replayed},
    )


def _summary(result: ReplayResult) -> dict[str, Any]:
    last = result.steps[-1] if result.steps else None
    return {
        "steps": len(result.steps),
        "final_weight_fingerprint": last.weight_fingerprint if last else None,
    }


class LocalReplayRunner:
    """Replays as ``sdcguard train --resume-from …`` processes with every rank on one simulated
    node, so a persistent ``KIND@node=NAME`` fault of that node's hardware applies to the replay
    exactly as it did to training.

    Its simulated nodes share this host's cores, and a replay's ranks step in lockstep: run side
    by side, several replays would only slow each other down, so they run one after the other
    (no ``parallel``)."""

    def __init__(
        self,
        workdir: Path,
        *,
        command: Sequence[str] | None = None,
        timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        on_launch: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._workdir = workdir
        self._command = list(command or [sys.executable, "-m", "detection.harness"])
        self._timeout_s = timeout_s
        self._env = env
        self._on_launch = on_launch

    def replay(self, request: ReplayRequest) -> ReplayResult:
        self._workdir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"replay-{request.node}-", dir=self._workdir))
        trace = out / "trace.jsonl"
        probe = out / "probe.json"
        args = harness_args(request, trace=trace, probe=probe)
        argv = [*self._command, *args]
        if self._on_launch is not None:
            self._on_launch(argv)
        log_path = out / "replay.log"
        extra = {"job": request.job_id, "node": request.node}
        log.info("replaying steps %d..%d", request.start, request.end, extra=extra)
        env = {**os.environ, **(self._env or {})}
        try:
            with log_path.open("wb") as fh:
                proc = subprocess.run(
                    argv, stdout=fh, stderr=subprocess.STDOUT, timeout=self._timeout_s, env=env
                )
        except subprocess.TimeoutExpired as err:
            raise TemporaryError(
                "replay", "run", request.node, f"timed out after {self._timeout_s} s"
            ) from err
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise PermanentError(
                "replay", "run", request.node, f"exit code {proc.returncode}: {tail}"
            )
        steps = tuple(r for r in load_trace(trace) if r.step >= request.start)
        probe_data = json.loads(probe.read_text()) if probe.exists() else None
        return ReplayResult(request.node, steps, probe_data, str(log_path))
