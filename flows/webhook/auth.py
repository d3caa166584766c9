"""Who is calling, and what they may do: scoped keys, reader tokens, service-account tokens.

Every caller resolves to a :class:`Principal`: a name, roles (``writer`` records alarms, ranks,
checkpoints and audits; ``reader`` reads incidents) and the job ids it covers (``fnmatch``
patterns: ``team-a-*`` scopes a key to one namespace's jobs, ``*`` to all). Three ways in:

* a **signing key** (DESIGN "Webhook signing"): the request names its key id, the HMAC proves
  the secret; two keys with the same scope may be valid at once, which is how keys rotate;
* a **reader token** (``Authorization: Bearer``), stored only as its SHA-256;
* a **projected Kubernetes service-account token** (``Authorization: Bearer``), checked through
  the API server's TokenReview and mapped to the jobs that service account may report for.

Invariants: nothing is written for a caller that did not authenticate (401) or whose scope does
not cover the job the request is about (403); a key's checkpoint prefix bounds every checkpoint
URI it records; secrets and tokens are never logged nor echoed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = [
    "AuthConfigError",
    "Credentials",
    "Principal",
    "Role",
    "TokenCache",
    "WebhookKey",
    "uri_under_prefix",
]


class AuthConfigError(ValueError):
    """The credentials file or settings are malformed; the message never holds a secret."""


class Role(StrEnum):
    WRITER = "writer"
    READER = "reader"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: what it is called, what it may do, for which jobs."""

    name: str
    roles: frozenset[Role]
    jobs: tuple[str, ...] = ("*",)
    checkpoint_prefix: str | None = None

    def covers(self, job_id: str) -> bool:
        """Whether this caller may act for ``job_id`` (exact ids or ``fnmatch`` patterns)."""
        return any(fnmatch.fnmatchcase(job_id, pattern) for pattern in self.jobs)

    @property
    def all_jobs(self) -> bool:
        return "*" in self.jobs

    def prefix_for(self, job_id: str) -> str | None:
        """The checkpoint URI prefix of ``job_id`` (``{job_id}`` filled in), or ``None``."""
        if self.checkpoint_prefix is None:
            return None
        return self.checkpoint_prefix.replace("{job_id}", job_id)


@dataclass(frozen=True)
class WebhookKey:
    """One signing key: its id (sent in the clear), its secret (never), who it stands for."""

    key_id: str
    secret: bytes = field(repr=False)
    principal: Principal


_SEGMENT_TRICKS = re.compile(r"%2e|%2f|%5c|\\", re.IGNORECASE)


def uri_under_prefix(uri: str, prefix: str) -> bool:
    """Whether ``uri`` names a place strictly under ``prefix``, with no way out of it.

    Refused whatever the prefix: ``.``/``..`` segments, percent-encoded dots or slashes,
    backslashes, and empty segments after the prefix — each could make a URI that *starts*
    with the prefix name a file outside it.
    """
    if not uri.startswith(prefix) or len(uri) == len(prefix):
        return False
    if _SEGMENT_TRICKS.search(uri):
        return False
    path = urlsplit(uri).path if "://" in uri else uri
    segments = unquote(path).split("/")
    rest = uri[len(prefix) :].split("/")
    return not any(s in (".", "..") for s in segments) and "" not in rest[1:]


class TokenCache:
    """TokenReview answers kept for ``ttl_s``, so a burst of alarms costs one review per pod.

    Keyed by the token's SHA-256; a refused token is cached too (for a shorter time), so a
    flood of bad tokens does not become a flood of TokenReviews.
    """

    def __init__(self, review: Callable[[str], str | None], ttl_s: float = 60.0) -> None:
        self._review = review
        self._ttl = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, str | None]] = {}

    def username(self, token: str) -> str | None:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        name = self._review(token)
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            self._entries[key] = (now + (self._ttl if name else self._ttl / 6), name)
        return name


