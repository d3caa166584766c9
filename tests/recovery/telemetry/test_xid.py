"""Xid lines in every kernel-log format we have, and the Xid catalogue and policy."""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest

from recovery.telemetry import (
    XID_POLICY,
    XidAction,
    XidSeverity,
    parse_kernel_log,
    xid_catalog,
    xid_info,
)
from tests.recovery.telemetry._files import PACKAGED, read_fixture

ISO = "kmsg_xid48-63-94_dbe-rowremap-contained_dmesg-iso.log"
DECODE_ISO = "kmsg_xid13-43_dmesg-decode-iso.log"
CTIME = "kmsg_xid119_gsp-rpc-timeout_dmesg-ctime.log"
UTC = dt.UTC


def test_dmesg_iso_log_dbe_then_row_remap_then_contained_errors() -> None:
    log = parse_kernel_log(read_fixture(ISO))

    assert [event.xid for event in log.events] == [48, 63] + [94] * 9
    assert {event.pci_bus_id for event in log.events} == {"0000:19:00.0"}
    dbe = log.events[0]
    assert dbe.timestamp == dt.datetime(2024, 11, 15, 12, 2, 3, 470068, tzinfo=UTC)
    assert dbe.pid is None
    assert dbe.process is None
    assert dbe.message.startswith("An uncorrectable double bit error (DBE) has been detected")
    assert dbe.line == 11
    assert log.events[1].message == (
        "Row Remapper: New row (0x00000012bac1c3e0) marked for remapping, reset gpu to activate."
    )
    assert log.events[2].message == "Contained: SM (0x1). RST: No, D-RST: No"
    channel = log.events[3]
    assert (channel.pid, channel.process, channel.message) == (1248209, "python3.10", "Ch 00000008")
    assert log.unparsed == ()


def test_dmesg_decode_iso_log_xid_13_and_43_with_facility_prefix() -> None:
    log = parse_kernel_log(read_fixture(DECODE_ISO))

    assert Counter(event.xid for event in log.events) == {13: 629, 43: 7}
    assert {event.pci_bus_id for event in log.events} == {"0000:38:00.0"}
    first = log.events[0]
    assert first.timestamp == dt.datetime(2025, 1, 21, 2, 21, 33, 498559, tzinfo=UTC)
    assert (
        first.message == "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address"
    )
    stops = [event for event in log.events if event.xid == 43]
    assert [event.pid for event in stops[:2]] == [2815167, 2823801]
    assert {event.process for event in stops} == {"pt_main_thread"}
    assert stops[0].timestamp == dt.datetime(2025, 1, 21, 2, 21, 33, 502278, tzinfo=UTC)
    assert stops[-1].line == 636


def test_dmesg_ctime_log_gsp_timeouts_and_the_pci_to_uuid_announcement() -> None:
    log = parse_kernel_log(read_fixture(CTIME))

    assert [event.xid for event in log.events] == [119] * 5
    assert {event.pci_bus_id for event in log.events} == {"0000:9b:00.0"}
    assert [event.process for event in log.events] == [
        "nvidia-smi",
        "nvidia-smi",
        "nvidia-smi",
        "cache_mgr_main",
        "gpud",
    ]
    assert [event.pid for event in log.events][-2:] == [1263500, 1240590]
    # --ctime prints host local time without a zone: kept naive, not guessed.
    assert log.events[0].timestamp == dt.datetime(2025, 2, 23, 16, 24, 18)
    assert log.events[-1].timestamp == dt.datetime(2025, 2, 23, 16, 30, 13)
    assert log.events[0].message.startswith(
        "Timeout after 6s of waiting for RPC response from GPU4"
    )
    assert dict(log.gpu_uuids) == {"0000:9b:00.0": "GPU-509665ad-b600-ac93-3616-d754b23d636d"}


def test_unhealthy_fixture_log_has_the_xid_79() -> None:
    log = parse_kernel_log((PACKAGED / "unhealthy" / "kmsg.log").read_text(encoding="utf-8"))

    fallen = [event for event in log.events if event.xid == 79]
    assert len(fallen) == 1
    assert fallen[0].pci_bus_id == "0000:00:1e.0"
    assert fallen[0].message == "GPU has fallen off the bus."


# The same real line (first Xid 119 of the ctime log) under the prefixes of the other ways
# of reading the kernel log, and in the older driver shape without pid/name.
_XID_119 = (
    "NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of waiting "
    "for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4)."
)


