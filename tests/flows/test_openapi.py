"""The webhook's OpenAPI document is an outside contract: any change to it shows here first.

``openapi.json`` beside this file is the document as published; a deliberate change to the API
updates it in the same commit (``create_app(..., docs=True).openapi()``).
"""

from __future__ import annotations

import json
from pathlib import Path

from db import Ledger
from flows.webhook import create_app
from flows.webhook.trigger import RecordingTrigger

PUBLISHED = Path(__file__).with_name("openapi.json")


def test_the_openapi_document_is_the_published_one(tmp_path: Path) -> None:
    ledger = Ledger.from_url(f"sqlite:///{tmp_path / 'ledger.db'}")
    app = create_app(ledger, RecordingTrigger(), "x" * 32, docs=True)
    assert app.openapi() == json.loads(PUBLISHED.read_text())
