"""NVML's GPU Recovery Action in the evidence: a GPU stuck needing a reset shows no new Xid."""

from __future__ import annotations

import datetime as dt

import pytest

from recovery.telemetry import (
    Health,
    RecoveryAction,
    SourceReport,
    Tool,
    build_snapshot,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
    parse_recovery_action,
)
from tests.recovery.telemetry._files import read_fixture

A10G = "nvidia-smi-q-x_A10G_driver515.105.01.xml"
# The real A10G output with <gpu_recovery_action>Reset</...> added by hand (SOURCES.md).
A10G_RESET = "DERIVED_nvidia-smi-q-x_A10G_driver515.105.01_gpu-recovery-action-reset.xml"
H100 = "nvidia-smi-q_H100-80GB-HBM3-x8_driver535.161.08.txt"
AT = dt.datetime(2026, 1, 5, 9, 30, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("value", "action"),
    [
        ("None", RecoveryAction.NONE),
        (0, RecoveryAction.NONE),
        ("Reset", RecoveryAction.GPU_RESET),
        ("1", RecoveryAction.GPU_RESET),
        ("Node Reboot", RecoveryAction.NODE_REBOOT),
        (3, RecoveryAction.DRAIN_P2P),
        ("Drain and Reset", RecoveryAction.DRAIN_AND_RESET),
        ("NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET", RecoveryAction.DRAIN_AND_RESET),
        ("[GPU requires reset]", RecoveryAction.UNKNOWN),
        (7, RecoveryAction.UNKNOWN),
        ("N/A", None),
        ("Requested functionality has been deprecated", None),
        (None, None),
    ],
)
def test_nvml_numbers_and_nvidia_smi_words_name_the_action(
    value: str | int | None, action: RecoveryAction | None
) -> None:
    assert parse_recovery_action(value) is action


def test_an_action_we_cannot_name_is_pending_never_none() -> None:
    assert RecoveryAction.UNKNOWN.pending
    assert not RecoveryAction.NONE.pending


def test_a_gpu_whose_driver_asks_for_a_reset_fails_with_no_xid_at_all() -> None:
    (gpu,) = parse_nvidia_smi_xml(read_fixture(A10G_RESET)).gpus
    assert gpu.recovery_action is RecoveryAction.GPU_RESET

    snapshot = build_snapshot(
        "node-2",
        collected_at=AT,
        sources=[SourceReport.ok(Tool.NVIDIA_SMI, "test")],
        nvidia_smi=parse_nvidia_smi_xml(read_fixture(A10G_RESET)),
    )
    assert snapshot.health is Health.FAILED
    assert snapshot.gpus[0].xids == ()
    assert snapshot.gpus[0].recovery_action is RecoveryAction.GPU_RESET
    assert any("Recovery Action is gpu-reset" in r for r in snapshot.reasons)
    assert snapshot.to_dict()["gpus"][0]["recovery_action"] == "gpu-reset"


def test_the_same_gpu_without_the_field_is_healthy_and_reports_no_action() -> None:
    """The real A10G output (driver 515, before the field existed): no reading, no finding."""
    (gpu,) = parse_nvidia_smi_xml(read_fixture(A10G)).gpus
    assert gpu.recovery_action is None
    snapshot = build_snapshot(
        "node-2",
        collected_at=AT,
        sources=[SourceReport.ok(Tool.NVIDIA_SMI, "test")],
        nvidia_smi=parse_nvidia_smi_xml(read_fixture(A10G)),
    )
    assert snapshot.health is Health.HEALTHY
    assert not any("Recovery Action" in r for r in snapshot.reasons)


def test_a_recovery_action_of_none_is_no_finding() -> None:
    xml = read_fixture(A10G_RESET).replace(
        "<gpu_recovery_action>Reset<", "<gpu_recovery_action>None<"
    )
    (gpu,) = parse_nvidia_smi_xml(xml).gpus
    assert gpu.recovery_action is RecoveryAction.NONE
    snapshot = build_snapshot(
        "node-2",
        collected_at=AT,
        sources=[SourceReport.ok(Tool.NVIDIA_SMI, "test")],
        nvidia_smi=parse_nvidia_smi_xml(xml),
    )
    assert snapshot.health is Health.HEALTHY


def test_the_older_reset_status_pair_counts_and_its_deprecation_notice_does_not() -> None:
    base = read_fixture(A10G)
    anchor = "<minor_number>0</minor_number>"

    def with_status(required: str, drain: str) -> str:
        return base.replace(
            anchor,
            anchor + "<gpu_reset_status><reset_required>" + required + "</reset_required>"
            "<drain_and_reset_recommended>" + drain + "</drain_and_reset_recommended>"
            "</gpu_reset_status>",
        )

    (required,) = parse_nvidia_smi_xml(with_status("Yes", "No")).gpus
    assert (required.reset_required, required.drain_and_reset_recommended) == (True, False)
    deprecated = "Requested functionality has been deprecated"
    (new_driver,) = parse_nvidia_smi_xml(with_status(deprecated, deprecated)).gpus
    assert (new_driver.reset_required, new_driver.drain_and_reset_recommended) == (None, None)
    failed = build_snapshot(
        "node-2",
        collected_at=AT,
        sources=[SourceReport.ok(Tool.NVIDIA_SMI, "test")],
        nvidia_smi=parse_nvidia_smi_xml(with_status("Yes", "No")),
    )
    assert failed.health is Health.FAILED
    assert any("reset required" in r for r in failed.reasons)


def test_the_text_format_reads_the_field_where_the_driver_prints_it() -> None:
    """The real H100 ``-q`` text (driver 535) has no such line: no reading. A line added
    in nvidia-smi's layout is read."""
    text = read_fixture(H100)
    assert all(g.recovery_action is None for g in parse_nvidia_smi_text(text).gpus)
    anchor = "    Minor Number                          : "
    assert anchor in text
    added = text.replace(
        anchor, "    GPU Recovery Action                   : Drain and Reset\n" + anchor, 1
    )
    first = parse_nvidia_smi_text(added).gpus[0]
    assert first.recovery_action is RecoveryAction.DRAIN_AND_RESET
