"""gpu_info parsers over recorded outputs of real machines, and the no-GPU answers."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"

from ansible.module_utils.regen_gpu import (
    gather,
    parse_query_csv,
    parse_topology,
    parse_versions,
    summarize,
)

from tests.helpers.nvidia_smi import parse_query_details, parse_table


def _read(name: str) -> str:
    return (SMI / name).read_text(encoding="utf-8")


def test_b200_table_driver_580() -> None:
    gpus, driver, cuda = parse_table(_read("b200-table-driver580.txt"))
    assert [g["index"] for g in gpus] == [0, 1]
    assert {g["name"] for g in gpus} == {"NVIDIA B200"}
    assert [g["pci_bus_id"] for g in gpus] == ["00000000:05:00.0", "00000000:06:00.0"]
    assert all(g["memory_total_mib"] == 183359 for g in gpus)
    assert (driver, cuda) == ("580.95.05", "13.0")
    assert gpus[0]["compute_capability"] == "10.0" and gpus[0]["compute_capability_source"] == "product name"
    assert gpus[0]["architecture"] == "blackwell"


def test_b200_table_with_kmd_umd_header() -> None:
    gpus, driver, cuda = parse_table(_read("b200-table-driver610.txt"))
    assert len(gpus) == 2 and (driver, cuda) == ("610.43.02", "13.3")


def test_rtx_pro_6000_maxq_two_gpu_table() -> None:
    gpus, driver, cuda = parse_table(_read("rtx-pro-6000-maxq-2gpu-table.txt"))
    assert (driver, cuda) == ("595.71.05", "13.2")
    assert [g["index"] for g in gpus] == [0, 1]
    assert [g["pci_bus_id"] for g in gpus] == ["00000000:11:00.0", "00000000:F1:00.0"]
    assert all(g["memory_total_mib"] == 97887 for g in gpus)
    # The table truncates the name; "RTX PRO 6000 Blac..." is still enough to know sm_120.
    assert {g["name"] for g in gpus} == {"NVIDIA RTX PRO 6000 Blac..."}
    assert {(g["compute_capability"], g["architecture"]) for g in gpus} == {("12.0", "blackwell")}
    facts = summarize(gpus)
    assert facts["count"] == 2 and facts["memory_total_bytes"] == 2 * 97887 * 1024 * 1024


def test_rtx_pro_6000_maxq_query_csvs() -> None:
    gpus = parse_query_csv(_read("rtx-pro-6000-maxq-query.csv"))
    assert [(g["name"], g["compute_capability"]) for g in gpus] == [
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "12.0")
    ] * 2
    assert {g["compute_capability_source"] for g in gpus} == {"nvidia-smi"}
    ids = parse_query_csv(_read("rtx-pro-6000-maxq-index-uuid.csv"))
    assert [(g["index"], g["uuid"]) for g in ids] == [
        (0, "GPU-23b4975b-2171-ea56-f5f7-f78bf0cd300a"),
        (1, "GPU-d0b27d44-e215-eeda-b053-6a2342e854c5"),
    ]


def test_rtx_pro_6000_query_details_without_cuda() -> None:
    gpus, driver, cuda, attached = parse_query_details(_read("rtx-pro-6000-server-q-memory.txt"))
    assert (driver, cuda, attached) == ("580.105.06", None, 4)
    assert [g["pci_bus_id"] for g in gpus] == ["00000000:42:00.0"]


def test_query_csv_with_header_real_output() -> None:
    gpus = parse_query_csv(_read("titanv-rtx5880-query.csv"))
    assert [(g["index"], g["name"], g["compute_capability"]) for g in gpus] == [
        (0, "NVIDIA TITAN V", "7.0"),
        (1, "NVIDIA RTX 5880 Ada Generation", "8.9"),
    ]
    assert all(g["driver_version"] == "570.86.15" for g in gpus)
    assert gpus[1]["architecture"] == "ada"


def test_query_csv_noheader_hopper() -> None:
    gpus = parse_query_csv(_read("h100nvl-query-noheader.csv"), ("name", "pci.device_id"))
    assert gpus[0]["name"] == "NVIDIA H100 NVL"
    assert gpus[0]["compute_capability"] == "9.0" and gpus[0]["architecture"] == "hopper"


def test_nvlink_topology() -> None:
    topo = parse_topology(_read("nv18-8gpu-topo.txt"))
    assert topo["kind"] == "nvlink" and topo["links"] == ["NV18"]
    assert topo["gpus"] == 6  # the recorded post stops after GPU5's row
    assert topo["matrix"]["GPU3"]["GPU7"] == "NV18" and "NIC0" not in topo["matrix"]["GPU0"]


@pytest.mark.parametrize(
    ("name", "gpus", "links"), [("rtx5090-2gpu-topo.txt", 2, ["PHB"]), ("rtx4090-8gpu-topo.txt", 8, ["SYS"])]
)
def test_pcie_topologies(name: str, gpus: int, links: list[str]) -> None:
    topo = parse_topology(_read(name))
    assert (topo["kind"], topo["gpus"], topo["links"]) == ("pcie", gpus, links)


def test_topology_without_header_is_unknown() -> None:
    assert parse_topology("GPU0\t X \tNV18\n") is None


def test_versions_absent() -> None:
    assert parse_versions("no smi here") == (None, None)


# ---- An H200 recorded on this workplace's lent GPU machine (bench/gpu_train_smoke.sh's session) ----------


def test_h200_table_query_details_and_csv_agree() -> None:
    gpus, driver, cuda = parse_table(_read("h200-table-driver580.txt"))
    assert (driver, cuda) == ("580.159.04", "13.0")
    names = [(g["index"], g["name"], g["pci_bus_id"]) for g in gpus]
    assert names == [(0, "NVIDIA H200", "00000000:00:06.0")]
    assert gpus[0]["memory_total_mib"] == 143771
    assert (gpus[0]["compute_capability"], gpus[0]["architecture"]) == ("9.0", "hopper")
    detailed, q_driver, q_cuda, attached = parse_query_details(_read("h200-q.txt"))
    assert (q_driver, q_cuda, attached) == ("580.159.04", "13.0", 1)
    assert [g["pci_bus_id"] for g in detailed] == ["00000000:00:06.0"]
    csv = parse_query_csv(_read("h200-query.csv"))
    assert [(g["name"], g["compute_capability"], g["compute_capability_source"]) for g in csv] == [
        ("NVIDIA H200", "9.0", "nvidia-smi")
    ]
    assert summarize(gpus)["memory_total_bytes"] == 143771 * 1024 * 1024


def test_single_gpu_topology_with_the_terminal_escapes_nvidia_smi_writes_to_a_file() -> None:
    """Recorded through a pipe, the header still carries nvidia-smi's underline escapes; one GPU's matrix is
    only its own row (`X`), so no interconnect between GPUs can be named."""
    text = _read("h200-1gpu-topo.txt")
    assert "\x1b[4mGPU0" in text  # the real output, escapes and all
    topo = parse_topology(text)
    assert topo is not None, "the escaped header was not recognised"
    assert (topo["gpus"], topo["kind"], topo["links"]) == (1, "single", []), topo
    assert topo["matrix"] == {"GPU0": {"GPU0": "X"}}


class _Runner:
    """Fault-injection stub for nvidia-smi: answers recorded outputs by argv."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(argv)
        for key, answer in self.answers.items():
            if key in " ".join(argv[1:]) or (key == "" and len(argv) == 1):
                return answer
        return 1, "", "unexpected call"


