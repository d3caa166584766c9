"""Checks of caller input, run before any transaction opens: a refused call writes nothing.

Every check raises :class:`db.errors.InvalidValue` (or :class:`db.errors.InvalidRange`) naming
the field, so the webhook and the CLI can report it to the sender unchanged.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, TypeVar

from db.enums import ActionStatus, AuditKind, IncidentState, Verdict
from db.errors import InvalidRange, InvalidValue
from db.views import AlarmIn

_ID_MAX = 255

_E = TypeVar("_E", IncidentState, Verdict, AuditKind, ActionStatus)


def _parse_enum(enum_cls: type[_E], name: str, value: object) -> _E:
    allowed = ", ".join(member.value for member in enum_cls)
    if not isinstance(value, str):
        raise InvalidValue(f"{name} must be one of {allowed}; got {value!r}")
    try:
        return enum_cls(value)
    except ValueError as err:
        raise InvalidValue(f"{name} must be one of {allowed}; got {value!r}") from err


def _require_text(name: str, value: object, *, max_len: int = _ID_MAX) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue(f"{name} must be a non-empty string, not {value!r}")
    if len(value) > max_len:
        raise InvalidValue(f"{name} is longer than {max_len} characters")
    return value


def _optional_text(name: str, value: str | None, *, max_len: int = _ID_MAX) -> str | None:
    return None if value is None else _require_text(name, value, max_len=max_len)


def _require_step(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValue(f"{name} must be an integer >= 0, not {value!r}")
    return value


def _require_range(start: int, end: int | None) -> None:
    _require_step("start", start)
    if end is not None:
        _require_step("end", end)
        if start > end:
            raise InvalidRange(start, end)


def _json_dict(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidValue(f"{name} must be a JSON object, not {type(value).__name__}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise InvalidValue(f"{name} is not JSON-serialisable: {err}") from err
    return dict(value)


def _validate_alarm(alarm: AlarmIn) -> None:
    _require_text("alarm_id", alarm.alarm_id, max_len=128)
    _require_text("job_id", alarm.job_id)
    _require_step("step", alarm.step)
    _require_step("rank", alarm.rank)
    _require_text("node", alarm.node)
    _require_text("layer", alarm.layer, max_len=64)
    _require_text("phase", alarm.phase, max_len=64)
    for rank in alarm.suspect_ranks:
        _require_step("suspect rank", rank)
    for node in alarm.suspect_nodes:
        _require_text("suspect node", node)
    _json_dict("detail", alarm.detail)
    if alarm.sent_at is not None and not isinstance(alarm.sent_at, datetime):
        raise InvalidValue(f"sent_at must be a datetime, not {alarm.sent_at!r}")


def _as_utc(value: datetime) -> datetime:
    """Naive datetimes are taken to be UTC already (RFC 3339 senders always give an offset)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _jsonable_updates(updates: dict[str, Any]) -> dict[str, Any]:
    return {
        name: value.value if isinstance(value, Verdict) else value
        for name, value in updates.items()
    }
