"""Replay mode inside a user's own script: a finished replay ends with status 0 even when the
interpreter's teardown would abort the process (as a native thread of the job's libraries can:
"terminate called without an active exception", seen on a replay pod after its trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from detection.guard.trace_mode import END, TRACE_BEGIN

REPO = Path(__file__).resolve().parents[3]
USER_JOB = REPO / "tests" / "recovery" / "user_job" / "train.py"
# An abort at teardown, registered before anything of the job: the last atexit handler to run.
ABORT_AT_TEARDOWN = "import atexit, os, runpy; atexit.register(os.abort); "


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_stand_in_abort_does_abort_a_process_at_teardown() -> None:
    assert _run(ABORT_AT_TEARDOWN, {}).returncode == -6  # SIGABRT


def test_a_finished_replay_exits_0_with_its_trace_whatever_the_teardown_would_do(
    tmp_path: Path,
) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "SDCGUARD_JOB_ID": "job-r",
        "SDCGUARD_WEBHOOK_URL": "http://127.0.0.1:9",  # a replay sends nothing
        "SDCGUARD_WEBHOOK_SECRET": "s" * 32,
        "SDCGUARD_REPLAY_START": "0",
        "SDCGUARD_REPLAY_END": "2",
        "TRAIN_STEP_PAUSE_S": "0",
        "TMPDIR": str(tmp_path),
    }
    code = ABORT_AT_TEARDOWN + f"runpy.run_path({str(USER_JOB)!r}, run_name='__main__')"

    done = _run(code, env)

    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    trace = lines[lines.index(TRACE_BEGIN) + 1 : lines.index(END)]
    assert [json.loads(line)["step"] for line in trace] == [0, 1, 2]
