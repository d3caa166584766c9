"""The local commands a newcomer runs first, from a shell with no Prefect setting.

- ``sdcguard demo`` stopped by SIGTERM mid-way leaves nothing running: not the Prefect server it
  started (a process group of its own), not a training process.
- ``sdcguard replay-incident`` runs the flow and its approver on one Prefect server, started for
  it and stopped after it. Before, the flow and the approver thread each started a temporary
  server of their own (and one of three runs timed out starting one); now exactly one server is
  started before either, both are pointed at it, and temporary servers are switched off while it
  runs, so no second server can be started at all.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from db import AlarmIn, Ledger, RankIn, upgrade
from tests.e2e.processes import cli_process, prefect_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NODES = ["node-0", "node-1", "node-2", "node-3"]
JOB = "recorded-job"


def test_sigterm_stops_the_demo_with_its_prefect_server_and_training(tmp_path: Path) -> None:
    args = ["demo", "--approve-in-ui"]
    with cli_process(args, tmp_path / "demo", tmp_path / "home") as demo:
        demo.wait_for_line(re.compile(r"1\. reference run"), timeout_s=660)
        assert prefect_processes(demo.note_processes()), f"no Prefect server:\n{demo.output}"
        deadline = time.monotonic() + 60
        while not _training(demo.note_processes()):  # launched just after the line is printed
            assert time.monotonic() < deadline, f"no training process:\n{demo.output}"
            time.sleep(0.2)

        demo.proc.send_signal(signal.SIGTERM)

        assert demo.wait(timeout_s=120) == 143, demo.output
        assert "stopped by SIGTERM" in demo.output
        assert demo.left_behind() == []


def _training(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if "detection.harness" in " ".join(process.cmdline()):
                found.append(process)
    return found


def _recorded_incident(url: str, tmp_path: Path) -> str:
    """A ledger holding one open incident: node-2 named by a ring audit at step 8, after a
    verified checkpoint at step 5 (its file is not on this machine: a stand-in is used)."""
    upgrade(url)
    with Ledger.from_url(url) as ledger:
        ledger.register_ranks(JOB, [RankIn(r, 0, n) for r, n in enumerate(NODES)])
        ledger.record_checkpoint(JOB, 5, "s3://bucket/ckpt-5.pt", "0" * 64, "f" * 32, NODES)
        ledger.record_audit(JOB, 5, "loss", [0, 1, 2, 3], True)
        outcome = ledger.record_alarm(
            AlarmIn(
                alarm_id="alarm-8",
                job_id=JOB,
                step=8,
                rank=2,
                node="node-2",
                layer="audit",
                phase="loss",
                suspect_ranks=[2],
                suspect_nodes=["node-2"],
                detail={"mode": "loss"},
                sent_at=datetime.now(UTC),
            )
        )
    return outcome.incident_id


def test_replay_incident_runs_on_one_prefect_server_and_leaves_none(tmp_path: Path) -> None:
    source = f"sqlite:///{tmp_path / 'source.db'}"
    incident_id = _recorded_incident(source, tmp_path)
    summary_path = tmp_path / "summary.json"
    args = ["replay-incident", incident_id, "--database-url", source]
    args += ["--decision", "approve", "--report", str(summary_path)]
    workdir = tmp_path / "rehearsal"

    with cli_process(args, workdir, tmp_path / "home") as rehearsal:
        rehearsal.wait_for_line(re.compile(r"Prefect server started at"), timeout_s=660)
        servers = prefect_processes(rehearsal.note_processes())
        assert len(servers) >= 1

        assert rehearsal.wait(timeout_s=600) == 0, rehearsal.output
        assert "REHEARSAL ended resolved" in rehearsal.output
        assert "temporary server" not in rehearsal.output.lower()
        assert rehearsal.left_behind() == []

    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "resolved"
    assert summary["approval"]["approver"] == "sdcguard replay-incident"
    assert [r["node"] for r in summary["replaced"]] == ["node-2"]
    # one server was started, the rehearsal's own: its home holds the one database
    assert sorted(p.name for p in workdir.glob("**/server.log")) == ["server.log"]
