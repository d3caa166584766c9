"""The demo end to end for each fault kind: real training processes, the webhook, the ledger,
the incident flow on Prefect, the mocked HyperPod — and the proof that recovery was exact.

The fault kinds share one reference run (it has no fault: the same for each); the first demo
runs it, the others reuse it. act-flip and grad-nan are in ``test_demo_twice.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.local.demo import run_demo
from tests.e2e.demo_checks import check_report, demo_config, processes_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def shared_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the first demo of this module leaves its reference run for the next ones."""
    return tmp_path_factory.mktemp("reference")


@pytest.mark.parametrize("fault", ["reduced-flip", "weight-flip"])
def test_demo_recovers_exactly_from_a_faulty_node(
    tmp_path: Path, fault: str, shared_reference: Path
) -> None:
    config = demo_config(tmp_path, fault)
    if (shared_reference / "reference.json").exists():
        config.reference = shared_reference
    report = run_demo(config)

    check_report(report, config)
    assert json.loads(config.report.read_text()) == report  # type: ignore[union-attr]
    png = config.report.with_suffix(".png")  # type: ignore[union-attr]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert processes_under(config.workdir.resolve()) == []
    run_dir = config.workdir.resolve() / "run"
    for name in ("reference.json", "reference.trace.jsonl"):
        if not (shared_reference / name).exists():
            shutil.copyfile(run_dir / name, shared_reference / name)
