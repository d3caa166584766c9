"""Session-wide test settings: no telemetry, no network, a private Prefect home."""

from __future__ import annotations

import os
import tempfile

# Prefect reads these at import time; set them before any test module imports prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="sdcguard-prefect-")
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# A temporary local server takes 17-24 s to start on two cores; the default timeout is 20 s.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")

pytest_plugins: list[str] = ["tests.fixtures_db"]
