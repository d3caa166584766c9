"""``sdcguard incidents``, ``incident ID``, ``db upgrade`` and ``replay-incident ID``.

The rehearsal runs the real flow on its own local backends; the ledger it was pointed at must
come out exactly as it went in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from db import IncidentState, Ledger
from flows.cli import app
from flows.local.rehearsal import REHEARSAL_NOTICE, RehearsalDecision, rehearse
from recovery.aws.local import LocalAws, start_local_aws
from recovery.jobs import JobKind, JobRef
from tests.flows.conftest import row_counts
from tests.flows.test_incident import AUTO, FAULTY, JOB, Site, build_site

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


@pytest.fixture(autouse=True)
def _fast_approval_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")


@pytest.fixture
def resolved(tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws) -> Iterator[Site]:
    """A source ledger holding an incident the flow already resolved."""
    site = build_site(tmp_path / "source", sqlite_ledger, local_aws)
    site.run(AUTO)
    yield site
    site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_rehearsal_reruns_the_incident_and_leaves_the_source_ledger_untouched(
    resolved: Site, sqlite_database_url: str, tmp_path: Path
) -> None:
    before = (row_counts(resolved.ledger), resolved.incident().to_dict())

    result = rehearse(
        sqlite_database_url,
        resolved.incident_id,
        tmp_path / "rehearsal",
        decision=RehearsalDecision.APPROVE,
    )

    assert (row_counts(resolved.ledger), resolved.incident().to_dict()) == before
    assert result.notice == REHEARSAL_NOTICE
    assert result.summary["rehearsal"] is True
    assert result.summary["source_incident_id"] == resolved.incident_id
    assert result.summary["state"] == "resolved"
    assert result.summary["suspect_range"] == [31, 37]
    assert result.summary["suspect_nodes"] == [FAULTY]
    assert result.summary["approval"]["approver"] == "sdcguard replay-incident"
    assert result.summary["replaced"][0]["node"] == FAULTY
    assert result.summary["resumed_from_step"] == 29
    assert any("no diagnostic replay" in note for note in result.notes)
    with Ledger.from_url(result.ledger_url) as rehearsal:
        assert rehearsal.get_incident(result.incident_id).state is IncidentState.RESOLVED


def test_cli_lists_shows_rehearses_and_migrates(
    resolved: Site, sqlite_database_url: str, tmp_path: Path
) -> None:
    runner = CliRunner(env={"COLUMNS": "240"})
    url = ["--database-url", sqlite_database_url]

    listed = runner.invoke(app, ["incidents", *url])
    assert listed.exit_code == 0, listed.output
    assert resolved.incident_id[:8] in listed.output
    assert "resolved" in listed.output

    shown = runner.invoke(app, ["incident", resolved.incident_id, *url])
    assert shown.exit_code == 0, shown.output
    for text in ("hardware", "policy:auto-approve", "replace", "resume"):
        assert text in shown.output

    missing = runner.invoke(app, ["incident", "no-such-incident", *url])
    assert missing.exit_code == 1

    report = tmp_path / "rehearsal.json"
    rehearsed = runner.invoke(
        app,
        [
            "replay-incident",
            resolved.incident_id,
            *url,
            "--workdir",
            str(tmp_path / "cli-rehearsal"),
            "--decision",
            "reject",
            "--report",
            str(report),
        ],
    )
    assert rehearsed.exit_code == 0, rehearsed.output
    assert "REHEARSAL" in rehearsed.output
    assert "nothing real was touched" in rehearsed.output
    summary = json.loads(report.read_text())
    assert summary["rehearsal"] is True
    assert summary["state"] == "rejected"

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    migrated = runner.invoke(app, ["db", "upgrade", "--database-url", fresh])
    assert migrated.exit_code == 0, migrated.output
    with Ledger.from_url(fresh) as ledger:
        assert ledger.list_incidents() == []


@pytest.mark.parametrize("columns", ["80", None], ids=["80-columns", "piped"])
def test_incidents_and_incident_read_well_at_80_columns(
    resolved: Site, sqlite_database_url: str, columns: str | None
) -> None:
    """Piped (no terminal, no COLUMNS) rich renders 80 wide too; nothing may be squeezed out."""
    runner = CliRunner(env={"COLUMNS": columns})
    url = ["--database-url", sqlite_database_url]
    incident = resolved.incident()
    steps = f"{incident.suspect_start}..{incident.suspect_end}"

    listed = runner.invoke(app, ["incidents", *url])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if incident.id in line)
    for text in (JOB, "resolved", steps, FAULTY):
        assert text in row, listed.output
    assert max(len(line) for line in listed.output.splitlines()) <= 80

    shown = runner.invoke(app, ["incident", incident.id, *url])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    facts = {line.split(None, 1)[0]: line for line in lines[:3]}
    assert incident.id in facts["incident"]
    assert JOB in facts["job"]
    assert "resolved" in facts["state"]
    assert any(line.startswith("suspect steps") and steps in line for line in lines)
    assert any(line.startswith("suspect nodes") and FAULTY in line for line in lines)
    for stage in ("triage", "replace", "resume"):
        assert any(line.split()[:2] == [stage, "succeeded"] for line in lines if line.strip()), (
            shown.output
        )
