"""Property test from the webhook's own OpenAPI document (schemathesis): no input gets a 5xx.

Every generated request is sent twice to the live server: signed (so it passes the signature
check and reaches the schema, the ledger and PostgreSQL's text rules) and unsigned (which must
be refused with 401 before anything is parsed). Responses must also match the documented status
codes, content types and schemas.
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
from detection.signing import signed_headers
from flows.trigger import RecordingTrigger
from flows.webhook import create_app
from tests.flows.conftest import Webhook, row_counts

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


class _Signed(requests.auth.AuthBase):
    """Signs the exact bytes requests is about to send, as ``detection.signing`` does."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        raw = body.encode() if isinstance(body, str) else body
        assert isinstance(raw, bytes), f"cannot sign a streamed body: {type(body)}"
        request.headers.update(signed_headers(self.secret, raw))
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

    if case.method.upper() == "POST" == case.operation.method.upper():
        before = row_counts(webhook.ledger)
        unsigned = case.call(base_url=webhook.url, timeout=30)
        case.validate_response(unsigned, checks=CHECKS)
        assert unsigned.status_code == 401, unsigned.text
        assert row_counts(webhook.ledger) == before
