"""``dcgmi diag -j``: every layout read into per-test, per-GPU results and one overall status."""

from __future__ import annotations

import json

import pytest

from recovery.errors import PermanentError, TemporaryError
from recovery.telemetry import (
    DiagStatus,
    DiagWarning,
    TelemetryParseError,
    TelemetryToolError,
    parse_dcgmi_diag,
)
from tests.recovery.telemetry._files import read_fixture

FOUR_GPU = "dcgmi-diag-j_dcgm-teststring_4gpu_fail-skip-warn.json"
EIGHT_GPU = "dcgmi-diag-j_dcgm3.1.0_8gpu_pass.json"


def test_four_gpu_run_fails_on_sm_stress_of_gpus_0_2_3() -> None:
    report = parse_dcgmi_diag(read_fixture(FOUR_GPU))

    assert report.version == "1.7"
    assert report.layout == "DCGM GPU Diagnostic"
    assert report.overall is DiagStatus.FAIL
    failures = report.failures()
    assert [(result.category, result.test, result.gpu) for result in failures] == [
        ("Stress", "sm_stress", 0),
        ("Stress", "sm_stress", 2),
        ("Stress", "sm_stress", 3),
    ]
    assert failures[0].message == (
        "Max stress level of 2128.7 did not exceed desired stress level of 3000.0 for GPU 0"
    )
    assert failures[0].warnings[0].error_id == 50
    assert failures[0].warnings[0].error_category == 9
    assert failures[0].info == ("GPU 0 temperature average:\t31 C",)


def test_four_gpu_run_splits_shared_results_per_gpu_and_keeps_skip_reasons() -> None:
    report = parse_dcgmi_diag(read_fixture(FOUR_GPU))

    # 10 deployment tests x 4 GPUs + 7 per-GPU tests x 4 GPUs.
    assert len(report.results) == 68
    fabric = [result for result in report.results if result.test == "Fabric Manager"]
    assert [result.gpu for result in fabric] == [0, 1, 2, 3]
    assert {result.status for result in fabric} == {DiagStatus.PASS}

    memory_gpu0 = next(r for r in report.for_gpu(0) if r.test == "memory")
    assert memory_gpu0.status is DiagStatus.SKIP
    assert memory_gpu0.warnings == (
        DiagWarning(
            text='ECC memory on GPU 0 is not currently active. Please use "nvidia-smi -i 0 -e 1" '
            "to enable and reboot.",
            error_id=55,
            error_category=11,
            error_severity=2,
        ),
    )
    stress_gpu1 = next(r for r in report.for_gpu(1) if r.test == "sm_stress")
    assert stress_gpu1.status is DiagStatus.PASS
    assert stress_gpu1.info == (
        "GPU 1 relative stress level:\t577",
        "GPU 1 temperature average:\t32 C",
    )
    assert {r.status for r in report.results if r.test == "targeted_power"} == {DiagStatus.SKIP}


def test_dcgm_3_1_run_passes_on_all_eight_gpus_and_skips_null_entries() -> None:
    report = parse_dcgmi_diag(read_fixture(EIGHT_GPU))

    assert report.version == "3.1.0"
    assert report.overall is DiagStatus.PASS
    assert report.failures() == ()
    # 9 deployment tests for "0,...,7" + the Custom "software" test per integer gpu_ids.
    assert len(report.results) == 80
    for gpu in range(8):
        tests = [result.test for result in report.for_gpu(gpu)]
        assert len(tests) == 10
        assert "Page Retirement/Row Remap" in tests
        assert tests[-1] == "software"


def test_text_before_the_json_is_skipped() -> None:
    """NVIDIA's own test feeds the parser this very line in front of the 3.1.0 output."""
    text = "WARNING: THIS SHOULD NOT HAPPEN\n" + read_fixture(EIGHT_GPU)

    assert parse_dcgmi_diag(text) == parse_dcgmi_diag(read_fixture(EIGHT_GPU))


# DCGM 4.x output was not available as a captured file; this document follows NVIDIA's
# published schema (NVIDIA/DCGM testing/python3/dcgm_diag_schema.json): "DCGM Diagnostic",
# one entity per result, a test_summary per test, metadata.version at the top level.
DCGM4 = {
    "DCGM Diagnostic": {
        "test_categories": [
            {
                "category": "Hardware",
                "tests": [
                    {
                        "name": "memory",
                        "results": [
                            {
                                "entity_group": "GPU",
                                "entity_group_id": 1,
                                "entity_id": 0,
                                "status": "Pass",
                            },
                            {
                                "entity_group": "GPU",
                                "entity_group_id": 1,
                                "entity_id": 1,
                                "status": "Fail",
                                "warnings": [
                                    {
                                        "warning": "GPU 1 memory error",
                                        "error_id": 83,
                                        "error_category": 5,
                                        "error_severity": 2,
                                    }
                                ],
                            },
                        ],
                        "test_summary": {"status": "Fail"},
                    }
                ],
            },
            {
                "category": "Stress",
                "tests": [
                    {
                        "name": "cpu_eud",
                        "results": [
                            {
                                "entity_group": "CPU",
                                "entity_group_id": 7,
                                "entity_id": 0,
                                "status": "Warn",
                                "warnings": [
                                    {
                                        "warning": "CPU 0 slow",
                                        "error_id": 1,
                                        "error_category": 1,
                                        "error_severity": 1,
                                    }
                                ],
                            },
                        ],
                        "test_summary": {"status": "Warn"},
                    }
                ],
            },
        ]
    },
    "entity_groups": [],
    "metadata": {"version": "4.2.3"},
}


def test_dcgm_4_layout_names_one_entity_per_result() -> None:
    report = parse_dcgmi_diag(json.dumps(DCGM4))

    assert report.layout == "DCGM Diagnostic"
    assert report.version == "4.2.3"
    assert report.overall is DiagStatus.FAIL
    assert [(r.test, r.entity_group, r.entity_id, r.status) for r in report.results] == [
        ("memory", "GPU", 0, DiagStatus.PASS),
        ("memory", "GPU", 1, DiagStatus.FAIL),
        ("cpu_eud", "CPU", 0, DiagStatus.WARN),
    ]
    assert report.results[1].gpu == 1
    assert report.results[2].gpu is None
    assert report.results[1].message == "GPU 1 memory error"


def test_a_runtime_error_is_a_temporary_tool_error_not_a_result() -> None:
    document = {"DCGM Diagnostic": {"runtime_error": "Unable to connect to host engine"}}

    with pytest.raises(TelemetryToolError, match="Unable to connect to host engine") as caught:
        parse_dcgmi_diag(json.dumps(document), source="pod ns/p: dcgmi diag -r 1 -j")

    assert isinstance(caught.value, TemporaryError)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("Error: unable to establish a connection to the host engine", "no JSON object"),
        ('{"something": 1}', "no 'DCGM Diagnostic' section"),
        (read_fixture(EIGHT_GPU)[:300], "invalid JSON"),
        (
            read_fixture(FOUR_GPU).replace('"status": "FAIL"', '"status": "BROKEN"', 1),
            "unknown status 'BROKEN'",
        ),
    ],
)
def test_unreadable_output_is_a_permanent_parse_error(text: str, match: str) -> None:
    with pytest.raises(TelemetryParseError, match=match) as caught:
        parse_dcgmi_diag(text)

    assert isinstance(caught.value, PermanentError)
