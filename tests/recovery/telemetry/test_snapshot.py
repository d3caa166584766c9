"""Joining the tools per GPU and judging a node: failed, degraded, healthy — and the caveat."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest

from recovery.errors import TemporaryError
from recovery.telemetry import (
    SDC_CAVEAT,
    FixtureTelemetry,
    Health,
    SourceReport,
    SourceStatus,
    TelemetrySnapshot,
    Tool,
    build_snapshot,
    packaged_fixture_root,
    parse_dcgm_exporter,
    parse_dcgmi_diag,
    parse_kernel_log,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
)
from tests.recovery.telemetry._files import PACKAGED, read_fixture

AT = dt.datetime(2026, 1, 5, 9, 30, tzinfo=dt.UTC)


def _clock() -> dt.datetime:
    return AT


def _ok(*tools: Tool) -> list[SourceReport]:
    return [SourceReport.ok(tool, f"test:{tool}") for tool in tools]


def test_packaged_fixtures_are_the_ones_in_the_repository() -> None:
    assert packaged_fixture_root() == PACKAGED


def test_unhealthy_node_fails_naming_xid_79_the_dbe_and_the_failed_diag_test() -> None:
    snapshot = FixtureTelemetry(packaged_fixture_root(), clock=_clock).collect("unhealthy")

    assert snapshot.health is Health.FAILED
    assert snapshot.collected_at == AT
    reasons = "\n".join(snapshot.reasons)
    assert "Xid 79 (GPU has fallen off the bus)" in reasons
    assert "recommended action drain-and-replace" in reasons
    assert "Xid 48 (Double Bit ECC Error)" in reasons
    assert "1 volatile double-bit (DBE, uncorrectable) ECC error(s)" in reasons
    assert "dcgmi diag test 'sm_stress' (Stress) FAIL: Max stress level of 2128.7" in reasons
    (gpu,) = snapshot.gpus
    assert gpu.health is Health.FAILED
    assert gpu.index == 0
    assert gpu.uuid == "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94"
    assert gpu.pci_bus_id == "0000:00:1e.0"
    assert gpu.product == "NVIDIA A10G"
    assert gpu.xids == (48, 63, 79, 94)
    assert gpu.ecc.dbe_volatile == 1
    assert gpu.ecc.dbe_aggregate == 1
    assert [r.test for r in gpu.diag if r.status == "fail"] == ["sm_stress"]
    assert snapshot.sdc_caveat == SDC_CAVEAT
    # The nvidia-smi answer fell back to the healthy node's file and still counts.
    assert snapshot.source(Tool.NVIDIA_SMI) == SourceReport.ok(
        Tool.NVIDIA_SMI, str(PACKAGED / "_default" / "nvidia-smi-q.xml")
    )


def test_healthy_node_is_healthy_and_still_carries_the_sdc_caveat() -> None:
    snapshot = FixtureTelemetry(packaged_fixture_root(), clock=_clock).collect("node-7")

    assert snapshot.health is Health.HEALTHY
    assert snapshot.reasons == []
    assert {report.status for report in snapshot.sources} == {SourceStatus.OK}
    (gpu,) = snapshot.gpus
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (
        0,
        "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94",
        "0000:00:1e.0",
    )
    assert gpu.ecc.sbe_volatile == 0
    assert gpu.ecc.dbe_volatile == 0
    assert gpu.remap.failure is False
    assert gpu.temperature_c == 31  # dcgm-exporter first, nvidia-smi (17 C) second
    assert gpu.clock_event_reasons == ("gpu_idle",)  # only nvidia-smi reports them here
    assert len(gpu.diag) == 10
    assert snapshot.kernel_xids == ()
    assert "does not clear this node of silent data corruption" in snapshot.sdc_caveat
    assert "ECC counters, Xid logs, diagnostics and exit codes green" in snapshot.sdc_caveat


def test_the_caveat_cannot_be_replaced() -> None:
    with pytest.raises(TypeError):
        TelemetrySnapshot(  # type: ignore[call-arg]
            node="n",
            collected_at=AT,
            health=Health.HEALTHY,
            reasons=[],
            gpus=(),
            kernel_xids=(),
            sources=(),
            sdc_caveat="all clear",
        )


def test_to_dict_is_json_evidence_for_the_ledger() -> None:
    snapshot = FixtureTelemetry(packaged_fixture_root(), clock=_clock).collect("unhealthy")

    evidence = json.loads(json.dumps(snapshot.to_dict()))

    assert evidence["node"] == "unhealthy"
    assert evidence["collected_at"] == "2026-01-05T09:30:00+00:00"
    assert evidence["health"] == "failed"
    assert evidence["reasons"] == snapshot.reasons
    assert evidence["sdc_caveat"] == SDC_CAVEAT
    assert [source["tool"] for source in evidence["sources"]] == [
        "dcgm-exporter",
        "dcgmi-diag",
        "kernel-log",
        "nvidia-smi",
    ]
    assert evidence["gpus"][0]["xids"] == [48, 63, 79, 94]
    assert evidence["gpus"][0]["ecc"]["dbe_volatile"] == 1
    assert evidence["kernel_xids"][0]["timestamp"] == "2024-11-15T12:02:03.470068+00:00"
    assert evidence["diag"]["overall"] == "fail"


def test_kernel_xids_join_the_gpu_with_the_same_pci_address() -> None:
    """The Xid 48/63/94 log and the H100 ``-q`` output both name 0000:19:00 (separate hosts)."""
    snapshot = build_snapshot(
        "node-1",
        collected_at=AT,
        sources=_ok(Tool.KERNEL_LOG, Tool.NVIDIA_SMI, Tool.DCGM_EXPORTER, Tool.DCGMI_DIAG),
        kernel_log=parse_kernel_log(
            read_fixture("kmsg_xid48-63-94_dbe-rowremap-contained_dmesg-iso.log")
        ),
        nvidia_smi=parse_nvidia_smi_text(
            read_fixture("nvidia-smi-q_H100-80GB-HBM3-x8_driver535.161.08.txt")
        ),
    )

    assert snapshot.health is Health.FAILED
    assert len(snapshot.gpus) == 8
    first = snapshot.gpus[0]
    assert (first.uuid, first.xids, first.health) == (
        "GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa",
        (48, 63, 94),
        Health.FAILED,
    )
    assert {gpu.health for gpu in snapshot.gpus[1:]} == {Health.HEALTHY}
    assert any(
        "Xid 94 (Contained memory error) 9x in the kernel log: critical" in r
        for r in snapshot.reasons
    )
    assert any(
        "Xid 63 (GPU memory remapping event) 1x" in r and "warning" in r for r in snapshot.reasons
    )


def test_a_gpu_known_only_to_the_kernel_log_keeps_the_uuid_the_driver_announced() -> None:
    snapshot = build_snapshot(
        "xe9680-07",
        collected_at=AT,
        sources=_ok(*Tool),
        kernel_log=parse_kernel_log(read_fixture("kmsg_xid119_gsp-rpc-timeout_dmesg-ctime.log")),
    )

    (gpu,) = snapshot.gpus
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (
        None,
        "GPU-509665ad-b600-ac93-3616-d754b23d636d",
        "0000:9b:00.0",
    )
    assert gpu.xids == (119,)
    assert snapshot.health is Health.FAILED
    assert snapshot.reasons == [
        "GPU (GPU-509665ad-b600-ac93-3616-d754b23d636d, 0000:9b:00.0): Xid 119 (GSP RPC Timeout) "
        "5x in the kernel log: critical, recommended action reset-gpu"
    ]


def test_application_xids_degrade_and_informational_ones_do_not_count() -> None:
    snapshot = build_snapshot(
        "node-2",
        collected_at=AT,
        sources=_ok(*Tool),
        kernel_log=parse_kernel_log(read_fixture("kmsg_xid13-43_dmesg-decode-iso.log")),
    )

    assert snapshot.health is Health.DEGRADED
    assert snapshot.reasons == [
        "GPU (0000:38:00.0): Xid 13 (Graphics Engine Exception) 629x in the kernel log: "
        "warning, recommended action restart-app"
    ]
    assert snapshot.gpus[0].xids == (13, 43)


def test_the_four_gpu_diag_fails_three_gpus_by_dcgm_id() -> None:
    snapshot = build_snapshot(
        "node-4",
        collected_at=AT,
        sources=_ok(*Tool),
        diag=parse_dcgmi_diag(
            read_fixture("dcgmi-diag-j_dcgm-teststring_4gpu_fail-skip-warn.json")
        ),
    )

    assert [(gpu.index, gpu.health) for gpu in snapshot.gpus] == [
        (0, Health.FAILED),
        (1, Health.HEALTHY),
        (2, Health.FAILED),
        (3, Health.FAILED),
    ]
    assert snapshot.reasons[1] == (
        "GPU 2: dcgmi diag test 'sm_stress' (Stress) FAIL: Max stress level of 1096.5 did not "
        "exceed desired stress level of 3000.0 for GPU 2"
    )


def test_a_lifetime_dbe_only_degrades_and_a_pending_remap_degrades() -> None:
    text = (PACKAGED / "unhealthy" / "dcgm-exporter.prom").read_text(encoding="utf-8")
    text = text.replace('DCGM_FI_DEV_XID_ERRORS{gpu="0"', 'DCGM_FI_DEV_XID_ERRORS{gpu="0"')
    lines = []  # the unhealthy scrape with the volatile DBE and the last Xid back at 0
    for line in text.splitlines():
        if line.startswith(("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{", "DCGM_FI_DEV_XID_ERRORS{")):
            line = line.rsplit(" ", 1)[0] + " 0"
        lines.append(line)
    smi = read_fixture("nvidia-smi-q-x_A10G_driver515.105.01.xml").replace(
        "<remapped_row_pending>No<", "<remapped_row_pending>Yes<"
    )

    snapshot = build_snapshot(
        "node-5",
        collected_at=AT,
        sources=_ok(*Tool),
        exporter=parse_dcgm_exporter("\n".join(lines) + "\n"),
        nvidia_smi=parse_nvidia_smi_xml(smi),
    )

    assert snapshot.health is Health.DEGRADED
    assert snapshot.reasons == [
        "GPU 0 (GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94, 0000:00:1e.0): 1 double-bit (DBE, "
        "uncorrectable) ECC error(s) over the board's life, none since the driver loaded",
        "GPU 0 (GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94, 0000:00:1e.0): a row remap is pending; "
        "it takes effect at the next GPU reset",
    ]


def test_a_tool_that_failed_is_recorded_and_degrades_a_clean_node() -> None:
    error = TemporaryError("dcgm-exporter", "scrape", "http://10.0.0.7:9400/metrics", "HTTP 503")
    sources = [
        SourceReport.failed(Tool.DCGM_EXPORTER, "http://10.0.0.7:9400/metrics", error),
        *_ok(Tool.DCGMI_DIAG, Tool.KERNEL_LOG, Tool.NVIDIA_SMI),
    ]

    snapshot = build_snapshot(
        "node-6",
        collected_at=AT,
        sources=sources,
        nvidia_smi=parse_nvidia_smi_xml(read_fixture("nvidia-smi-q-x_A10G_driver515.105.01.xml")),
        kernel_log=parse_kernel_log(""),
        diag=parse_dcgmi_diag(read_fixture("dcgmi-diag-j_dcgm3.1.0_8gpu_pass.json")),
    )

    assert snapshot.health is Health.DEGRADED
    failed = snapshot.source(Tool.DCGM_EXPORTER)
    assert failed is not None
    assert (failed.status, failed.error_type) == (SourceStatus.FAILED, "TemporaryError")
    assert failed.error == "dcgm-exporter: scrape http://10.0.0.7:9400/metrics: HTTP 503"
    assert snapshot.reasons == [
        "dcgm-exporter failed (http://10.0.0.7:9400/metrics): dcgm-exporter: scrape "
        "http://10.0.0.7:9400/metrics: HTTP 503"
    ]


def test_incomplete_nvidia_smi_output_degrades() -> None:
    snapshot = build_snapshot(
        "node-8",
        collected_at=AT,
        sources=_ok(*Tool),
        nvidia_smi=parse_nvidia_smi_text(
            read_fixture("nvidia-smi-q_H100-80GB-HBM3-x8_driver535.183.01_truncated.txt")
        ),
    )

    assert snapshot.health is Health.DEGRADED
    assert snapshot.reasons == [
        "nvidia-smi reports 8 attached GPU(s) but describes 1: its output is incomplete"
    ]


def test_parsed_output_for_a_tool_that_did_not_answer_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="kernel-log output given"):
        build_snapshot("n", collected_at=AT, sources=[], kernel_log=parse_kernel_log(""))


def test_snapshots_are_frozen() -> None:
    snapshot = FixtureTelemetry(packaged_fixture_root(), clock=_clock).collect("node-7")

    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.health = Health.FAILED  # type: ignore[misc]
