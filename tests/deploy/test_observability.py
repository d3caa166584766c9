"""Item 7 of the deployment: /metrics carries the series an operator watches, log lines are JSON
with the job/incident/rank/node context, /healthz asks the ledger — and a control-plane install
(no torch, moto or matplotlib) imports the flows and serves the webhook."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from db import Ledger
from flows.logs import configure_logging
from flows.webhook import create_app
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import alarm_payload, signed_post

ROOT = Path(__file__).resolve().parents[2]
SECRET = "observability-secret-0123456789abcdef"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_and_json_logs_carry_what_an_operator_needs(ledger: Ledger) -> None:
    stream = io.StringIO()
    handler = configure_logging("json", stream=stream)
    trigger = RecordingTrigger()
    try:
        with run_in_thread(create_app(ledger, trigger, SECRET)) as url:
            first = alarm_payload(job_id="job-m", step=40, rank=1, node="node-1")
            again = alarm_payload(job_id="job-m", step=41, rank=1, node="node-1")
            for body in (first, again):
                assert signed_post(url, SECRET, "/v1/alarms", body).status_code < 300
            text = httpx.get(f"{url}/metrics", timeout=30).text
            health = httpx.get(f"{url}/healthz", timeout=30)
    finally:
        logging.getLogger().removeHandler(handler)
    samples = _samples(text)
    assert samples[("sdcguard_alarms_total", (("layer", "audit"), ("outcome", "opened")))] == 1
    assert samples[("sdcguard_alarms_total", (("layer", "audit"), ("outcome", "joined")))] == 1
    assert samples[("sdcguard_incidents", (("state", "open"),))] == 1
    assert samples[("sdcguard_incidents", (("state", "resolved"),))] == 0
    assert ("sdcguard_trigger_backlog", ()) in samples
    count = sum(v for (n, labels), v in samples.items() if n == "sdcguard_ingest_seconds_count")
    assert count == 2
    assert ("sdcguard_approval_wait_seconds_count", ()) in samples
    assert "sdcguard_stage_duration_seconds" in text
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    records = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    opened = [r for r in records if r.get("message") == "alarm opened an incident"]
    assert opened, records
    assert opened[0]["level"] == "WARNING"
    assert opened[0]["job"] == "job-m"
    assert opened[0]["incident"]  # the incident id rides along with the message


def test_json_lines_keep_rank_and_node_context() -> None:
    stream = io.StringIO()
    handler = configure_logging("json", stream=stream)
    try:
        configure_logging("json", stream=stream)  # idempotent: still one line per record
        logging.getLogger("detection.guard").error(
            "SDC alarm", extra={"job": "j", "incident": "i-1", "rank": 3, "node": "n7"}
        )
    finally:
        for h in [h for h in logging.getLogger().handlers if getattr(h, "_sdcguard_handler", 0)]:
            logging.getLogger().removeHandler(h)
    del handler
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("job", "incident", "rank", "node")} == {
        "job": "j", "incident": "i-1", "rank": 3, "node": "n7"}  # fmt: skip
    assert record["logger"] == "detection.guard"


def test_healthz_fails_when_the_ledger_does_not_answer(tmp_path: Path) -> None:
    broken = Ledger.from_url("postgresql+psycopg://nobody@127.0.0.1:1/absent?connect_timeout=2")
    with run_in_thread(create_app(broken, RecordingTrigger(), SECRET)) as url:
        health = httpx.get(f"{url}/healthz", timeout=30)
        metrics = httpx.get(f"{url}/metrics", timeout=30)
    assert health.status_code == 503
    assert health.json()["status"] == "ledger-unavailable"
    assert metrics.status_code == 503  # never zeros for a ledger it cannot read


CONTROL_PLANE = textwrap.dedent(
    """
    import importlib, importlib.abc, json, pkgutil, sys

    REFUSED = {"torch", "moto", "matplotlib"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"{name} is not in the control-plane image", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    import flows, recovery
    skip = {
        "flows.local.demo",
        "flows.local.rehearsal",
        "recovery.aws.local",
        "recovery.aws.moto_hyperpod",
    }
    names = sorted(
        info.name
        for pkg in (flows, recovery)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
        if info.name not in skip
    )
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            failed[name] = repr(err)

    import httpx
    from db import Ledger
    from db.migrate import upgrade
    from flows.webhook.serve import run_in_thread
    from flows.webhook.trigger import RecordingTrigger
    from flows.webhook import create_app

    url = sys.argv[1]
    upgrade(url)
    with run_in_thread(create_app(Ledger.from_url(url), RecordingTrigger(), "s" * 32)) as base:
        status = httpx.get(base + "/healthz", timeout=30).status_code
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
    print(json.dumps({"imported": len(names), "failed": failed, "healthz": status,
                      "loaded": loaded}))
    """
)


def test_a_control_plane_install_imports_flows_and_serves_the_webhook(tmp_path: Path) -> None:
    """Without torch, moto and matplotlib (refused by a meta-path hook in a fresh interpreter,
    the same packages a ``sdcguard[control-plane]`` install lacks)."""
    done = subprocess.run(
        [sys.executable, "-c", CONTROL_PLANE, f"sqlite:///{tmp_path / 'ledger.db'}"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}
    assert result["imported"] > 40
    assert result["healthz"] == 200
    assert result["loaded"] == []