@pytest.mark.parametrize(
    ("prefix", "timestamp", "uptime"),
    [
        ("[1747282.123456] ", None, 1747282.123456),
        ("6,4711,1747282123456,-;", None, 1747282.123456),
        (
            "2025-02-23T16:24:18+0000 xe9680-07 kernel: ",
            dt.datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC),
            None,
        ),
        ("Feb 23 16:24:18 xe9680-07 kernel: ", None, None),
    ],
    ids=["dmesg-raw", "dev-kmsg", "journalctl-short-iso", "journalctl-short"],
)
def test_other_log_prefixes(
    prefix: str, timestamp: dt.datetime | None, uptime: float | None
) -> None:
    (event,) = parse_kernel_log(prefix + _XID_119 + "\n").events

    assert (event.xid, event.pci_bus_id, event.pid, event.process) == (
        119,
        "0000:9b:00.0",
        2024380,
        "nvidia-smi",
    )
    assert event.timestamp == timestamp
    if uptime is None:
        assert event.uptime_s is None
    else:
        assert event.uptime_s == pytest.approx(uptime)


def test_older_driver_lines_without_pid_and_name() -> None:
    (event,) = parse_kernel_log(
        "[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 79, GPU has fallen off the bus.\n"
    ).events

    assert (event.xid, event.pid, event.process) == (79, None, None)
    assert event.message == "GPU has fallen off the bus."


def test_a_line_that_mentions_xid_but_has_another_shape_is_kept_as_unparsed() -> None:
    odd = "[Sun Feb 23 16:24:18 2025] NVRM: Xid (GPU 4): 119, something new"

    log = parse_kernel_log(read_fixture(CTIME) + odd + "\n")

    assert len(log.events) == 5
    assert log.unparsed == (odd,)


def test_catalogue_is_nvidias_172_xids_with_their_buckets_and_causes() -> None:
    catalogue = xid_catalog()

    assert sorted(catalogue) == list(range(1, 173))
    dbe = catalogue[48]
    assert dbe.mnemonic == "ROBUST_CHANNEL_GPU_ECC_DBE"
    assert dbe.description == "Double Bit ECC Error"
    assert dbe.catalogue_immediate_action == "WORKFLOW_XID_48"
    assert dbe.causes == ("hw_error",)
    assert catalogue[79].catalogue_immediate_action == "RESTART_BM"
    assert catalogue[79].description == "GPU has fallen off the bus"
    assert catalogue[13].mnemonic == (
        "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY"
    )


@pytest.mark.parametrize(
    ("xid", "severity", "action"),
    [
        (13, XidSeverity.WARNING, XidAction.RESTART_APP),
        (31, XidSeverity.WARNING, XidAction.RESTART_APP),
        (43, XidSeverity.INFO, XidAction.NONE),
        (45, XidSeverity.INFO, XidAction.NONE),
        (48, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (61, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (62, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (63, XidSeverity.WARNING, XidAction.RESET_GPU),
        (64, XidSeverity.CRITICAL, XidAction.DRAIN_AND_REPLACE),
        (74, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (79, XidSeverity.CRITICAL, XidAction.DRAIN_AND_REPLACE),
        (92, XidSeverity.WARNING, XidAction.INVESTIGATE),
        (94, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (95, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (119, XidSeverity.CRITICAL, XidAction.RESET_GPU),
        (120, XidSeverity.CRITICAL, XidAction.RESET_GPU),
    ],
)
def test_policy_for_the_common_xids(xid: int, severity: XidSeverity, action: XidAction) -> None:
    info = xid_info(xid)

    assert (info.severity, info.action) == (severity, action)
    assert xid in XID_POLICY
    assert info.why


def test_policy_never_softens_a_catalogue_reset_or_reboot() -> None:
    """Wherever NVIDIA's immediate action is a GPU reset or a machine restart, we say critical."""
    for xid in XID_POLICY:
        info = xid_info(xid)
        if info.catalogue_immediate_action in ("RESET_GPU", "RESTART_BM", "RESTART_VM"):
            assert info.severity is XidSeverity.CRITICAL, xid


def test_xids_outside_the_policy_follow_the_catalogue_bucket() -> None:
    assert (xid_info(140).severity, xid_info(140).action) == (
        XidSeverity.CRITICAL,
        XidAction.RESET_GPU,
    )  # UNRECOVERABLE_ECC_ERROR_ESCAPE, RESET_GPU
    assert xid_info(66).severity is XidSeverity.INFO  # IGNORE
    assert xid_info(68).severity is XidSeverity.WARNING  # RESTART_APP
    assert xid_info(151).action is XidAction.REBOOT_NODE  # RESTART_VM
    assert xid_info(171).action is XidAction.INVESTIGATE  # no bucket yet in the catalogue


def test_an_uncatalogued_xid_is_a_warning_to_investigate() -> None:
    info = xid_info(999)

    assert (info.severity, info.action, info.mnemonic) == (
        XidSeverity.WARNING,
        XidAction.INVESTIGATE,
        None,
    )