def test_gather_query_then_table_then_topology() -> None:
    csv = (
        "0, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-a, 00000000:01:00.0, 97887, 580.105.06, 12.0\n"
        "1, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-b, 00000000:02:00.0, 97887, 580.105.06, 12.0\n"
    )
    run = _Runner(
        {
            "--query-gpu": (0, csv, ""),
            "topo": (0, _read("rtx5090-2gpu-topo.txt"), ""),
            "": (0, _read("b200-table-driver580.txt"), ""),
        }
    )
    facts = gather(run, "/usr/bin/nvidia-smi")
    assert facts["count"] == 2 and facts["compute_capabilities"] == ["12.0"]
    assert facts["memory_per_gpu_bytes"] == 97887 * 1024 * 1024
    assert facts["memory_total_bytes"] == 2 * 97887 * 1024 * 1024
    assert facts["cuda_version"] == "13.0" and facts["driver_version"] == "580.105.06"
    assert facts["interconnect"] == "pcie" and facts["architectures"] == ["blackwell"]


def test_gather_retries_without_compute_cap_on_old_drivers() -> None:
    calls = []

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        args = " ".join(argv[1:])
        if "compute_cap" in args:
            return 2, 'Field "compute_cap" is not a valid field to query.', ""
        if args.startswith("--query-gpu"):
            return 0, "0, NVIDIA H100 80GB HBM3, GPU-x, 00000000:18:00.0, 81559, 470.82.01\n", ""
        return 0, "", ""

    facts = gather(run, "nvidia-smi")
    assert facts["count"] == 1 and facts["gpus"][0]["compute_capability"] == "9.0"
    assert facts["gpus"][0]["compute_capability_source"] == "product name"
    assert len([c for c in calls if " ".join(c[1:]).startswith("--query-gpu")]) == 2


def test_no_nvidia_smi_is_count_zero() -> None:
    facts = gather(lambda argv: (0, "", ""), None)
    assert facts["count"] == 0 and "not found" in facts["reason"]


def test_driver_not_loaded_is_count_zero_with_reason() -> None:
    message = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
        "latest NVIDIA driver is installed and running."
    )
    facts = gather(lambda argv: (9, message, ""), "nvidia-smi")
    assert facts["count"] == 0 and "rc 9" in facts["reason"] and "couldn't communicate" in facts["reason"]


def test_summary_of_nothing() -> None:
    facts = summarize([])
    assert facts["count"] == 0 and facts["memory_per_gpu_bytes"] is None and facts["interconnect"] is None
