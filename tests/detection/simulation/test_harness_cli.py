"""``sdcguard train`` as a command: options, the summary line, exit codes, the webhook wiring
(a real signed-HTTP server on 127.0.0.1) and a clean stop on SIGTERM to the process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from detection.harness import main
from detection.transport.signing import verify

ROOT = Path(__file__).resolve().parents[3]
SECRET = "harness-test-secret"


def test_alarms_are_results_exit_0_and_a_one_line_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "out" / "report.json"
    code = main(
        [
            "--world-size",
            "3",
            "--steps",
            "4",
            "--audit-every",
            "2",
            "--inject",
            "weight-flip@1:2",
            "--report",
            str(report),
            "--job-id",
            "cli-1",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("sdcguard train cli-1: 3 ranks on 3 node(s), 4 steps")
    assert "1 alarm(s) (first: fingerprint/weights at step 2, suspects [1])" in lines[0]
    assert json.loads(report.read_text())["alarms"][0]["suspect_ranks"] == [1]


def test_nodes_option_names_each_rank_and_plain_runs_without_guard(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    assert (
        main(
            [
                "--world-size",
                "2",
                "--steps",
                "2",
                "--nodes",
                "a,b",
                "--plain",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    assert json.loads(report.read_text())["nodes"] == {"0": "a", "1": "b"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--inject", "grad-nan@x:1"], "neither RANK:STEP"),
        (["--plain", "--inject", "grad-nan@0:1"], "--plain runs no sdcguard"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--world-size", "2", "--nodes", "a,b,c"], "one node per rank"),
        (["--probe-step", "3"], "--probe-step and --probe go together"),
        (["--resume-from", "/nonexistent/ckpt.pt"], "no such checkpoint"),
        (["--audit-mode", "weights"], "invalid choice"),
        (["--steps", "many"], "invalid int"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err


class _Webhook:
    """Records every signed POST; answers 202 (alarms) or 200."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.bad_signatures = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    verify(
                        {"default": SECRET.encode()}.get,
                        self.headers,
                        "POST",
                        self.path,
                        raw,
                    )
                except Exception:
                    hook.bad_signatures += 1
                    self.send_response(401)
                    self.end_headers()
                    return
                hook.posts.append((self.path, json.loads(raw)))
                body = json.dumps({"incident_id": "inc-1", "duplicate": False}).encode()
                self.send_response(202 if self.path == "/v1/alarms" else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()


@pytest.fixture
def webhook() -> Iterator[_Webhook]:
    hook = _Webhook()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()


def test_webhook_gets_ranks_provenance_and_one_alarm_from_the_lowest_clean_rank(
    webhook: _Webhook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDCGUARD_WEBHOOK_SECRET", SECRET)
    assert (
        main(
            [
                "--world-size",
                "4",
                "--steps",
                "6",
                "--audit-every",
                "2",
                "--inject",
                "weight-flip@0:3",
                "--webhook",
                webhook.url,
                "--job-id",
                "wh-1",
                "--checkpoint-dir",
                str(tmp_path),
                "--checkpoint-every",
                "2",
            ]
        )
        == 0
    )
    assert webhook.bad_signatures == 0
    by_path: dict[str, list[dict[str, Any]]] = {}
    for path, body in webhook.posts:
        by_path.setdefault(path, []).append(body)
    ranks = by_path["/v1/jobs/wh-1/ranks"]
    assert len(ranks) == 1
    assert [(r["rank"], r["node"]) for r in ranks[0]["ranks"]] == [
        (r, f"node-{r}") for r in range(4)
    ]
    alarms = by_path["/v1/alarms"]
    assert len(alarms) == 1  # one event, one POST — not one per rank
    alarm = alarms[0]
    assert set(alarm) == {
        "alarm_id",
        "job_id",
        "step",
        "rank",
        "node",
        "layer",
        "phase",
        "suspect_ranks",
        "suspect_nodes",
        "detail",
        "sent_at",
    }
    assert (alarm["job_id"], alarm["step"], alarm["layer"], alarm["phase"]) == (
        "wh-1",
        3,
        "fingerprint",
        "weights",
    )
    assert (alarm["suspect_ranks"], alarm["suspect_nodes"]) == ([0], ["node-0"])
    assert (alarm["rank"], alarm["node"]) == (1, "node-1")  # rank 0 is the suspect
    checkpoints = by_path["/v1/jobs/wh-1/checkpoints"]
    assert [c["step"] for c in checkpoints] == [0, 2, 4]
    assert checkpoints[0]["nodes"] == [f"node-{r}" for r in range(4)]
    audits = by_path["/v1/jobs/wh-1/audits"]
    assert [(a["step"], a["kind"], a["passed"]) for a in audits] == [
        (0, "loss", True),
        (2, "loss", True),
        (4, "loss", False),
    ]
    order = [p.rsplit("/", 1)[-1] for p, _ in webhook.posts if p.startswith("/v1/jobs")]
    assert order.index("checkpoints") < order.index("audits")  # ckpt 0 before its audit


def test_sigterm_to_the_process_group_stops_every_rank(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "detection.harness",
            "--world-size",
            "4",
            "--steps",
            "100000",
            "--audit-every",
            "2",
            "--trace",
            str(trace),
            "--report",
            str(report),
        ],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (trace.exists() and len(trace.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 143, err.decode()
    assert b"stopped by SIGTERM" in err
    deadline = time.monotonic() + 10
    while True:  # the whole group is gone: no rank, no fork server left behind
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of the job outlived the launcher"
        time.sleep(0.05)
    # a stopped job still reports, as of its last complete step (the trace's last line)
    assert report.exists(), err.decode()
    stopped = json.loads(report.read_text())
    last = json.loads(trace.read_text().splitlines()[-1])
    assert stopped["stopped_after_step"] == last["step"]
    assert stopped["final_fingerprint"] == last["weight_fingerprint"]
    assert stopped["steps"] == 100000


def test_the_launcher_trains_a_job_without_importing_torch(tmp_path: Path) -> None:
    """Only the ranks import torch (from the fork server, once a job): the launcher's process
    ends a whole job with no ``torch`` module loaded, and the ranks rendezvous all the same."""
    script = (
        "import json, sys\n"
        "from detection.harness import TrainConfig, run\n"
        "report = run(TrainConfig(world_size=2, steps=2, audit_every=1))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'alarms': report['alarms']}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch": False, "alarms": []}