@dataclass
class Credentials:
    """The server-side credentials: signing keys by id, reader tokens, service accounts."""

    keys: dict[str, WebhookKey] = field(default_factory=dict)
    reader_tokens: dict[str, Principal] = field(default_factory=dict)  # by SHA-256 hex
    service_accounts: dict[str, Principal] = field(default_factory=dict)  # by username
    token_review: TokenCache | None = None

    @classmethod
    def shared(cls, secret: str | bytes, key_id: str = "default") -> Credentials:
        """One key for every job, writer and reader: a single-machine or development setup.

        A cluster should use :meth:`from_file` with one key per job or namespace instead.
        """
        raw = secret.encode() if isinstance(secret, str) else secret
        if not raw:
            raise AuthConfigError("the webhook secret must not be empty")
        principal = Principal(key_id, frozenset(Role), ("*",))
        return cls(keys={key_id: WebhookKey(key_id, raw, principal)})

    @classmethod
    def from_file(cls, path: Path) -> Credentials:
        """Read a credentials file (JSON, see docs/security.md); mount it from a Secret."""
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise AuthConfigError(f"cannot read credentials file {path}: {err}") from None
        return cls.from_mapping(document)

    @classmethod
    def from_mapping(cls, document: Any) -> Credentials:
        if not isinstance(document, Mapping):
            raise AuthConfigError("credentials must be a JSON object")
        creds = cls()
        for entry in _entries(document, "keys"):
            key_id = _text(entry, "id")
            secret = _text(entry, "secret")
            if len(secret) < 16:
                raise AuthConfigError(f"key {key_id}: secret must be at least 16 characters")
            if key_id in creds.keys:
                raise AuthConfigError(f"key id {key_id} appears twice")
            principal = _principal(key_id, entry, default_roles=[Role.WRITER])
            creds.keys[key_id] = WebhookKey(key_id, secret.encode(), principal)
        for entry in _entries(document, "readers"):
            name = _text(entry, "id")
            digest = _text(entry, "token_sha256").lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise AuthConfigError(f"reader {name}: token_sha256 must be 64 hex digits")
            creds.reader_tokens[digest] = _principal(name, entry, default_roles=[Role.READER])
        for entry in _entries(document, "service_accounts"):
            namespace, account = _text(entry, "namespace"), _text(entry, "name")
            username = f"system:serviceaccount:{namespace}:{account}"
            creds.service_accounts[username] = _principal(
                username, entry, default_roles=[Role.WRITER]
            )
        if not creds.keys and not creds.reader_tokens and not creds.service_accounts:
            raise AuthConfigError("credentials define no key, reader or service account")
        return creds

    def add(self, other: Credentials) -> Credentials:
        """Both sets of credentials (ids must not clash)."""
        clash = set(self.keys) & set(other.keys)
        if clash:
            raise AuthConfigError(f"key ids defined twice: {', '.join(sorted(clash))}")
        return Credentials(
            keys={**self.keys, **other.keys},
            reader_tokens={**self.reader_tokens, **other.reader_tokens},
            service_accounts={**self.service_accounts, **other.service_accounts},
            token_review=self.token_review or other.token_review,
        )

    def secret_of(self, key_id: str) -> bytes | None:
        key = self.keys.get(key_id)
        return None if key is None else key.secret

    def key_principal(self, key_id: str) -> Principal:
        return self.keys[key_id].principal

    def bearer_principal(self, token: str) -> Principal | None:
        """The reader or service account behind a bearer token, or ``None``."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
        for known, principal in self.reader_tokens.items():
            if hmac.compare_digest(known, digest):
                return principal
        if self.token_review is None or not self.service_accounts:
            return None
        username = self.token_review.username(token)
        return None if username is None else self.service_accounts.get(username)


def _entries(document: Mapping[str, Any], name: str) -> Iterable[Mapping[str, Any]]:
    entries = document.get(name, [])
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise AuthConfigError(f"{name} must be a list of objects")
    return entries


def _text(entry: Mapping[str, Any], name: str) -> str:
    value = entry.get(name)
    if not isinstance(value, str) or not value:
        raise AuthConfigError(f"entry {entry.get('id', '?')!s}: {name} must be a non-empty string")
    return value


def _principal(name: str, entry: Mapping[str, Any], default_roles: list[Role]) -> Principal:
    jobs = entry.get("jobs")
    if not isinstance(jobs, list) or not jobs or not all(isinstance(j, str) and j for j in jobs):
        raise AuthConfigError(f"{name}: jobs must be a non-empty list of job ids or patterns")
    roles = entry.get("roles", [r.value for r in default_roles])
    try:
        parsed = frozenset(Role(r) for r in roles)
    except (TypeError, ValueError):
        raise AuthConfigError(f"{name}: roles must be a list of writer/reader") from None
    prefix = entry.get("checkpoint_prefix")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise AuthConfigError(f"{name}: checkpoint_prefix must be a non-empty string")
    return Principal(name, parsed, tuple(jobs), prefix)
