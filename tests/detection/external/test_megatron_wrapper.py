"""The Megatron wrapper as a launcher runs it: a real child process, its signals and exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
WRAPPER = [sys.executable, "-m", "detection.external.megatron", "--"]
# A rank that says it is up, then trains until it is told to stop.
RANK = (
    "import sys, time; print('ready', flush=True); "
    "[time.sleep(0.05) for _ in range(1200)]; sys.exit(0)"
)

pytestmark = pytest.mark.timeout(60)


def test_a_sigterm_reaches_the_rank_and_its_death_is_the_wrappers_exit_code(
    tmp_path: Path,
) -> None:
    """A scheduler's SIGTERM stops the rank, not just the wrapper, and the wrapper exits as the
    rank did (128 + 15); no alarm is attempted, so no webhook is configured at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
    wrapper = subprocess.Popen(
        [*WRAPPER, sys.executable, "-c", RANK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert wrapper.stdout is not None
    assert wrapper.stdout.readline() == b"ready\n"  # passed through from the rank
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=30) == 128 + signal.SIGTERM
    assert wrapper.stderr is not None
    assert b"Traceback" not in wrapper.stderr.read()


def test_exit_17_without_a_webhook_still_exits_17_and_says_why(tmp_path: Path) -> None:
    """A misconfigured wrapper must not change what the scheduler sees: the code passes through
    and the reason it could not report is logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
    env |= {"SDCGUARD_JOB_ID": "job-1", "NODE_NAME": "node-1", "RANK": "3"}
    done = subprocess.run(
        [*WRAPPER[:-1], "--report-all", "--", sys.executable, "-c", "import sys; sys.exit(17)"],
        env=env,
        capture_output=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 17
    assert b"SDCGUARD_WEBHOOK_URL and SDCGUARD_WEBHOOK_SECRET must be set" in done.stderr
