"""Who answered the approval form, as far as anyone authenticated it.

What Prefect itself knows of the caller: nothing personal. ``POST /api/flow_runs/{id}/resume``
validates ``run_input`` against the form's schema, stores it as the run's input and moves the
run to ``Scheduled("Resuming")`` (a suspended run) or ``Running``; neither the stored input nor
the state nor the ``prefect.flow-run.*`` event of that change carries who called. Server API
authentication (``PREFECT_SERVER_API_AUTH_STRING``) is one string shared by every client, so it
tells that a holder of the string answered, never which person. The free-text ``approver`` of
the form is a *claim*.

So an authenticated identity has to come from the operator's authenticating proxy (oauth2-proxy
and the like), which knows the user and passes it in a header (``X-Forwarded-Email``,
``X-Forwarded-User``, ``X-Auth-Request-Email``). :class:`ApprovalIdentityGate` is an ASGI
middleware around the Prefect server's app (``flows.incident.approval.identity:create_prefect_app``,
behind that proxy): on every resume it removes whatever ``identity`` the client put in the
form, and — when the proxy's header is present — writes an identity token there instead: the
user, the flow run id and the time, signed with HMAC-SHA256 under
``SDCGUARD_APPROVAL_IDENTITY_SECRET``. The flow checks the token with the same secret
(:func:`resolve_identity`) and records the result.

Invariant: ``authenticated`` is set only from a token that verifies under the configured secret
and names this flow run; in every other case (no gate, no header, no secret on the worker, a
typed or forged token) the decision is recorded ``unauthenticated``, with the claimed name and,
for a token that did not verify, why.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from flows.settings import ApprovalIdentitySettings

__all__ = [
    "ApprovalIdentityGate",
    "ApproverIdentity",
    "create_prefect_app",
    "identity_token",
    "resolve_identity",
]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHENTICATED = "unauthenticated"
_RESUME = re.compile(r"^(?:/api)?/flow_runs/([0-9a-fA-F-]{36})/resume/?$")
_MAX_BODY = 1 << 20


@dataclass(frozen=True)
class ApproverIdentity:
    """Who answered: the name typed in the form, and who was authenticated, if anyone."""

    claimed: str | None
    authenticated: str | None
    source: str
    """``gate:<header>`` for a verified identity, else ``unauthenticated`` (with the reason)."""

    def as_record(self) -> dict[str, Any]:
        return {
            "approver_claimed": self.claimed,
            "approver_authenticated": self.authenticated,
            "identity_source": self.source,
        }


def _sign(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def identity_token(secret: str, user: str, flow_run_id: str, header: str) -> str:
    """``v1.<base64url JSON of user, run, time, header>.<hex HMAC-SHA256>``."""
    claims = {"sub": user, "run": flow_run_id.lower(), "iat": int(time.time()), "hdr": header}
    payload = base64.urlsafe_b64encode(json.dumps(claims, sort_keys=True).encode()).decode()
    return f"v1.{payload}.{_sign(secret.encode(), payload.encode())}"


def resolve_identity(
    claimed: str | None, token: str | None, flow_run_id: str | None, secret: str | None
) -> ApproverIdentity:
    """The identity to record for an answer carrying ``token`` (see the module's invariant)."""
    if not token:
        return ApproverIdentity(claimed, None, UNAUTHENTICATED)
    why = _token_problem(token, flow_run_id, secret)
    if why is not None:
        log.warning("approval identity not verified: %s", why)
        return ApproverIdentity(claimed, None, f"{UNAUTHENTICATED} (identity not verified: {why})")
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1]))
    return ApproverIdentity(claimed, str(claims["sub"]), f"gate:{claims['hdr']}")


def _token_problem(token: str, flow_run_id: str | None, secret: str | None) -> str | None:
    if secret is None:
        return "no SDCGUARD_APPROVAL_IDENTITY_SECRET on this worker"
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != "v1":
        return "not an identity token"
    if not hmac.compare_digest(_sign(secret.encode(), parts[1].encode()), parts[2]):
        return "bad signature"
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1]))
    except ValueError:
        return "unreadable claims"
    if not isinstance(claims, dict) or not isinstance(claims.get("sub"), str):
        return "unreadable claims"
    if flow_run_id is None or claims.get("run") != flow_run_id.lower():
        return "issued for another flow run"
    return None


class ApprovalIdentityGate:
    """ASGI middleware: stamps every resume's ``run_input.identity`` from the proxy's header.

    Only the resume route is touched; every other request passes as it came. The header is
    trusted as the proxy sets it: the proxy must be the only way to the app, and must drop a
    client's own copy of the header (oauth2-proxy overwrites the ``X-Forwarded-*`` it sets).
    """

    def __init__(self, app: ASGIApp, secret: str, header: str = "X-Forwarded-Email") -> None:
        self._app = app
        self._secret = secret
        self._header = header
        self._header_key = header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _RESUME.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self._app(scope, _replay([message]), send)
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body"))
            if len(body) > _MAX_BODY:
                await _answer(send, 413, "request body too large")
                return
        body = self._stamp(body, scope, match.group(1))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        forwarded = {**scope, "headers": headers}
        await self._app(forwarded, _replay([{"type": "http.request", "body": body}]), send)

    def _stamp(self, body: bytes, scope: Scope, flow_run_id: str) -> bytes:
        try:
            document = json.loads(body) if body else {}
        except ValueError:
            return body  # not JSON: Prefect answers it (422) as it would without the gate
        run_input = document.get("run_input") if isinstance(document, dict) else None
        if not isinstance(run_input, dict):
            return body
        run_input.pop("identity", None)  # never what the client typed
        user = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == self._header_key),
            "",
        ).strip()
        if user:
            run_input["identity"] = identity_token(self._secret, user, flow_run_id, self._header)
        else:
            log.warning(
                "resume of flow run %s without %s: unauthenticated", flow_run_id, self._header
            )
        return json.dumps(document).encode()


def _replay(messages: list[Message]) -> Receive:
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        return {"type": "http.disconnect"}

    return receive


async def _answer(send: Send, status: int, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})


def create_prefect_app() -> ASGIApp:
    """The Prefect server's app behind the gate, for ``uvicorn --factory`` (docs/security.md)."""
    from prefect.server.api.server import create_app

    settings = ApprovalIdentitySettings()
    if settings.secret is None:
        raise RuntimeError("set SDCGUARD_APPROVAL_IDENTITY_SECRET: the gate signs identities")
    app: ASGIApp = create_app()
    return ApprovalIdentityGate(app, settings.secret.get_secret_value(), settings.header)
