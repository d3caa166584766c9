"""Checkpoint gate: a checkpoint is trusted only on evidence gathered after it was taken.

A checksum of a checkpoint file proves only that the bytes were stored faithfully — including
wrong weights. So every checkpoint is written ``pending`` and becomes ``verified`` only when a
ring audit at or after its step passed with no alarm in between (DESIGN, checkpoint provenance).
A job without ring audits (``audit_every=0``) may count a passed fingerprint vote instead; the
record's ``evidence`` then says it is the weaker kind: a vote shows the replicas agree, not that
what they agree on was computed right.

After an alarm the gate closes: every pending checkpoint is quarantined (and posted to the
ledger again as quarantined), checkpoints written later are quarantined at once, nothing
becomes verified, and :meth:`CheckpointGate.publish` refuses with :class:`GateClosedError`
until :meth:`CheckpointGate.reopen` after recovery.

Provenance goes to the ledger in an order that lets it draw the same conclusions: a checkpoint is
posted before the audit that verifies it (an audit at step s is held back until checkpoint s,
if one is due, has been posted).

A sharded model's checkpoint (:meth:`CheckpointGate.write_sharded`) is written by every rank
through ``torch.distributed.checkpoint`` and sealed by a manifest
(:mod:`detection.weights.sharded_checkpoint`); its record carries the sha256 of the manifest and
the sharding-invariant fingerprint, which any mesh (or DDP) that loads it must show again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from detection.audit.ring import AuditMode
from detection.transport.alarm import Alarm
from detection.weights.fingerprint import Fingerprint

__all__ = [
    "CheckpointGate",
    "CheckpointNotVerifiedError",
    "CheckpointRecord",
    "CheckpointStatus",
    "GateClosedError",
    "GateError",
    "ProvenanceSink",
    "StepOutcome",
    "checkpoint_path",
    "sharded_checkpoint_path",
    "state_path",
]

_log = logging.getLogger(__name__)


class CheckpointStatus(StrEnum):
    PENDING = "pending"
    VERIFIED = "verified"
    QUARANTINED = "quarantined"


class GateError(RuntimeError):
    """The gate was used against its contract (see the subclasses for the refusals)."""


class GateClosedError(GateError):
    """An alarm is open: nothing is published as verified until recovery."""

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(
            f"checkpoint gate closed by the {alarm.layer}/{alarm.phase} alarm at step "
            f"{alarm.step}: nothing is published as verified until recovery"
        )
        self.alarm = alarm


class CheckpointNotVerifiedError(GateError):
    """The requested checkpoint has no evidence (pending) or is quarantined."""


class ProvenanceSink(Protocol):
    """Where provenance goes (the alarm sender on rank 0)."""

    def record_checkpoint(self, body: dict[str, Any]) -> Any: ...

    def record_audit(self, body: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class StepOutcome:
    """What the guard decided at the end of one step, identically on every rank.

    ``fingerprint`` is this rank's weight fingerprint after the step (what it would write).
    ``audit`` is the ring-audit mode if an audit ran this step.
    """

    step: int
    ranks: tuple[int, ...]
    fingerprint: Fingerprint
    vote_passed: bool
    audit: AuditMode | None = None
    audit_passed: bool = False
    alarm: Alarm | None = None


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    uri: str
    sha256: str
    fingerprint: str
    status: CheckpointStatus
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_report(self) -> dict[str, Any]:
        """The DESIGN report entry."""
        return {
            "step": self.step,
            "uri": self.uri,
            "sha256": self.sha256,
            "fingerprint": self.fingerprint,
            "status": str(self.status),
        }


def checkpoint_path(directory: Path, step: int) -> Path:
    """``<dir>/ckpt-<step:06d>.pt`` — the state after step ``step``."""
    return directory / f"ckpt-{step:06d}.pt"


def sharded_checkpoint_path(directory: Path, step: int) -> Path:
    """``<dir>/ckpt-<step:06d>/`` — the sharded checkpoint (a directory sealed by its
    ``manifest.json``, :mod:`detection.weights.sharded_checkpoint`) of the state after ``step``."""
    return directory / f"ckpt-{step:06d}"


def state_path(checkpoint: Path | str) -> Path:
    """Where the guard's state of a checkpoint file lies (:mod:`detection.guard.state`): beside
    it, ``ckpt-000120.pt`` → ``ckpt-000120.sdcguard.pt``; a sharded checkpoint's directory
    ``ckpt-000120/`` → ``ckpt-000120.sdcguard.pt`` too."""
    path = Path(checkpoint)
    return path.with_name(path.stem + _GUARD_STATE_SUFFIX)


_GUARD_STATE_SUFFIX = ".sdcguard.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointGate:
    """Checkpoint provenance of one job (kept by the rank that writes checkpoints).

    Invariant: a record is ``verified`` only if a passed audit (or, without audits, a passed
    vote) at a step ≥ its own was observed while the gate was open and after the record was
    pending; once closed, no record changes to ``verified`` until :meth:`reopen`.

    ``directory``: where checkpoints are written (a ``Path`` or a ``str``). ``sink``: where
    provenance goes — normally the rank's :class:`~detection.transport.sender.AlarmSender`, which
    posts
    each checkpoint (``POST /v1/jobs/{job}/checkpoints``, with ``status: quarantined`` once the
    gate quarantined it) and each audit (``POST /v1/jobs/{job}/audits``) to the webhook, so the
    ledger draws the same conclusions; ``None`` keeps provenance local to this process.
    ``nodes``: the job's nodes, recorded with each checkpoint.
    """

    def __init__(
        self,
        directory: Path | str | None,
        *,
        audit_every: int,
        nodes: Sequence[str] = (),
        sink: ProvenanceSink | None = None,
        job_id: str = "local",
        uri_prefix: str | None = None,
    ) -> None:
        self.directory = Path(directory) if directory is not None else None
        # Where the control plane reads the files (s3://… or file://… on shared storage); the
        # recorded uri is <uri_prefix>/<file name>, else the local absolute path.
        self.uri_prefix = uri_prefix
        self.audit_every = audit_every
        self.nodes = list(nodes)
        self.job_id = job_id
        self._sink = sink
        self._records: dict[int, CheckpointRecord] = {}
        self._alarm: Alarm | None = None
        self._last: StepOutcome | None = None
        self._held_audit: dict[str, Any] | None = None
        self._guard_state: Callable[[], dict[str, Any]] | None = None

    def bind_guard_state(self, state: Callable[[], dict[str, Any]]) -> None:
        """Write ``state()`` (the guard's learnt state, :mod:`detection.guard.state`) beside
        every checkpoint: ``ckpt-<step>.sdcguard.pt``, with the step and fingerprint it belongs
        to. The guard binds itself when given the gate."""
        self._guard_state = state

    # -- state ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._alarm is not None

    @property
    def records(self) -> tuple[CheckpointRecord, ...]:
        return tuple(self._records[s] for s in sorted(self._records))

    def latest_verified(self) -> CheckpointRecord | None:
        verified = [r for r in self.records if r.status is CheckpointStatus.VERIFIED]
        return verified[-1] if verified else None

    # -- evidence ---------------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        """Feed the guard's decision for one step (called by the guard)."""
        self._post_held_audit()
        self._last = outcome
        if outcome.alarm is not None:
            self._close(outcome.alarm)
        elif not self.closed:
            evidence = self._evidence(outcome)
            if evidence is not None:
                for step, record in list(self._records.items()):
                    if record.status is CheckpointStatus.PENDING and step <= outcome.step:
                        self._set(
                            replace(record, status=CheckpointStatus.VERIFIED, evidence=evidence)
                        )
        if outcome.audit is not None:
            self._held_audit = {
                "step": outcome.step,
                "kind": str(outcome.audit),
                "ranks": list(outcome.ranks),
                "passed": outcome.audit_passed and outcome.alarm is None,
            }

    def _evidence(self, outcome: StepOutcome) -> dict[str, Any] | None:
        if outcome.audit is not None and outcome.audit_passed and outcome.vote_passed:
            return {"kind": str(outcome.audit), "step": outcome.step}
        if self.audit_every == 0 and outcome.vote_passed:
            return {
                "kind": "fingerprint",
                "step": outcome.step,
                "weaker": True,
                "note": "no ring audits in this job: a passed fingerprint vote shows the "
                "replicas agree, not that their computation was right",
            }
        return None

    def _close(self, alarm: Alarm) -> None:
        if self._alarm is None:
            self._alarm = alarm
        for record in list(self._records.values()):
            if record.status is CheckpointStatus.PENDING:
                quarantined = replace(
                    record,
                    status=CheckpointStatus.QUARANTINED,
                    evidence={"alarm_step": alarm.step, "layer": str(alarm.layer)},
                )
                self._set(quarantined)
                self._post_checkpoint(quarantined)
        _log.warning("checkpoint gate closed", extra={"job": self.job_id, "step": alarm.step})

    def _set(self, record: CheckpointRecord) -> None:
        self._records[record.step] = record
        _log.info(
            "checkpoint %s",
            record.status,
            extra={"job": self.job_id, "step": record.step, "uri": record.uri},
        )

    # -- writing and publishing --------------------------------------------------------------------
    def write(
        self, step: int, writer: Callable[[Path], None], *, uri: str | None = None
    ) -> CheckpointRecord:
        """Write the state after ``step`` atomically and record it.

        ``writer(path)`` must write the whole checkpoint to ``path`` (a temporary file in the
        same directory); the gate syncs it, hashes it and renames it into place, so a reader never
        sees a partial file. ``uri``: where the control plane will read the file (the job copies
        it there); default ``<uri_prefix>/<file name>``, or the local path without a prefix.
        Must be called right after the guard decided ``step`` — that is the
        state whose fingerprint the record carries (a guard that defers its decision decides
        it at ``guard.flush()``).
        """
        directory = self._require_directory()
        last = self._require_decided(step)
        # taken once the step is decided (checked above): the state that step left
        guard_state = self._guard_state() if self._guard_state is not None else None
        directory.mkdir(parents=True, exist_ok=True)
        final = checkpoint_path(directory, step)
        temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            writer(temp)
            with temp.open("rb+") as fh:
                os.fsync(fh.fileno())
            digest = _sha256(temp)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        self._beside(final, guard_state, last)
        return self._record(step, uri or self._uri(final), digest, last)

    def write_sharded(
        self, step: int, state: dict[str, Any], *, uri: str | None = None
    ) -> CheckpointRecord:
        """Collective, on every rank (each holds a gate observing the same guard decisions):
        write ``state`` — DTensors and tensors, e.g. ``{"model": …, "optim": …}`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` — through
        ``torch.distributed.checkpoint`` as ``<dir>/ckpt-<step:06d>/``, sealed by its
        ``manifest.json`` (:mod:`detection.weights.sharded_checkpoint`), and record it.

        Every rank returns the same record: ``uri`` the manifest's (default
        ``<uri_prefix>/ckpt-<step>/manifest.json``, or the local path), ``sha256`` the manifest
        bytes', ``fingerprint`` the sharding-invariant fingerprint the guard decided for
        ``step`` (any mesh, or DDP, that loads it must show the same in ``verify_loaded``);
        status and evidence as for :meth:`write`. Only rank 0's gate may hold a sink (one post
        to the ledger a checkpoint); rank 0 writes the guard's state beside the directory
        (``ckpt-<step>.sdcguard.pt``). Must be called right after the guard decided ``step``.
        """
        from detection.weights.sharded_checkpoint import (
            MANIFEST_NAME,
            every_rank,
            save_sharded,
        )

        rank, reasons = every_rank(self._refusal(step))
        refused = [f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason]
        if refused:  # on every rank alike, before any rank writes: none waits for another
            raise GateError(f"sharded checkpoint of step {step} refused: " + "; ".join(refused))
        directory = self._require_directory()
        last = self._require_decided(step)
        guard_state = self._guard_state() if self._guard_state is not None else None
        final = sharded_checkpoint_path(directory, step)
        digest = save_sharded(final, state)
        if rank == 0:
            self._beside(final, guard_state, last)
        return self._record(step, uri or self._uri(final / MANIFEST_NAME), digest, last)

    def _refusal(self, step: int) -> str | None:
        """Why this rank's gate must not write a sharded checkpoint of ``step`` (``None``: it
        may): no directory, ``step`` not the step just decided, or a sink on a rank but 0."""
        import torch.distributed as dist

        try:
            self._require_directory()
            self._require_decided(step)
        except GateError as err:
            return str(err)
        if self._sink is not None and dist.is_initialized() and dist.get_rank() != 0:
            return (
                "its gate has a provenance sink: a sharded checkpoint is posted by rank 0's "
                "gate alone (give the other ranks' gates sink=None)"
            )
        return None

    def _require_directory(self) -> Path:
        if self.directory is None:
            raise GateError("this gate has no checkpoint directory")
        return self.directory

    def _require_decided(self, step: int) -> StepOutcome:
        """The guard's outcome of ``step``: a checkpoint is written right after its decision,
        so the recorded fingerprint is the written state's."""
        if self._last is None or self._last.step != step:
            seen = None if self._last is None else self._last.step
            raise GateError(
                f"checkpoint of step {step} written after the guard decided step "
                f"{seen}: the recorded fingerprint would not match the file"
                + (
                    " (with GuardConfig(defer_decision=True) call guard.flush() on every rank "
                    "first: it decides the step just run)"
                    if seen is None or seen < step
                    else ""
                )
            )
        return self._last

    def _uri(self, path: Path) -> str:
        """``<uri_prefix>/<path relative to the directory>``, or the local absolute path."""
        assert self.directory is not None
        if self.uri_prefix:
            return f"{self.uri_prefix.rstrip('/')}/{path.relative_to(self.directory).as_posix()}"
        return str(path.resolve())

    def _beside(
        self, checkpoint: Path, guard_state: dict[str, Any] | None, last: StepOutcome
    ) -> None:
        """The guard's state beside ``checkpoint`` — tied to it by the weights' fingerprint
        (read_state's caller checks) — and the directory's entries made durable."""
        if guard_state is not None:
            fingerprint = last.fingerprint.hex()
            self._write_guard_state(checkpoint, {**guard_state, "fingerprint": fingerprint})
        assert self.directory is not None
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _record(self, step: int, uri: str, digest: str, last: StepOutcome) -> CheckpointRecord:
        """Record the checkpoint just written, with the status the evidence so far gives it,
        and post it (and, without audits, the vote that verified it) to the ledger."""
        if self.closed:
            status = CheckpointStatus.QUARANTINED
            assert self._alarm is not None
            evidence: dict[str, Any] = {
                "alarm_step": self._alarm.step,
                "layer": str(self._alarm.layer),
            }
        else:
            found = self._evidence(last)
            status = CheckpointStatus.VERIFIED if found else CheckpointStatus.PENDING
            evidence = found or {}
        record = CheckpointRecord(
            step=step,
            uri=uri,
            sha256=digest,
            fingerprint=last.fingerprint.hex(),
            status=status,
            evidence=evidence,
        )
        self._set(record)
        self._post_checkpoint(record)
        if self._sink is not None and self.audit_every == 0 and status is CheckpointStatus.VERIFIED:
            self._sink.record_audit(
                {
                    "step": step,
                    "kind": "fingerprint",
                    "ranks": list(last.ranks),
                    "passed": True,
                }
            )
        self._post_held_audit()
        return record

    @staticmethod
    def _write_guard_state(checkpoint: Path, state: dict[str, Any]) -> None:
        """``state`` beside ``checkpoint``, atomically (a reader sees all of it or none)."""
        import torch

        final = state_path(checkpoint)
        temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            torch.save(state, temp)
            with temp.open("rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)

    def _post_checkpoint(self, record: CheckpointRecord) -> None:
        """Tell the ledger about ``record``: as written (the ledger starts it ``pending``), or
        — once the gate holds it quarantined — again with ``status: quarantined``, so the
        ledger never keeps a checkpoint pending that an alarm already condemned."""
        if self._sink is None:
            return
        body: dict[str, Any] = {
            "step": record.step,
            "uri": record.uri,
            "sha256": record.sha256,
            "fingerprint": record.fingerprint,
            "nodes": self.nodes,
        }
        if record.status is CheckpointStatus.QUARANTINED:
            body["status"] = str(CheckpointStatus.QUARANTINED)
        self._sink.record_checkpoint(body)

    def publish(self, step: int | None = None) -> CheckpointRecord:
        """The checkpoint to publish as verified (the newest, or the one at ``step``).

        Raises :class:`GateClosedError` while an alarm is open and
        :class:`CheckpointNotVerifiedError` for a pending or quarantined checkpoint.
        """
        if self._alarm is not None:
            raise GateClosedError(self._alarm)
        if step is None:
            record = self.latest_verified()
            if record is None:
                raise CheckpointNotVerifiedError("no checkpoint has been verified yet")
            return record
        record = self._records.get(step)
        if record is None:
            raise CheckpointNotVerifiedError(f"no checkpoint at step {step}")
        if record.status is not CheckpointStatus.VERIFIED:
            raise CheckpointNotVerifiedError(f"checkpoint at step {step} is {record.status}")
        return record

    def reopen(self) -> None:
        """Recovery is done (resumed from a verified checkpoint): accept evidence again.
        Quarantined records stay quarantined."""
        self._alarm = None

    def flush(self) -> None:
        """Post an audit still held back (call before the job ends)."""
        self._post_held_audit()

    def _post_held_audit(self) -> None:
        if self._held_audit is not None and self._sink is not None:
            self._sink.record_audit(self._held_audit)
        self._held_audit = None
