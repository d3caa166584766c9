"""Alarms: store each once, attach it to its job's open incident, widen that incident.

Invariants: an alarm is never lost (an unknown job is created) and never stored twice (its id
is the key); the same id with different content is refused (:class:`db.errors.AlarmConflict`),
never taken for a duplicate; a job has at most one open incident, and its suspect range always
covers every alarm stored for it. Its suspect nodes cover every suspect node *in the job's rank
map*: a node an alarm names that the job does not run on is kept as evidence
(``outside_rank_map`` of the alarm and the incident) and never becomes a suspect, so no stage
acts on it. A batch has exactly the outcomes of recording its alarms one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import Table, exists, func, insert, select
from sqlalchemy.orm import Session

from db.enums import IncidentState
from db.errors import AlarmConflict, InvalidValue
from db.ledger._base import LedgerBase, _log
from db.ledger._queries import _active_incidents, _chunks, _evidence_kinds, _new_incident
from db.ledger._validate import _as_utc, _validate_alarm
from db.ledger.nonces import NonceClaim, NonceReused, claim_in, prune_nonces, validate_claims
from db.models import AlarmRow, AuditRow, IncidentRow, JobRow, RankRow
from db.views import AlarmIn, AlarmOutcome


class AlarmsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s alarm methods."""

    def record_alarm(self, alarm: AlarmIn) -> AlarmOutcome:
        """Store an alarm and attach it to the job's open incident, opening one if needed.

        Idempotent by ``alarm_id``: a re-sent alarm returns its incident with
        ``duplicate=True``. An alarm is never lost: an unknown job is created, and an incident
        opened for a job without registered ranks is flagged ``ranks_missing``. Each alarm
        widens its incident: the suspect range runs from just after the latest passed audit
        before the earliest alarm step (or step 0) to the latest alarm step. A batch of one:
        see :meth:`record_alarms`.
        """
        _validate_alarm(alarm)
        [outcome] = self._write("record_alarm", lambda s: self._record_alarms(s, [alarm]))
        _log.info(
            "alarm recorded",
            extra={
                "job": alarm.job_id,
                "incident": outcome.incident_id,
                "step": alarm.step,
                "rank": alarm.rank,
                "node": alarm.node,
                "duplicate": outcome.duplicate,
                "opened": outcome.opened,
            },
        )
        return outcome

    def record_alarms(self, alarms: Sequence[AlarmIn]) -> list[AlarmOutcome]:
        """Record many alarms in one transaction; outcome ``i`` belongs to ``alarms[i]``.

        The outcomes, incidents and suspect ranges are exactly those of calling
        :meth:`record_alarm` on each alarm in order: an alarm id seen before (stored, or earlier
        in the batch) is a duplicate of the first one; the first new alarm of a job without an
        open incident opens it (``opened=True``), every later one attaches. All or nothing: one
        invalid alarm refuses the whole batch before anything is written (check each with
        :meth:`validate_alarm` first to refuse it alone), and a database error rolls all of it
        back.

        This is what an alarm storm needs: one lock per job, a fixed number of statements and
        one commit per batch, instead of one transaction serialised on the job row per alarm.
        """
        batch = list(alarms)
        for index, alarm in enumerate(batch):
            try:
                _validate_alarm(alarm)
            except InvalidValue as err:
                raise InvalidValue(f"alarm {index} of the batch: {err}") from err
        if not batch:
            return []
        outcomes = self._write("record_alarms", lambda s: self._record_alarms(s, batch))
        _log_batch(batch, outcomes)
        return outcomes

    def record_fresh_alarms(
        self,
        alarms: Sequence[AlarmIn],
        nonces: Sequence[NonceClaim | None],
        *,
        keep: timedelta,
        prune: bool = False,
    ) -> list[AlarmOutcome | NonceReused]:
        """:meth:`record_alarms` for requests, each alarm recorded only if its nonce is fresh.

        ``nonces[i]`` is the ``(nonce, key_id)`` of the request that carried ``alarms[i]``
        (``None``: a request without one, always fresh). In the same transaction as the alarms,
        each nonce is claimed (:func:`db.ledger.nonces.claim_in`); an alarm whose nonce was
        claimed before — by an earlier request, or earlier in this batch — is not recorded and
        its outcome is :class:`NonceReused`. So a nonce is consumed exactly when its alarm's
        outcome commits: a batch that fails or rolls back consumes none, and a replay of it is
        answered as the original would be. ``prune`` also deletes nonces older than ``keep``
        (table size only; a claim takes an expired nonce over anyway).

        One transaction instead of two per batch: the claim costs one statement in the
        transaction the alarms need anyway, not a commit of its own.
        """
        batch = list(alarms)
        claims = list(nonces)
        if len(claims) != len(batch):
            raise InvalidValue("one nonce (or None) per alarm")
        for index, alarm in enumerate(batch):
            try:
                _validate_alarm(alarm)
            except InvalidValue as err:
                raise InvalidValue(f"alarm {index} of the batch: {err}") from err
        validate_claims([claim for claim in claims if claim is not None])
        if not batch:
            return []

        def work(s: Session) -> tuple[list[AlarmIn], list[AlarmOutcome | NonceReused]]:
            now = self._clock()
            if prune:
                prune_nonces(s, now - keep)
            # Claimed first, before any job row is locked: one lock order for every claimer.
            fresh = iter(claim_in(s, [c for c in claims if c is not None], now, keep))
            taken = [claim is None or next(fresh) for claim in claims]
            kept = [alarm for alarm, ok in zip(batch, taken, strict=True) if ok]
            recorded = iter(self._record_alarms(s, kept) if kept else [])
            results: list[AlarmOutcome | NonceReused] = []
            for claim, ok in zip(claims, taken, strict=True):
                if ok:
                    results.append(next(recorded))
                else:
                    assert claim is not None
                    results.append(NonceReused(*claim))
            return kept, results

        kept, results = self._write("record_alarms", work)
        _log_batch(kept, [r for r in results if isinstance(r, AlarmOutcome)])
        replays = len(results) - len(kept)
        if replays:
            _log.warning("replayed alarm requests refused", extra={"replays": replays})
        return results

    @staticmethod
    def validate_alarm(alarm: AlarmIn) -> None:
        """Raise :class:`InvalidValue` for an alarm the ledger would refuse; writes nothing.

        A caller that batches alarms from many senders checks each one here first, so that one
        bad alarm is refused on its own instead of failing the batch it would have joined.
        """
        _validate_alarm(alarm)

    def _record_alarms(self, s: Session, batch: Sequence[AlarmIn]) -> list[AlarmOutcome]:
        """The body of :meth:`record_alarms`: set-based, a fixed number of round trips.

        Statements per batch: lock (or create) the jobs of the alarms, in id order so that
        concurrent batches cannot deadlock; look up the stored ids (the locks serialised us
        behind any rival recording them, so one look-up is enough); lock the open incidents;
        open the missing ones; widen each incident once; one executemany INSERT of the new alarms.
        """
        jobs = sorted({alarm.job_id for alarm in batch})
        self._lock_jobs(s, jobs)
        # Looked up once, under the jobs' locks: a rival recording the same ids has committed
        # by now, so what is not stored here is new.
        stored = _stored_alarm_incidents(s, [alarm.alarm_id for alarm in batch], batch)
        fresh: dict[str, AlarmIn] = {}  # first copy of each new id: later copies are duplicates
        for alarm in batch:
            if alarm.alarm_id not in stored:
                first = fresh.setdefault(alarm.alarm_id, alarm)
                _same_alarm(alarm.alarm_id, _content(first), alarm)
        if not fresh:
            return [AlarmOutcome(stored[a.alarm_id], duplicate=True, opened=False) for a in batch]
        incidents = _active_incidents(s, jobs)
        job_nodes = _job_nodes(s, jobs, list(fresh.values()))
        now = self._clock()
        outcomes: list[AlarmOutcome] = []
        growth: dict[str, _Growth] = {}
        rows: list[dict[str, Any]] = []
        for alarm in batch:
            known = stored.get(alarm.alarm_id)
            if known is not None:
                outcomes.append(AlarmOutcome(known, duplicate=True, opened=False))
                continue
            nodes = [str(n) for n in alarm.suspect_nodes]
            suspects, outside = _split_by_rank_map(alarm, nodes, job_nodes.get(alarm.job_id))
            incident = incidents.get(alarm.job_id)
            opened = incident is None
            if incident is None:
                incident = _new_incident(
                    s,
                    alarm.job_id,
                    now=self._clock(),
                    start=0,
                    end=alarm.step,
                    suspect_nodes=suspects,
                    reason=f"alarm {alarm.alarm_id} at step {alarm.step}",
                )
                incidents[alarm.job_id] = incident
            grown = growth.get(incident.id)
            if grown is None:
                grown = growth[incident.id] = _Growth(incident, opened, alarm.step, alarm.step)
            grown.add(alarm.step, suspects)
            grown.outside.update(outside)
            if outside:
                _log.warning(
                    "alarm names nodes outside the job's rank map; kept as evidence only",
                    extra={"job": alarm.job_id, "alarm": alarm.alarm_id, "nodes": outside},
                )
            stored[alarm.alarm_id] = incident.id  # a later copy in this batch is a duplicate
            rows.append(
                {
                    "id": alarm.alarm_id,
                    "job_id": alarm.job_id,
                    "incident_id": incident.id,
                    "step": alarm.step,
                    "rank": alarm.rank,
                    "node": alarm.node,
                    "layer": alarm.layer,
                    "phase": alarm.phase,
                    "suspect_ranks": [int(r) for r in alarm.suspect_ranks],
                    "suspect_nodes": nodes,
                    "detail": dict(alarm.detail),
                    "sent_at": None if alarm.sent_at is None else _as_utc(alarm.sent_at),
                    "received_at": now,
                    "outside_rank_map": outside,
                }
            )
            outcomes.append(AlarmOutcome(incident.id, duplicate=False, opened=opened))
        for grown in growth.values():  # before the INSERT: it asks about earlier alarms only
            self._widen(s, grown)
        if rows:  # empty when a rival stored every one of them while we waited for the lock
            # A Core INSERT of the table (one executemany), not the ORM's bulk path: these rows
            # are never loaded as objects, and in a storm the ORM's per-row work cost more CPU
            # than the database did.
            s.execute(insert(_ALARMS), rows)
        return outcomes

    def _lock_jobs(self, s: Session, job_ids: Sequence[str]) -> None:
        """Lock the jobs' rows in id order, creating the missing ones (``job_ids`` sorted).

        A rival creating the same job at the same moment ends in a unique violation on flush;
        :meth:`_write` re-runs the transaction, which then finds and locks the winner's row.
        """
        found: set[str] = set()
        for chunk in _chunks(job_ids):
            found.update(
                s.scalars(
                    select(JobRow.id)
                    .where(JobRow.id.in_(chunk))
                    .order_by(JobRow.id)
                    .with_for_update()
                )
            )
        missing = [job_id for job_id in job_ids if job_id not in found]
        if missing:
            now = self._clock()
            s.add_all(JobRow(id=job_id, created_at=now) for job_id in missing)
            s.flush()
            _log.debug("job rows added", extra={"jobs": missing})

    def _widen(self, s: Session, grown: _Growth) -> None:
        """Grow the incident's range and nodes by the alarms of this batch, incrementally.

        Invariant: the incident's stored range and nodes already cover every alarm stored
        before, so the new alarms only extend the end (max) and the nodes (union). The start is
        ``latest passed audit strictly before the earliest alarm step, + 1`` (else 0) and never
        moves up; it is recomputed only when the earliest alarm step moves down — a start of 0
        cannot move at all, and otherwise one indexed EXISTS asks whether an earlier alarm of
        the incident already lies at or before the batch's earliest step. No alarm is re-read.
        So evidence recorded after the earliest alarm (a later audit, or a job's first ring
        audit demoting its fingerprint votes) never moves the start; an earlier alarm does.
        """
        incident = grown.incident
        if grown.opened:
            incident.suspect_start = _suspect_start(s, incident.job_id, grown.first)
            incident.suspect_end = grown.last
            incident.suspect_nodes = sorted(grown.nodes)
        else:
            if incident.suspect_start > 0 and not _has_alarm_at_or_before(s, incident, grown.first):
                incident.suspect_start = min(
                    incident.suspect_start, _suspect_start(s, incident.job_id, grown.first)
                )
            incident.suspect_end = max(incident.suspect_end, grown.last)
            nodes = grown.nodes.union(incident.suspect_nodes)
            if nodes != set(incident.suspect_nodes):
                incident.suspect_nodes = sorted(nodes)
        outside = grown.outside.union(incident.outside_rank_map or [])
        if outside != set(incident.outside_rank_map or []):
            incident.outside_rank_map = sorted(outside)
        incident.updated_at = self._clock()  # flushed with the batch: one UPDATE per incident


