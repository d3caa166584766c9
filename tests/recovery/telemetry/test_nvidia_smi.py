"""nvidia-smi ``-q -x`` and ``-q``: ECC, remapped rows, identity; N/A as None; cut-off output."""

from __future__ import annotations

import pytest

from recovery.telemetry import (
    SmiEcc,
    SmiRemappedRows,
    TelemetryParseError,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
)
from tests.recovery.telemetry._files import read_fixture

A10G = "nvidia-smi-q-x_A10G_driver515.105.01.xml"
A100_MIG = "nvidia-smi-q-x_A100-SXM4-80GB_MIG_driver535.54.03.xml"
H100 = "nvidia-smi-q_H100-80GB-HBM3-x8_driver535.161.08.txt"
H100_CUT = "nvidia-smi-q_H100-80GB-HBM3-x8_driver535.183.01_truncated.txt"
ZERO = SmiEcc(0, 0, 0, 0, 0, 0)


def test_a10g_xml_full_memory_record() -> None:
    report = parse_nvidia_smi_xml(read_fixture(A10G))

    assert (report.driver_version, report.cuda_version, report.attached_gpus) == (
        "515.105.01",
        "11.7",
        1,
    )
    assert report.timestamp == "Mon Apr 24 16:11:51 2023"
    assert report.complete
    (gpu,) = report.gpus
    assert gpu.index == 0
    assert gpu.uuid == "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94"
    assert gpu.pci_bus_id == "0000:00:1e.0"
    assert gpu.product_name == "NVIDIA A10G"
    assert gpu.mig_enabled is None  # <current_mig>N/A</current_mig>
    assert gpu.ecc_enabled is True
    assert gpu.ecc_volatile == ZERO
    assert gpu.ecc_aggregate == ZERO
    assert gpu.remapped_rows == SmiRemappedRows(
        correctable=0, uncorrectable=0, pending=False, failure=False
    )
    assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pages_pending) == (
        None,
        None,
        None,
    )
    assert gpu.temperature_c == 17
    assert gpu.power_w == pytest.approx(25.58)
    assert gpu.clock_event_reasons == ("gpu_idle",)  # clocks_throttle_reasons naming (v11)
    assert gpu.mig_devices == ()
    assert gpu.unreadable == ()


def test_a100_mig_xml_has_no_remapped_rows_and_describes_one_of_four_gpus() -> None:
    report = parse_nvidia_smi_xml(read_fixture(A100_MIG))

    assert report.driver_version == "535.54.03"
    assert report.attached_gpus == 4
    assert len(report.gpus) == 1
    assert not report.complete
    gpu = report.gpus[0]
    assert gpu.uuid == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert gpu.pci_bus_id == "0000:01:00.0"
    assert gpu.product_name == "NVIDIA A100-SXM4-80GB"
    assert gpu.mig_enabled is True
    assert gpu.ecc_volatile == ZERO
    assert gpu.ecc_aggregate == ZERO
    assert gpu.remapped_rows == SmiRemappedRows()  # <remapped_rows>N/A</remapped_rows>
    assert gpu.temperature_c == 27
    assert gpu.power_w == pytest.approx(67.03)  # gpu_power_readings (v12)
    assert gpu.clock_event_reasons == ()  # clocks_event_reasons, none active
    assert [
        (d.index, d.gpu_instance_id, d.sram_uncorrectable_volatile) for d in gpu.mig_devices
    ] == [
        (0, 3, 0),
        (1, 4, 0),
        (2, 5, 0),
        (3, 6, 0),
    ]


def test_h100_text_eight_gpus_with_split_sram_counters() -> None:
    report = parse_nvidia_smi_text(read_fixture(H100))

    assert (report.driver_version, report.cuda_version, report.attached_gpus) == (
        "535.161.08",
        "12.2",
        8,
    )
    assert report.complete
    assert [gpu.pci_bus_id for gpu in report.gpus] == [
        "0000:19:00.0",
        "0000:3b:00.0",
        "0000:4c:00.0",
        "0000:5d:00.0",
        "0000:9b:00.0",
        "0000:bb:00.0",
        "0000:cb:00.0",
        "0000:db:00.0",
    ]
    first = report.gpus[0]
    assert first.uuid == "GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa"
    assert report.gpus[4].uuid == "GPU-2b6f61f9-8b00-3b57-d912-b62792120662"
    assert first.product_name == "NVIDIA H100 80GB HBM3"
    assert (first.mig_enabled, first.ecc_enabled) == (False, True)
    for gpu in report.gpus:
        # Parity + SEC-DED are summed into sram_uncorrectable.
        assert gpu.ecc_volatile == ZERO
        assert gpu.ecc_aggregate == ZERO
        assert gpu.remapped_rows == SmiRemappedRows(0, 0, False, False)
        assert gpu.retired_pages_sbe is None  # N/A on Hopper
    assert first.temperature_c == 29
    assert first.power_w == pytest.approx(67.74)
    assert first.clock_event_reasons == ("hw_slowdown", "hw_power_brake_slowdown")


def test_cut_off_text_output_parses_what_is_there_and_says_it_is_incomplete() -> None:
    report = parse_nvidia_smi_text(read_fixture(H100_CUT))

    assert report.driver_version == "535.183.01"
    assert report.attached_gpus == 8
    assert len(report.gpus) == 1
    assert not report.complete
    gpu = report.gpus[0]
    assert gpu.uuid == "GPU-566e6f65-c38e-b12f-4824-6944218668b9"
    assert gpu.pci_bus_id == "0000:53:00.0"
    assert gpu.ecc_volatile == SmiEcc()
    assert gpu.remapped_rows == SmiRemappedRows()
    assert gpu.temperature_c is None
    assert gpu.clock_event_reasons is not None
    assert "gpu_idle" in gpu.clock_event_reasons


def test_a_bracketed_error_value_is_none_and_recorded_as_unreadable() -> None:
    text = (
        read_fixture(A10G)
        .replace("<gpu_temp>17 C</gpu_temp>", "<gpu_temp>[GPU requires reset]</gpu_temp>")
        .replace(
            "<dram_uncorrectable>0</dram_uncorrectable>",
            "<dram_uncorrectable>[Unknown Error]</dram_uncorrectable>",
            1,
        )
    )

    (gpu,) = parse_nvidia_smi_xml(text).gpus

    assert gpu.temperature_c is None
    assert gpu.ecc_volatile.dram_uncorrectable is None
    assert gpu.unreadable == (
        "ecc volatile dram_uncorrectable: [Unknown Error]",
        "gpu_temp: [GPU requires reset]",
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (read_fixture(A10G)[:2000], "invalid XML"),
        ("<nvidia_smi>\n</nvidia_smi>", "not <nvidia_smi_log>"),
        (
            read_fixture(A10G).replace("<remapped_row_corr>0<", "<remapped_row_corr>many<"),
            "remapped_row_corr: not a number",
        ),
    ],
)
def test_unreadable_xml_is_a_parse_error(text: str, match: str) -> None:
    with pytest.raises(TelemetryParseError, match=match):
        parse_nvidia_smi_xml(text)


def test_text_without_a_header_or_gpu_is_a_parse_error() -> None:
    with pytest.raises(TelemetryParseError, match="no 'Driver Version'"):
        parse_nvidia_smi_text(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
        )
