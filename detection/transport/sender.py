"""Deliver alarms and ledger records to the webhook without ever blocking training.

``send_*`` only appends the message to a durable on-disk spool and wakes a background daemon
thread; that thread posts the spool's head, signed at send time, and removes it once the
webhook answered 2xx. Invariants:

* **Nothing is lost while the webhook is down.** A message leaves the spool only on a 2xx
  answer or moved to ``dead/``. Connection errors, timeouts, 408, 429 and 401 retry the head
  with capped exponential backoff and jitter (``Retry-After`` is honoured up to the cap),
  forever: 401 too, because a refused signature is what a key rotation in progress or a
  clock skew look like, and both heal without touching the message.
* **One message cannot block the queue.** A message the webhook answers with 5xx
  ``max_server_errors`` times in a row is moved to ``dead/`` with an ERROR naming it, and the
  queue goes on (a server that fails on one body would otherwise hold every later alarm).
* **Strict order.** Messages carry an increasing sequence number in their file name; only the
  head is ever in flight, so the webhook sees them in the order ``send_*`` was called, across
  retries and across process restarts.
* **Survives the process.** Each message is written to a temporary file, fsynced and renamed
  into place (then the directory is fsynced), so the spool never holds a torn message. A new
  sender on the same ``spool_dir`` re-sends what a dead process left, before anything new.
  A flock on ``spool_dir/.lock`` keeps two live senders off one spool.
* **A poisoned message never wedges the queue.** A 4xx other than 401/408/429 (schema error,
  too large) is permanent: the message moves to ``dead/`` with the status and the webhook's
  reason, an ERROR is logged, and the queue moves on. So does an unreadable spool file, and a
  temporary file a crash left behind mid-write.
* **A leftover spool is drained.** What a job left in its spool when it ended is sent by the
  next sender on that directory (the job's next start) or by :func:`drain_spool`
  (``sdcguard spool drain DIR``).

Delivery is at least once: a crash between the webhook's 2xx and the file's removal re-sends
that message, and a job that runs again re-detects its events; the webhook deduplicates by
``alarm_id``, which is deterministic per event (:func:`event_alarm_id`).

The retry loop is written here by hand because ``detection`` ships in training images and may
depend only on torch, httpx and the standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import re
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

import httpx

from detection.transport.alarm import event_alarm_id
from detection.transport.signing import DEFAULT_KEY_ID, signed_headers

__all__ = [
    "AlarmSender",
    "DrainResult",
    "InvalidMessageError",
    "SenderClosedError",
    "SenderError",
    "SpoolBusyError",
    "SpoolError",
    "drain_spool",
    "event_alarm_id",
    "find_spools",
]

_log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{20})\.json$")
_TMP_PREFIX = ".tmp-"
_DEAD = "dead"
_LOCK = ".lock"
_ENVELOPE_VERSION = 1
_RETRY_STATUSES = frozenset({401, 408, 429})
_REASON_LIMIT = 2000


class SenderError(Exception):
    """Base class of the alarm sender's errors."""


class SpoolError(SenderError):
    """The spool could not be written or read (disk full, permissions, ...)."""


class SpoolBusyError(SpoolError):
    """Another live sender holds this spool directory."""


class SenderClosedError(SenderError):
    """``send_*`` after :meth:`AlarmSender.close`."""


class InvalidMessageError(SenderError, ValueError):
    """The message cannot be spooled (not JSON-serialisable)."""


def _rfc3339_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _json_safe(value: Any) -> Any:
    """Non-finite floats as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``: strict JSON
    has no such numbers and the ledger's JSON columns refuse them, yet a non-finite alarm is
    exactly the one that must get through."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` is either absent or complete, even across a crash."""
    tmp = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date), if any."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


