"""Property test from the webhook's own OpenAPI document (schemathesis): no input gets a 5xx.

Every generated request, to every endpoint, is sent three times to the live server: signed over
its canonical request (so it passes authentication and reaches the schema, the ledger and
PostgreSQL's text rules), unsigned, and with a forged signature — both of which must be refused
with 401 before anything is parsed, leaving the ledger unchanged. Responses must also match the
documented status codes, content types and schemas.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from db import Ledger
from detection.transport.signing import signed_headers
from flows.webhook import create_app
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import Webhook, row_counts

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


class _Signed(requests.auth.AuthBase):
    """Signs the exact bytes requests is about to send, as ``detection.transport.signing`` does."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        raw = body.encode() if isinstance(body, str) else body
        assert isinstance(raw, bytes), f"cannot sign a streamed body: {type(body)}"
        assert request.method is not None
        request.headers.update(
            signed_headers("default", self.secret, request.method, request.path_url, raw)
        )
        return request


def _openapi_document() -> dict[str, Any]:
    """The app's OpenAPI document, built without a server or a database connection.

    Loaded at import because schemathesis' fixture-based lazy loading does not work with this
    pytest version (it writes ``Function._nodeid``); the requests still go to the live server.
    """
    with (
        tempfile.TemporaryDirectory() as scratch,
        Ledger.from_url(f"sqlite:///{Path(scratch) / 'unused.db'}") as unused,  # never connects
    ):
        return create_app(unused, RecordingTrigger(), "x" * 32).openapi()


schema = schemathesis.openapi.from_dict(_openapi_document())


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)
def test_no_input_gets_a_server_error(case: schemathesis.Case, webhook: Webhook) -> None:
    with requests.Session() as signed:
        signed.auth = _Signed(webhook.secret)
        response = case.call(base_url=webhook.url, session=signed, timeout=30)
    case.validate_response(response, checks=CHECKS)

    if case.path == "/healthz" or case.method.upper() != case.operation.method.upper():
        return  # liveness answers anyone; a wrong method is refused by routing (405)
    before = row_counts(webhook.ledger)
    unsigned = case.call(base_url=webhook.url, timeout=30)
    case.validate_response(unsigned, checks=CHECKS)
    assert unsigned.status_code in (401, 413), unsigned.text  # size is checked first
    with requests.Session() as forged:
        forged.auth = _Signed("not-the-webhook-secret-0123456789")
        wrong = case.call(base_url=webhook.url, session=forged, timeout=30)
    case.validate_response(wrong, checks=CHECKS)
    assert wrong.status_code in (401, 413), wrong.text
    assert row_counts(webhook.ledger) == before