def _log_batch(batch: Sequence[AlarmIn], outcomes: Sequence[AlarmOutcome]) -> None:
    """One log record per incident a batch touched: how many alarms, duplicates, opened."""
    summary: dict[str, dict[str, Any]] = {}
    for alarm, outcome in zip(batch, outcomes, strict=True):
        entry = summary.setdefault(
            outcome.incident_id,
            {"job": alarm.job_id, "incident": outcome.incident_id, "alarms": 0},
        )
        entry["alarms"] += 1
        entry["duplicates"] = entry.get("duplicates", 0) + int(outcome.duplicate)
        entry["opened"] = entry.get("opened", False) or outcome.opened
    for extra in summary.values():
        _log.info("alarms recorded", extra=extra)


@dataclass
class _Growth:
    """What one batch adds to one incident: its alarms' step bounds and suspect nodes."""

    incident: IncidentRow
    opened: bool
    first: int
    last: int
    nodes: set[str] = field(default_factory=set)
    outside: set[str] = field(default_factory=set)

    def add(self, step: int, nodes: Sequence[str]) -> None:
        self.first = min(self.first, step)
        self.last = max(self.last, step)
        self.nodes.update(nodes)


# The event, not its reporter: an alarm id names one detected event (detection derives it from
# job, step, layer, phase and suspects), and two reporters of that event — another rank, or the
# job's re-run after a restart — send it from another rank and node, and at another time.
_CONTENT = ("job_id", "step", "layer", "phase")
_ALARMS = cast(Table, AlarmRow.__table__)
_CONTENT_COLUMNS = (
    *(getattr(AlarmRow, name) for name in _CONTENT),
    AlarmRow.suspect_ranks,
    AlarmRow.suspect_nodes,
    AlarmRow.detail,
)