class _Temporary(Exception):
    """An attempt failed in a way that a later retry may fix."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _ServerError(_Temporary):
    """A 5xx answer: temporary, but only ``max_server_errors`` times in a row per message."""

    def __init__(self, status: int, reason: str, retry_after: float | None) -> None:
        super().__init__(reason, retry_after)
        self.status = status


class _Permanent(Exception):
    """The webhook refused the message for good; retrying would only block the queue."""

    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class AlarmSender:
    """Background, spool-backed, in-order delivery to the webhook (see the module docstring).

    ``url`` is the webhook's base URL (``http://host:port``, a path prefix allowed); the
    secret signs every attempt and is never logged; ``key_id`` names it to the webhook (the
    webhook's keys are scoped, DESIGN "Webhook signing").
    """

    def __init__(
        self,
        url: str,
        secret: str | bytes,
        job_id: str,
        spool_dir: str | Path,
        *,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 30.0,
        max_server_errors: int = 8,
        transport: httpx.BaseTransport | None = None,
        key_id: str = DEFAULT_KEY_ID,
    ) -> None:
        base = httpx.URL(url)
        if base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"webhook url must be http(s)://host[:port][/prefix], got {url!r}")
        if not job_id:
            raise ValueError("job_id must not be empty")
        if not secret:
            raise ValueError("the webhook secret must not be empty")
        if timeout_s <= 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need timeout_s > 0 and 0 < backoff_initial_s <= backoff_max_s")
        if max_server_errors < 1:
            raise ValueError("max_server_errors must be ≥ 1")
        self._max_server_errors = max_server_errors
        self._base = str(base).rstrip("/")
        self._secret = secret
        self._key_id = key_id
        self.job_id = job_id
        self.spool_dir = Path(spool_dir)
        self._dead_dir = self.spool_dir / _DEAD
        self._timeout_s = timeout_s
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._log_extra = {"job": job_id, "spool": str(self.spool_dir)}

        try:
            self._dead_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.spool_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise SpoolError(f"cannot open the spool {self.spool_dir}: {err}") from err
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._lock_fd)
            raise SpoolBusyError(f"another sender holds the spool {self.spool_dir}") from err

        self._cv = threading.Condition()
        self._queue: deque[Path] = deque()
        self._closing = False
        self._closed = False
        self._kick = False
        try:
            self._next_seq = self._recover()
        except OSError as err:
            self._release_lock()
            raise SpoolError(f"cannot read the spool {self.spool_dir}: {err}") from err
        self._client = httpx.Client(timeout=timeout_s, transport=transport)
        self._thread = threading.Thread(
            target=self._run, name=f"sdcguard-sender-{job_id}", daemon=True
        )
        self._thread.start()
        if self._queue:
            _log.info(
                "alarm sender: re-sending %d spooled messages",
                len(self._queue),
                extra=self._log_extra,
            )

    # -- public API ------------------------------------------------------------------------------
    def send_alarm(self, body: dict[str, Any]) -> str:
        """Spool one alarm (DESIGN alarm body) and return its ``alarm_id``.

        Adds ``job_id``, ``alarm_id`` (:func:`event_alarm_id`, deterministic per event) and
        ``sent_at`` (RFC 3339, now) when absent; the caller's dict is not modified."""
        message = dict(body)
        message.setdefault("job_id", self.job_id)
        alarm_id = str(message.setdefault("alarm_id", event_alarm_id(message)))
        message.setdefault("sent_at", _rfc3339_now())
        self._enqueue("alarm", "/v1/alarms", message)
        return alarm_id

    def send_external_alarm(self, body: dict[str, Any]) -> str:
        """Spool one alarm of another detector (``POST /v1/external-alarms``; the body of
        :meth:`detection.external.ExternalAlarm.to_webhook`, which carries its own id)."""
        message = dict(body)
        message.setdefault("job_id", self.job_id)
        message.setdefault("sent_at", _rfc3339_now())
        if not message.get("alarm_id"):
            raise InvalidMessageError("an external alarm carries its own alarm_id")
        self._enqueue("external-alarm", "/v1/external-alarms", message)
        return str(message["alarm_id"])

    def register_ranks(self, ranks: list[dict[str, Any]]) -> None:
        """Spool the job's rank registration (``RankIdentity.to_dict()`` rows)."""
        self._enqueue("ranks", self._job_path("ranks"), {"ranks": list(ranks)})

    def record_checkpoint(self, body: dict[str, Any]) -> None:
        self._enqueue("checkpoint", self._job_path("checkpoints"), dict(body))

    def record_audit(self, body: dict[str, Any]) -> None:
        self._enqueue("audit", self._job_path("audits"), dict(body))

    def pending(self) -> int:
        """Messages not yet delivered (in flight included, ``dead/`` excluded)."""
        with self._cv:
            return len(self._queue)

    def flush(self, timeout_s: float) -> bool:
        """Retry now (cutting a backoff wait short) and wait up to ``timeout_s`` for the spool
        to drain. True when it is empty; what is left stays spooled either way."""
        with self._cv:
            self._kick = True
            self._cv.notify_all()
            return self._cv.wait_for(lambda: not self._queue, timeout=max(0.0, timeout_s))

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s``, then stop the thread and release the spool. What is
        still undelivered stays on disk for the next sender on this ``spool_dir``."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        drained = self.flush(timeout_s)
        with self._cv:
            self._closing = True
            left = len(self._queue)
            self._cv.notify_all()
        # One attempt in flight can take up to the HTTP timeout per phase; never wait forever.
        self._thread.join(timeout=max(timeout_s, 0.0) + 4 * self._timeout_s)
        self._client.close()
        self._release_lock()
        if not drained:
            _log.warning(
                "alarm sender closed with %d undelivered messages; they stay spooled",
                left,
                extra=self._log_extra,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- spool -----------------------------------------------------------------------------------
    def _job_path(self, what: str) -> str:
        return f"/v1/jobs/{quote(self.job_id, safe='')}/{what}"

    def _enqueue(self, kind: str, path: str, body: dict[str, Any]) -> None:
        try:
            payload = json.dumps(_json_safe(body), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise InvalidMessageError(f"{kind} body is not JSON-serialisable: {err}") from err
        with self._cv:
            if self._closed:
                raise SenderClosedError(f"the alarm sender for job {self.job_id} is closed")
            seq = self._next_seq
            self._next_seq += 1
            envelope = {
                "v": _ENVELOPE_VERSION,
                "seq": seq,
                "kind": kind,
                "path": path,
                "enqueued_at": _rfc3339_now(),
                "body": payload,
            }
            target = self.spool_dir / f"{seq:020d}.json"
            try:
                _write_atomic(target, json.dumps(envelope).encode())
            except OSError as err:
                raise SpoolError(f"cannot spool the {kind} message: {err}") from err
            self._queue.append(target)
            self._cv.notify_all()

    def _recover(self) -> int:
        """Queue what a previous process left, in order; return the next sequence number."""
        last = -1
        for leftover in sorted(self.spool_dir.glob(f"{_TMP_PREFIX}*")):
            self._bury(leftover, None, "incomplete spool write left by a crash", raw=True)
        for dead in self._dead_dir.iterdir():
            match = _NAME.match(dead.name)
            if match:
                last = max(last, int(match.group(1)))
        queued: list[tuple[int, Path]] = []
        for entry in self.spool_dir.iterdir():
            match = _NAME.match(entry.name)
            if match:
                queued.append((int(match.group(1)), entry))
        queued.sort()
        self._queue.extend(path for _, path in queued)
        if queued:
            last = max(last, queued[-1][0])
        return last + 1

    def _bury(self, path: Path, status: int | None, reason: str, *, raw: bool = False) -> None:
        """Move ``path`` to ``dead/`` with why it failed; never just delete a message."""
        try:
            data = path.read_bytes()
        except OSError as err:
            data = b""
            reason = f"{reason}; unreadable: {err}"
        try:
            envelope: Any = None if raw else json.loads(data)
        except ValueError:
            envelope = None
        record = {
            "status": status,
            "reason": reason[:_REASON_LIMIT],
            "dead_at": _rfc3339_now(),
            "file": path.name,
            "message": envelope if isinstance(envelope, dict) else None,
            "raw": None if isinstance(envelope, dict) else data.decode("utf-8", "replace"),
        }
        name = path.name if _NAME.match(path.name) else f"{path.name.lstrip('.')}.json"
        _write_atomic(self._dead_dir / name, json.dumps(record, indent=1).encode())
        path.unlink()
        extra = dict(self._log_extra, http_status=status, spool_file=path.name)
        if isinstance(envelope, dict):
            extra.update(kind=envelope.get("kind"), webhook_path=envelope.get("path"))
        _log.error(
            "alarm sender: message moved to dead/ (%s): %s",
            status if status is not None else "not sent",
            reason[:_REASON_LIMIT],
            extra=extra,
        )

    # -- delivery thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        delay = self._backoff_initial
        failures = 0  # consecutive failed attempts on the current head
        server_errors = 0  # consecutive 5xx answers to the current head
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or bool(self._queue))
                if self._closing:
                    return
                head = self._queue[0]
                self._kick = False
            extra = dict(self._log_extra, spool_file=head.name)
            try:
                try:
                    self._deliver(head)
                    dead: tuple[int | None, str] | None = None
                except _Permanent as err:
                    dead = (err.status, err.reason)
                self._finish(head, dead)
            except _Temporary as err:
                server_errors = server_errors + 1 if isinstance(err, _ServerError) else 0
                if isinstance(err, _ServerError) and server_errors >= self._max_server_errors:
                    why = f"gave up after {server_errors} server errors in a row: {err.reason}"
                    try:
                        self._finish(head, (err.status, why))
                    except Exception:
                        _log.exception(
                            "alarm sender: cannot move the message to dead/", extra=extra
                        )
                    else:
                        failures = server_errors = 0
                        delay = self._backoff_initial
                        continue
                wait = self._next_wait(delay, err.retry_after)
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                _log.log(
                    level,
                    "alarm sender: webhook unavailable (%s); retrying in %.2f s",
                    err.reason,
                    wait,
                    extra=dict(extra, attempt=failures),
                )
            except Exception:  # a bug or a disk error: keep the thread alive, keep the message
                wait = self._next_wait(delay, None)
                failures += 1
                _log.exception(
                    "alarm sender: unexpected error; the message stays spooled, retrying in %.2f s",
                    wait,
                    extra=dict(extra, attempt=failures),
                )
            else:
                server_errors = 0
                if failures:
                    _log.info(
                        "alarm sender: webhook reachable again after %d failed attempts",
                        failures,
                        extra=extra,
                    )
                failures = 0
                delay = self._backoff_initial
                continue
            delay = min(self._backoff_max, delay * 2)
            with self._cv:
                self._cv.wait_for(lambda: self._closing or self._kick, timeout=wait)

    def _next_wait(self, delay: float, retry_after: float | None) -> float:
        """Exponential backoff with jitter in [delay/2, delay], at least ``Retry-After``,
        never above the cap."""
        wait = delay * (0.5 + random.random() / 2)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return min(self._backoff_max, wait)

    def _finish(self, head: Path, dead: tuple[int | None, str] | None) -> None:
        if dead is None:
            head.unlink(missing_ok=True)
        else:
            self._bury(head, *dead)
        with self._cv:
            self._queue.popleft()
            self._cv.notify_all()

    def _deliver(self, head: Path) -> None:
        """One attempt for the head message; raises :class:`_Temporary`/:class:`_Permanent`."""
        try:
            envelope = json.loads(head.read_bytes())
            path = envelope["path"]
            body = envelope["body"].encode()
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(f"bad path {path!r}")
        except FileNotFoundError as err:
            raise _Permanent(None, f"spool file vanished: {err}") from err
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _Permanent(None, f"corrupt spool file: {err!r}") from err
        headers = {"Content-Type": "application/json"}
        url = httpx.URL(self._base + path)
        target = url.raw_path.decode("ascii")  # path and query exactly as sent
        headers.update(signed_headers(self._key_id, self._secret, "POST", target, body))
        try:
            response = self._client.post(url, content=body, headers=headers)
        except httpx.TransportError as err:
            raise _Temporary(f"{type(err).__name__}: {err}") from err
        status = response.status_code
        if 200 <= status < 300:
            _log.debug(
                "alarm sender: delivered %s",
                head.name,
                extra=dict(self._log_extra, http_status=status, webhook_path=path),
            )
            return
        reason = f"HTTP {status} {response.reason_phrase}: {response.text[:_REASON_LIMIT]}"
        if status >= 500:
            raise _ServerError(status, reason, _retry_after(response))
        if status == 401:
            reason += " (a key rotation in progress or clock skew? the message stays spooled)"
        if status in _RETRY_STATUSES:
            raise _Temporary(reason, _retry_after(response))
        raise _Permanent(status, reason)

    def _release_lock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)


@dataclass(frozen=True)
class DrainResult:
    """What :func:`drain_spool` did: messages found, delivered, and left spooled; messages
    moved to ``dead/`` during the drain."""

    found: int
    delivered: int
    left: int
    dead: int


def _spool_job(spool_dir: Path) -> str:
    """The job a spool belongs to, read from its oldest message (the sender only uses it for
    log context and for paths of new messages, of which a drain sends none)."""
    for entry in sorted(spool_dir.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            body = json.loads(json.loads(entry.read_bytes())["body"])
            if isinstance(body, dict) and body.get("job_id"):
                return str(body["job_id"])
    return spool_dir.name or "spool"


def drain_spool(
    spool_dir: str | Path,
    url: str,
    secret: str | bytes,
    *,
    timeout_s: float = 60.0,
    **options: Any,
) -> DrainResult:
    """Send what a finished job left in ``spool_dir`` (one rank's spool), in order, waiting up
    to ``timeout_s``; what is still undelivered stays spooled for a later drain. Refuses a
    spool a live sender holds (:class:`SpoolBusyError`)."""
    directory = Path(spool_dir)
    if not directory.is_dir():
        raise SpoolError(f"no spool at {directory}")
    dead_dir = directory / _DEAD
    dead_before = len(list(dead_dir.glob("*.json"))) if dead_dir.is_dir() else 0
    sender = AlarmSender(url, secret, _spool_job(directory), directory, **options)
    found = sender.pending()
    try:
        sender.flush(timeout_s)
        left = sender.pending()
    finally:
        sender.close(timeout_s=0.0)
    dead = len(list(dead_dir.glob("*.json"))) - dead_before
    return DrainResult(found=found, delivered=found - left - dead, left=left, dead=dead)


def find_spools(root: str | Path) -> list[Path]:
    """The spool directories at or under ``root`` (a job's spool root holds one per rank):
    every directory a sender ever opened (it holds the ``.lock`` file) or that holds messages."""
    base = Path(root)
    if not base.is_dir():
        raise SpoolError(f"no spool at {base}")
    found = {p.parent for p in base.rglob(_LOCK)}
    found |= {p.parent for p in base.rglob("*.json") if _NAME.match(p.name)}
    return sorted(d for d in found if d.name != _DEAD)
