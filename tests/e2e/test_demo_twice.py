"""Two demos in one folder: the default one (act-flip), then grad-nan. Each recovers exactly,
and the second starts from a clean state (its own ledger, its own reference run — the same
weights). Its own file so that it runs beside the other fault kinds' demos on another worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from db import Ledger
from flows.local.demo import run_demo
from tests.e2e.demo_checks import check_report, demo_config, processes_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(900)]


def test_two_demos_in_one_folder_each_recover_exactly_and_the_second_starts_clean(
    tmp_path: Path,
) -> None:
    first_config = demo_config(tmp_path, "act-flip")
    first = run_demo(first_config)
    check_report(first, first_config)
    assert processes_under(first_config.workdir.resolve()) == []

    config = demo_config(tmp_path, "grad-nan")  # the same folder, another fault
    second = run_demo(config)

    check_report(second, config)
    assert second["reference_fingerprint"] == first["reference_fingerprint"]
    ledger = Ledger.from_url(f"sqlite:///{config.workdir.resolve() / 'run' / 'ledger.db'}")
    (incident,) = ledger.list_incidents()  # the second run did not inherit the first's
    assert incident.job_id == "demo-job"
    assert processes_under(config.workdir.resolve()) == []
