"""dcgm-exporter scrapes: per-GPU readings, absent fields as None, labels joined per GPU."""

from __future__ import annotations

import pytest

from recovery.errors import PermanentError
from recovery.telemetry import (
    ClockEventReason,
    TelemetryParseError,
    decode_clock_event_mask,
    parse_dcgm_exporter,
)
from tests.recovery.telemetry._files import PACKAGED, read_fixture

L4 = "dcgm-exporter_metrics_L4_dcgm-exporter4x_kops.prom"
T4 = "dcgm-exporter_metrics_T4_datadog-fixture.prom"


def test_l4_scrape_reads_identity_and_the_fields_it_exports() -> None:
    scrape = parse_dcgm_exporter(read_fixture(L4), source=L4)

    assert len(scrape.gpus) == 1
    gpu = scrape.gpus[0]
    assert gpu.gpu == 0
    assert gpu.uuid == "GPU-c2f76b33-7953-256e-8f33-1343419b1a1c"
    assert gpu.pci_bus_id == "0000:31:00.0"
    assert gpu.device == "nvidia0"
    assert gpu.model_name == "NVIDIA L4"
    assert gpu.hostname == "i-030791dc5a37cd257"
    assert gpu.driver_version == "580.105.08"
    assert gpu.temperature_c == 31
    assert gpu.memory_temperature_c == 0
    assert gpu.power_w == pytest.approx(16.365)
    assert gpu.pcie_replay_count == 0
    assert gpu.remapped_rows_correctable == 0
    assert gpu.remapped_rows_uncorrectable == 0
    assert gpu.row_remap_failure is False
    assert scrape.unattributed == ()


def test_fields_the_scrape_does_not_carry_stay_none_not_zero() -> None:
    """The default counters CSV leaves ECC commented out: no counter must not read as no DBE."""
    gpu = parse_dcgm_exporter(read_fixture(L4)).gpus[0]

    assert gpu.ecc_sbe_volatile is None
    assert gpu.ecc_dbe_volatile is None
    assert gpu.ecc_sbe_aggregate is None
    assert gpu.ecc_dbe_aggregate is None
    assert gpu.last_xid is None
    assert gpu.row_remap_pending is None
    assert gpu.clock_event_mask is None
    assert gpu.clock_event_reasons is None


def test_t4_scrape_keeps_gpus_apart_by_uuid_and_lists_unlabelled_fields() -> None:
    """Three GPUs share gpu="0" (three hosts pasted into one file); the UUID tells them apart."""
    scrape = parse_dcgm_exporter(read_fixture(T4))

    assert [gpu.uuid for gpu in scrape.gpus] == [
        "GPU-20c56d28-0da5-6d26-a36a-e7af1ce2586e",
        "GPU-9ef1b6d0-3643-5dd7-b823-c0ec20dcf2d5",
        "GPU-abc",
    ]
    first, second, third = scrape.gpus
    assert first.last_xid == 0
    assert first.temperature_c == 25
    assert first.power_w == pytest.approx(8.969)
    assert first.hostname == "424773df46e0"
    assert first.driver_version == "460.106.00"
    assert first.pci_bus_id is None  # this label set has no pci_bus_id
    assert second.clock_event_mask == 1
    assert second.clock_event_reasons == ("gpu_idle",)
    assert second.hostname == "551bdf382151"
    assert third.model_name == "NVIDIA A10G"
    assert third.temperature_c is None
    # The file's own "# NOTE" says these are unlabelled dummies: listed, not pinned on a GPU.
    assert scrape.unattributed == (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    )


def test_unhealthy_fixture_scrape_reports_the_dbe_and_last_xid() -> None:
    text = (PACKAGED / "unhealthy" / "dcgm-exporter.prom").read_text(encoding="utf-8")

    gpu = parse_dcgm_exporter(text).gpus[0]

    assert gpu.last_xid == 79
    assert gpu.ecc_dbe_volatile == 1
    assert gpu.ecc_dbe_aggregate == 1
    assert gpu.ecc_sbe_volatile == 0
    assert gpu.ecc_sbe_aggregate == 0


def test_mig_instances_of_one_gpu_fold_into_it_keeping_the_worse_reading() -> None:
    """MIG series carry the parent's UUID plus GPU_I_ID; a counter read twice keeps the max."""
    line = next(
        line
        for line in read_fixture(L4).splitlines()
        if line.startswith("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{")
    )
    header = (
        "# HELP DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS x\n"
        "# TYPE DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS counter\n"
    )
    instance_1 = line.replace('gpu="0",', 'gpu="0",GPU_I_ID="1",')
    instance_2 = line.replace('gpu="0",', 'gpu="0",GPU_I_ID="2",').replace("} 0", "} 3")

    scrape = parse_dcgm_exporter(header + instance_1 + "\n" + instance_2 + "\n")

    assert len(scrape.gpus) == 1
    assert scrape.gpus[0].remapped_rows_uncorrectable == 3


def test_clock_event_mask_decodes_nvml_bits_and_keeps_unknown_ones() -> None:
    assert decode_clock_event_mask(0) == ()
    assert decode_clock_event_mask(0x88) == (
        ClockEventReason.HW_SLOWDOWN,
        ClockEventReason.HW_POWER_BRAKE_SLOWDOWN,
    )
    assert decode_clock_event_mask(0x41) == ("gpu_idle", "hw_thermal_slowdown")
    assert decode_clock_event_mask(0x204) == ("sw_power_cap", "bit_0x200")


def test_a_broken_exposition_is_a_permanent_parse_error() -> None:
    cut = read_fixture(L4)[:400]  # ends inside a label set

    with pytest.raises(TelemetryParseError) as caught:
        parse_dcgm_exporter(cut, source="http://10.0.0.7:9400/metrics")

    assert isinstance(caught.value, PermanentError)
    assert caught.value.target == "http://10.0.0.7:9400/metrics"


def test_a_negative_counter_is_rejected() -> None:
    before = '"580.105.08"} 0\n# HELP DCGM_FI_DEV_GPU_UTIL'
    text = read_fixture(L4)
    assert text.count(before) == 1  # the PCIe replay counter, just before GPU_UTIL
    text = text.replace(before, before.replace("} 0", "} -1"))

    with pytest.raises(TelemetryParseError, match="DCGM_FI_DEV_PCIE_REPLAY_COUNTER"):
        parse_dcgm_exporter(text)