def _content(alarm: AlarmIn) -> dict[str, Any]:
    """What makes two alarms with one id the same alarm: the event they report. The reporting
    ``rank``/``node`` and ``sent_at`` may differ (a second reporter, a re-send, a re-run)."""
    return {
        **{name: getattr(alarm, name) for name in _CONTENT},
        "suspect_ranks": [int(r) for r in alarm.suspect_ranks],
        "suspect_nodes": [str(n) for n in alarm.suspect_nodes],
        "detail": dict(alarm.detail),
    }


def _same_alarm(alarm_id: str, known: dict[str, Any], alarm: AlarmIn) -> None:
    new = _content(alarm)
    differ = [name for name, value in known.items() if new[name] != value]
    if differ:
        raise AlarmConflict(alarm_id, differ)


def _stored_alarm_incidents(
    s: Session, alarm_ids: Sequence[str], batch: Sequence[AlarmIn]
) -> dict[str, str]:
    """Incident id by alarm id, for the ids already stored: one primary-key lookup per chunk.

    Every alarm of ``batch`` whose id is stored must carry the stored content, else
    :class:`AlarmConflict`.
    """
    result: dict[str, str] = {}
    by_id: dict[str, list[AlarmIn]] = {}
    for alarm in batch:
        by_id.setdefault(alarm.alarm_id, []).append(alarm)
    columns = [AlarmRow.id, AlarmRow.incident_id, *_CONTENT_COLUMNS]
    for chunk in _chunks(list(dict.fromkeys(alarm_ids))):
        # Columns, not ORM objects: in a storm almost every id is new and nothing comes back,
        # and what does is only compared, never changed.
        for row in s.execute(select(*columns).where(AlarmRow.id.in_(chunk))):
            result[row.id] = row.incident_id
            known = {
                **{name: getattr(row, name) for name in _CONTENT},
                "suspect_ranks": list(row.suspect_ranks),
                "suspect_nodes": list(row.suspect_nodes),
                "detail": dict(row.detail),
            }
            for alarm in by_id.get(row.id, []):
                _same_alarm(row.id, known, alarm)
    return result


