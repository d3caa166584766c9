"""Where the telemetry tests find real tool outputs (copied into the repository, see SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "telemetry"
PACKAGED = Path(__file__).resolve().parents[3] / "recovery" / "fixtures" / "telemetry"


def read_fixture(name: str) -> str:
    """The text of one copied tool output, exactly as the tool printed it."""
    return (FIXTURES / name).read_text(encoding="utf-8")
