"""The default demo twice in one folder: each run recovers exactly, and the second starts from
a clean state (its own ledger, the same reference). Its own file so that it runs beside the
fault kinds' demos on another test worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from db import Ledger
from flows.local.demo import run_demo
from tests.e2e.demo_checks import check_report, demo_config, processes_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(600)]


def test_the_default_demo_recovers_exactly_and_runs_again_from_a_clean_state(
    tmp_path: Path,
) -> None:
    config = demo_config(tmp_path, "act-flip")
    first = run_demo(config)
    check_report(first, config)
    second = run_demo(config)

    check_report(second, config)
    assert second["reference_fingerprint"] == first["reference_fingerprint"]
    ledger = Ledger.from_url(f"sqlite:///{config.workdir.resolve() / 'run' / 'ledger.db'}")
    assert len(ledger.list_incidents()) == 1  # the second run did not inherit the first's
    assert processes_under(config.workdir.resolve()) == []