def _job_nodes(s: Session, job_ids: Sequence[str], batch: Sequence[AlarmIn]) -> dict[str, set[str]]:
    """Of the nodes ``batch`` names, those each job's rank map holds; a job with no registered
    ranks is absent. Only the named nodes are asked for: a storm's batch names a few dozen,
    while the rank map of a big job holds hundreds, and every batch would read them all."""
    named = sorted({str(n) for a in batch for n in [*a.suspect_nodes, a.node]})
    result: dict[str, set[str]] = {}
    for chunk in _chunks(list(job_ids)):
        has_ranks = exists().where(RankRow.job_id == JobRow.id)
        result.update(
            (job, set())
            for job in s.scalars(select(JobRow.id).where(JobRow.id.in_(chunk), has_ranks))
        )
        for nodes in _chunks(named):
            rows = s.execute(
                select(RankRow.job_id, RankRow.node)
                .where(RankRow.job_id.in_(chunk), RankRow.node.in_(nodes))
                .distinct()
            )
            for job_id, node in rows:
                result[job_id].add(node)
    return result


def _split_by_rank_map(
    alarm: AlarmIn, nodes: Sequence[str], job_nodes: set[str] | None
) -> tuple[list[str], list[str]]:
    """(suspects to act on, nodes outside the job's rank map) of one alarm.

    No suspect nodes means the reporting node. A job without registered ranks cannot be
    checked: its alarm's nodes are taken as given (the incident is flagged ``ranks_missing``).
    """
    named = list(dict.fromkeys(nodes or [alarm.node]))
    if job_nodes is None:
        return named, []
    outside = sorted({n for n in [*named, alarm.node] if n not in job_nodes})
    return [n for n in named if n in job_nodes], outside


