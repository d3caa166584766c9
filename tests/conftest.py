"""Session-wide test settings: no telemetry, no network, a private Prefect home."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import pytest

# Prefect reads these at import time; set them before any test module imports prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="sdcguard-prefect-")
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# A temporary local server takes 17-24 s to start on two cores; the default timeout is 20 s.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
# torch.compile's C++ kernels are compiled in the process that needs them, not in a pool of
# compile workers: each worker is a fresh interpreter importing torch, which on two cores costs
# more than the suite's small graphs take to compile (a compiled rank started 30 % sooner).
# Read by every process the tests start, training ranks included.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

pytest_plugins: list[str] = ["tests.fixtures_db"]


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """One temporary Prefect server (API + SQLite) for the whole test session; yields its URL.

    ``prefect_test_harness`` points ``PREFECT_API_URL`` at it while the session runs. Starting
    it takes 15-25 s on two cores, hence one per session, shared by every test that needs it.
    """
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        url = PREFECT_API_URL.value()
        assert url, "prefect_test_harness did not set PREFECT_API_URL"
        yield url


@pytest.fixture(autouse=True)
def _no_prefect_worker_outlives_its_test() -> Iterator[None]:
    """What a test emitted to Prefect is delivered before the next test starts.

    Prefect's events worker is one per process and stays bound to the API it first sent to;
    flushed here, after every test (the session's server is still up then), it never carries
    one test's server into another's: each test starts with no worker, whatever ran before.
    """
    from tests.prefect_events import flush

    yield
    flush()


@pytest.fixture(autouse=True)
def _own_destructive_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is its own fleet: its own global concurrency limit around destructive stages.

    The session's Prefect server is shared, and its test harness runs no lease repossessor, so a
    slot left by a test that ended mid-stage (a crash test, a killed worker) would block every
    later test's replacement for good. Flows and subprocesses read the name from the
    environment (``SDCGUARD_FLOW_DESTRUCTIVE_LIMIT``).
    """
    monkeypatch.setenv(
        "SDCGUARD_FLOW_DESTRUCTIVE_LIMIT", f"sdcguard-destructive-{uuid.uuid4().hex[:12]}"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding ``slow`` tests first, each file's tests in their own order.

    ``make test`` hands whole files to its workers (``--dist loadfile --no-loadscope-reorder``):
    with the long end-to-end files taken first, the many short files fill in around them and
    the workers finish together, instead of one starting a four-minute file last.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # a stable sort keeps everything else
