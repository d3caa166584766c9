"""Key rotation: alarms sent before, during and after a rotation all arrive, each once.

The rotation as an operator runs it: the webhook first accepts the old and the new key (two
keys of the same scope at once), pods move to the new key as they restart — a restarted pod's
new sender re-sends what the old one left spooled, signed with the new key at send time — and
only then is the old key removed.
"""

from __future__ import annotations

import socket
from contextlib import AbstractContextManager
from pathlib import Path

from db import Ledger
from detection.transport.sender import AlarmSender
from flows.webhook import create_app
from flows.webhook.auth import Credentials
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import alarm_payload
from tests.flows.security.conftest import KEY_A, KEY_A_NEW, credentials_document


def _credentials(*key_ids: str) -> Credentials:
    document = credentials_document()
    document["keys"] = [k for k in document["keys"] if k["id"] in key_ids]
    return Credentials.from_mapping(document)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(ledger: Ledger, port: int, *key_ids: str) -> AbstractContextManager[str]:
    app = create_app(ledger, RecordingTrigger(), _credentials(*key_ids))
    return run_in_thread(app, port=port)


def test_alarms_sent_across_a_key_rotation_all_arrive_once(ledger: Ledger, tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    sent: list[str] = []

    def send(sender: AlarmSender, count: int) -> None:
        for _ in range(count):
            payload = alarm_payload(job_id="job-a")
            sent.append(payload["alarm_id"])
            sender.send_alarm(payload)

    old_pod = AlarmSender(
        base,
        KEY_A[1],
        "job-a",
        tmp_path / "pod-0",
        key_id=KEY_A[0],
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    with _serve(ledger, port, KEY_A[0]):  # before: the old key only
        send(old_pod, 5)
        assert old_pod.flush(30)
    with _serve(ledger, port, KEY_A[0], KEY_A_NEW[0]):  # during: both keys are valid
        new_pod = AlarmSender(
            base,
            KEY_A_NEW[1],
            "job-a",
            tmp_path / "pod-1",
            key_id=KEY_A_NEW[0],
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        send(old_pod, 5)
        send(new_pod, 5)
        assert old_pod.flush(30)
        assert new_pod.flush(30)
    # the webhook restarts; pod 0 keeps sending into its spool meanwhile, then restarts itself
    send(old_pod, 5)
    old_pod.close(timeout_s=0.1)
    assert any((tmp_path / "pod-0").glob("*.json")), "the outage should leave alarms spooled"
    with _serve(ledger, port, KEY_A_NEW[0]):  # after: the old key is gone
        restarted = AlarmSender(
            base,
            KEY_A_NEW[1],
            "job-a",
            tmp_path / "pod-0",
            key_id=KEY_A_NEW[0],
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        send(restarted, 5)
        send(new_pod, 5)
        assert restarted.flush(30)
        assert new_pod.flush(30)
        restarted.close()
        new_pod.close()

    [incident] = ledger.list_incidents("job-a")
    recorded = [a.alarm_id for a in incident.alarms]
    assert sorted(recorded) == sorted(sent)  # every alarm, each exactly once
    assert len(sent) == 30
    for pod in ("pod-0", "pod-1"):
        assert not list((tmp_path / pod / "dead").glob("*")), f"{pod} buried an alarm"
