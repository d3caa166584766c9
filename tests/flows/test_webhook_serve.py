"""``sdcguard serve`` as an operator runs it: its own process, configured by the environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from db import Ledger
from flows.settings import SettingsError, WebhookSettings, load_settings
from tests.flows.conftest import WEBHOOK_SECRET, alarm_payload, signed_get, signed_post

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_serve_migrates_a_fresh_ledger_and_records_alarms(tmp_path: Path) -> None:
    """…and takes its read limits from the settings: one read per 10 s here, so of three reads
    in a row the first is answered and the others are 429 with Retry-After."""
    url = f"sqlite:///{tmp_path / 'fresh' / 'ledger.db'}"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "SDCGUARD_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "SDCGUARD_DATABASE_URL": url,
        "SDCGUARD_WEBHOOK_READS_PER_S": "0.1",
        "SDCGUARD_WEBHOOK_READ_THREADS": "2",
    }
    proc = _serve(env, "--port", str(port), "--trigger", "none")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "sdcguard serve did not come up"
                time.sleep(0.2)
        response = signed_post(base, WEBHOOK_SECRET, "/v1/alarms", alarm_payload())
        assert response.status_code == 202, response.text
        reads = [signed_get(base, WEBHOOK_SECRET, "/v1/incidents") for _ in range(3)]
        assert [r.status_code for r in reads] == [200, 429, 429], [r.text for r in reads]
        # Retry-After: when the budget has a read again (one per 10 s), not a fixed second
        assert 5 <= int(reads[1].headers["retry-after"]) <= 10
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert WEBHOOK_SECRET not in output
    assert "2 read threads, 0.1 reads/s" in output

    with Ledger.from_url(url) as ledger:
        (incident,) = ledger.list_incidents("job-1")
    assert incident.id == response.json()["incident_id"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "set SDCGUARD_WEBHOOK_SECRET or SDCGUARD_WEBHOOK_CREDENTIALS_FILE"),
        ({"SDCGUARD_WEBHOOK_SECRET": "short-secret"}, "at least 16"),
    ],
)
def test_serve_refuses_a_missing_or_weak_secret_without_echoing_it(
    env: dict[str, str], message: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "SDCGUARD_WEBHOOK_SECRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "serve", "--port", str(_free_port())],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 2
    assert message in proc.stderr
    assert "short-secret" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("name", "value"),
    [("READ_THREADS", "0"), ("READ_THREADS", "65"), ("READS_PER_S", "0"), ("READS_PER_S", "x")],
)
def test_read_limits_out_of_range_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv("SDCGUARD_WEBHOOK_SECRET", WEBHOOK_SECRET)
    monkeypatch.setenv(f"SDCGUARD_WEBHOOK_{name}", value)
    with pytest.raises(SettingsError, match=f"SDCGUARD_WEBHOOK_{name}"):
        load_settings(WebhookSettings)
