"""The demo end to end for each fault kind: real training processes, the webhook, the ledger,
the incident flow on Prefect, the mocked HyperPod — and the proof that recovery was exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.local.demo import run_demo
from tests.e2e.demo_checks import check_report, demo_config, processes_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(600)]


# act-flip, the default demo, is covered (twice) by test_demo_twice.py.
@pytest.mark.parametrize("fault", ["grad-nan", "reduced-flip", "weight-flip"])
def test_demo_recovers_exactly_from_a_faulty_node(tmp_path: Path, fault: str) -> None:
    config = demo_config(tmp_path, fault)
    report = run_demo(config)

    check_report(report, config)
    assert json.loads(config.report.read_text()) == report  # type: ignore[union-attr]
    png = config.report.with_suffix(".png")  # type: ignore[union-attr]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert processes_under(config.workdir.resolve()) == []
