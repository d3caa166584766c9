"""The read side of the API: its budget, its caller, its cursor.

Reads answer operators and dashboards; alarms stop jobs. So reads are admitted by a budget of
their own before any other work (:class:`ReadBudget`), need a reader (:data:`Reader`), and come
a page at a time behind an opaque cursor that only this API makes.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request

from db import InvalidValue, Ledger
from flows.webhook.auth import Principal
from flows.webhook.signed import Guard, Refused, authenticate_read

__all__ = ["ReadBudget", "Reader", "covered_jobs", "decode_cursor", "encode_cursor"]


def encode_cursor(after: tuple[datetime, str] | None) -> str | None:
    if after is None:
        return None
    raw = json.dumps([after[0].isoformat(), after[1]]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, last_id = json.loads(raw)
        if not isinstance(last_id, str) or not isinstance(at, str):
            raise ValueError("cursor fields")
        parsed = datetime.fromisoformat(at)
        if parsed.tzinfo is None:
            raise ValueError("naive cursor")
        return parsed, last_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError) as err:
        raise InvalidValue("cursor is not one this API returned") from err


class ReadBudget:
    """A token bucket over all reads: ``rate`` per second, ``burst`` at once.

    Reads and alarms share the CPU; a flood of reads that were all served would slow alarm
    ingestion however many threads and connections each side has. Over budget, a read is
    refused with 429 before anything else is done for it (no signature check, no query), so a
    refused read costs next to nothing.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def wait_s(self) -> int:
        """Whole seconds until the next read would be taken (at least 1): a 429's Retry-After."""
        missing = max(0.0, 1.0 - self._tokens)
        return max(1, math.ceil(missing / self._rate)) if self._rate > 0 else 60


async def _reader(request: Request) -> Principal:
    """A dependency: solved before the query is validated, so an anonymous caller learns
    nothing, not even which parameters are wrong."""
    budget = request.app.state.read_budget
    assert isinstance(budget, ReadBudget)
    if not budget.take():
        wait = budget.wait_s()
        raise Refused(429, f"too many reads; retry in {wait} s", retry_after_s=wait)
    guard = request.app.state.guard
    assert isinstance(guard, Guard)
    return await authenticate_read(request, guard)


Reader = Annotated[Principal, Depends(_reader)]


def covered_jobs(ledger: Ledger, principal: Principal) -> frozenset[str]:
    """The known job ids a reader scoped by patterns may see."""
    return frozenset(job for job in ledger.job_ids() if principal.covers(job))