def _has_alarm_at_or_before(s: Session, incident: IncidentRow, step: int) -> bool:
    """Whether a stored alarm of the incident lies at or before ``step``.

    Phrased on the job's ``(job_id, step)`` index: the scan covers only the job's alarms up to
    ``step``, and stops at the first one of this incident — O(1) in a storm of equal steps.
    """
    found = s.scalar(
        select(
            exists().where(
                AlarmRow.job_id == incident.job_id,
                AlarmRow.step <= step,
                AlarmRow.incident_id == incident.id,
            )
        )
    )
    return bool(found)


def _suspect_start(s: Session, job_id: str, first_alarm_step: int) -> int:
    """One past the latest passed audit before the first alarm, in the current timeline."""
    since = s.scalar(
        select(func.max(IncidentRow.closed_at)).where(
            IncidentRow.job_id == job_id, IncidentRow.state == IncidentState.RESOLVED
        )
    )
    query = select(func.max(AuditRow.step)).where(
        AuditRow.job_id == job_id,
        AuditRow.passed.is_(True),
        AuditRow.kind.in_(list(_evidence_kinds(s, job_id))),
        AuditRow.step < first_alarm_step,
    )
    if since is not None:
        query = query.where(AuditRow.at > since)
    latest = s.scalar(query)
    return 0 if latest is None else latest + 1
