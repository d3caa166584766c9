"""The ledger's transaction discipline: every public method runs in one of these two helpers.

Invariant: a write either commits all of its effect or raises a :class:`db.errors.LedgerError`
and leaves nothing behind; a lost unique-key race or a serialization failure re-runs the whole
transaction from the start (it then sees the winner's row). Driver errors never leave the
ledger untranslated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session

from db.engine import read_only
from db.errors import (
    LedgerContention,
    LedgerError,
    LedgerUnavailable,
    SchemaNotReady,
    UnknownJob,
)
from db.ledger._queries import _job
from db.models import JobRow

# One logger for the whole ledger, named after the package its callers import: operators and
# tests filter on ``db.ledger``, whichever module of the package logged the record.
_log = logging.getLogger("db.ledger")

_T = TypeVar("_T")
Clock = Callable[[], datetime]

# Each retry follows a rival's commit, so it normally succeeds at once; a loop that keeps
# losing means something else is wrong and should surface.
_MAX_ATTEMPTS = 12
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock


def _utcnow() -> datetime:
    return datetime.now(UTC)


class LedgerBase:
    """The engine, the clock and the two transaction helpers every part of the ledger uses."""

    engine: Engine

    def __init__(self, engine: Engine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self._read_engine = read_only(engine)
        self._clock: Clock = clock or _utcnow
        self._owns_engine = False

    def _write(self, operation: str, work: Callable[[Session], _T]) -> _T:
        """Run ``work`` in one write transaction, re-running it after a lost unique-key race."""
        last: DBAPIError | None = None
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            try:
                with Session(self.engine, expire_on_commit=False) as session, session.begin():
                    return work(session)
            except IntegrityError as err:
                if not _is_unique_violation(err):
                    raise LedgerError(f"{operation}: constraint violated: {err.orig}") from err
                last = err
            except DBAPIError as err:
                if _sqlstate(err) not in _RETRYABLE_SQLSTATES:
                    raise _translate(operation, err) from err
                last = err
            except PoolTimeoutError as err:
                raise LedgerUnavailable(f"{operation}: no database connection free") from err
            _log.debug("write race lost; retrying", extra={"operation": operation, "n": attempt})
        raise LedgerContention(operation, _MAX_ATTEMPTS) from last

    def _read(self, operation: str, work: Callable[[Session], _T]) -> _T:
        try:
            with Session(self._read_engine) as session, session.begin():
                return work(session)
        except DBAPIError as err:
            raise _translate(operation, err) from err
        except PoolTimeoutError as err:
            raise LedgerUnavailable(f"{operation}: no database connection free") from err

    def _ensure_job(self, s: Session, job_id: str, *, lock: bool = False) -> JobRow:
        row = _job(s, job_id, lock=lock)
        if row is None:
            row = JobRow(id=job_id, created_at=self._clock())
            s.add(row)
            s.flush()
            _log.debug("job row added", extra={"job": job_id})
        return row

    def _require_job(self, s: Session, job_id: str, *, lock: bool = False) -> JobRow:
        row = _job(s, job_id, lock=lock)
        if row is None:
            raise UnknownJob(job_id)
        return row


def _sqlstate(err: DBAPIError) -> str | None:
    state = getattr(err.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _is_unique_violation(err: IntegrityError) -> bool:
    if _sqlstate(err) == "23505":
        return True
    return "UNIQUE constraint failed" in str(err.orig)


def _translate(operation: str, err: DBAPIError) -> LedgerError:
    """Map a driver error to the ledger's temporary/permanent split."""
    message = str(err.orig)
    if _sqlstate(err) == "42P01" or "no such table" in message:
        return SchemaNotReady(
            f"{operation}: the ledger tables are missing ({message.strip()}); "
            "run db.migrate.upgrade(url) first"
        )
    if isinstance(err, OperationalError):
        return LedgerUnavailable(f"{operation}: database unavailable: {message.strip()}")
    return LedgerError(f"{operation}: database error: {message.strip()}")
