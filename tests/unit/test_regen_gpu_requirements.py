"""GPU host decisions (module_utils/regen_gpu_requirements.py) over recorded nvidia-smi outputs of real
machines (tests/fixtures/nvidia-smi, parsed by gpu_info's own parsers) and the real serving lock."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils import regen_gpu
from ansible.module_utils import regen_gpu_requirements as req
from ansible.module_utils.regen_venv import parse_lock

from tests.helpers.nvidia_smi import parse_query_details, parse_table

FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
SERVING_PINS = parse_lock((ROOT / "envs" / "serving.lock").read_text())["pins"]


def _table(name: str, count: int | None = None) -> dict:
    gpus, driver, cuda = parse_table((FIXTURES / name).read_text())
    if count:  # the archived posts were cut after two GPUs; the machines had `count`
        gpus = [dict(gpus[i % len(gpus)], index=i) for i in range(count)]
    return regen_gpu.summarize(gpus, driver, cuda)


def _rtx_pro_6000(driver: str, cuda: str | None, count: int = 8) -> dict:
    """Facts as gpu_info gives them for RTX PRO 6000 Blackwell (no full recorded output exists; the
    driver of the recorded -q output is used where it fits, see the fixtures README)."""
    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    gpu = {
        "index": 0,
        "name": name,
        "uuid": None,
        "pci_bus_id": None,
        "memory_total_mib": 97887,
        "memory_total_bytes": 97887 * 2**20,
        "driver_version": driver,
        "compute_capability": regen_gpu.capability_from_name(name),
        "architecture": "blackwell",
    }
    return regen_gpu.summarize([dict(gpu, index=i) for i in range(count)], driver, cuda)


def test_serving_lock_needs_cuda_13() -> None:
    assert req.stack_cuda_from_pins(SERVING_PINS) == (13, 0)
    assert req.stack_cuda_from_pins(parse_lock((ROOT / "envs" / "demo.lock").read_text())["pins"]) is None
    assert req.stack_cuda_from_pins({"torch": "2.9.1+cu128"}) == (12, 8)
    assert req.min_driver_for_cuda((13, 0)) == (580, 0)
    assert req.min_driver_for_cuda((12, 8)) == (525, 60)


def test_b200_on_driver_580_fits_the_cuda13_stack() -> None:
    facts = _table("b200-table-driver580.txt", count=8)
    assert facts["compute_capabilities"] == ["10.0"]
    result = req.check_host(facts, "gpu", 8, req.stack_cuda_from_pins(SERVING_PINS))
    assert result["errors"] == [], result
    assert "8 x NVIDIA B200, driver 580.95.05, CUDA 13.0" in result["notes"]


def test_newer_driver_header_also_fits() -> None:
    facts = _table("b200-table-driver610.txt")
    assert req.check_host(facts, "gpu", None, (13, 0))["errors"] == []


def test_missing_gpus_are_counted() -> None:
    facts = _table("b200-table-driver580.txt")  # the two GPUs the archive kept
    [error] = req.check_host(facts, "gpu", 8, (13, 0))["errors"]
    assert "2 GPU(s) visible but regen_expected_gpu_count is 8" in error


def test_blackwell_on_a_cuda_12_4_driver_is_refused_with_the_numbers() -> None:
    facts = _rtx_pro_6000("550.54.15", "12.4")
    errors = req.check_host(facts, "gpu", 8, (13, 0))["errors"]
    assert any(
        "sm_120, Blackwell) needs CUDA 12.8 or newer, but the driver 550.54.15 supports only CUDA 12.4" in e
        for e in errors
    ), errors
    assert any("needs driver R570 or newer" in e for e in errors)
    assert any("built for CUDA 13.0, which needs driver 580.0 or newer" in e for e in errors)


def test_blackwell_on_r570_fits_cuda_12_8_but_not_the_cuda13_stack() -> None:
    facts = _rtx_pro_6000("570.86.15", "12.8")
    assert req.check_host(facts, "gpu", 8, (12, 8))["errors"] == []
    [error] = req.check_host(facts, "gpu", 8, (13, 0))["errors"]
    assert "needs driver 580.0 or newer; this host has 570.86.15 (CUDA 12.8)" in error


def test_vgpu_host_without_cuda_version_is_checked_on_the_driver_alone() -> None:
    _gpus, driver, cuda, attached = parse_query_details(
        (FIXTURES / "rtx-pro-6000-server-q-memory.txt").read_text()
    )
    assert (driver, cuda, attached) == ("580.105.06", None, 4)
    facts = _rtx_pro_6000(driver, cuda, count=attached)
    result = req.check_host(facts, "gpu", 4, (13, 0))
    assert result["errors"] == []
    assert any("no CUDA version" in w for w in result["warnings"])


def test_no_gpu_is_fine_for_cpu_and_an_error_for_gpu() -> None:
    none = regen_gpu.summarize([], reason="nvidia-smi not found on PATH")
    cpu = req.check_host(none, "cpu", None, None)
    assert cpu["errors"] == [] and "profile 'cpu' needs none" in cpu["notes"][0]
    [error] = req.check_host(none, "gpu", 8, (13, 0))["errors"]
    assert "no GPU is visible" in error and "/dev/nvidia*" in error


def test_old_generations_are_checked_too() -> None:
    facts = regen_gpu.summarize(
        regen_gpu.parse_query_csv((FIXTURES / "titanv-rtx5880-query.csv").read_text()), "570.86.15", "12.8"
    )
    result = req.check_host(facts, "gpu", 2, (13, 0))
    assert any("compute capability 7.0 is older" in w for w in result["warnings"])
    assert any("needs driver 580.0" in e for e in result["errors"])


def test_device_nodes_inside_the_container() -> None:
    full = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] + [f"nvidia{i}" for i in range(8)]
    assert req.check_device_nodes(full, 8) == []
    [error] = req.check_device_nodes([e for e in full if e not in ("nvidia7", "nvidia-uvm")], 8)
    assert "/dev/nvidia-uvm, /dev/nvidia7 missing" in error
    assert req.check_device_nodes([], 0) == []


TORCH_CU13 = {
    "ok": True,
    "version": "2.14.1+cu130",
    "cuda": "13.0",
    "cuda_available": True,
    "device_count": 8,
    "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
}


def test_torch_with_blackwell_arch_sees_every_gpu() -> None:
    facts = _rtx_pro_6000("580.95.05", "13.0")
    assert req.check_torch(TORCH_CU13, facts, 8) == {"errors": [], "warnings": []}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"device_count": 6}, "torch sees 6 GPU(s), expected 8"),
        ({"cuda_available": False}, "cannot use the GPUs"),
        ({"cuda": None}, "CPU-only build"),
        ({"arch_list": ["sm_80", "sm_90"]}, "is not built for sm_120 (Blackwell)"),
        ({"ok": False, "error": "ImportError: libcudart.so.13"}, "torch does not import"),
    ],
)
def test_torch_problems(change: dict, fragment: str) -> None:
    facts = _rtx_pro_6000("580.95.05", "13.0")
    errors = req.check_torch(dict(TORCH_CU13, **change), facts, 8)["errors"]
    assert any(fragment in e for e in errors), errors


def test_torch_with_only_older_ptx_warns() -> None:
    facts = _rtx_pro_6000("580.95.05", "13.0")
    result = req.check_torch(dict(TORCH_CU13, arch_list=["sm_90", "compute_90"]), facts, 8)
    assert result["errors"] == [] and "JIT from compute_90" in result["warnings"][0]


def test_torch_cuda_arch_list() -> None:
    assert req.torch_cuda_arch_list(["12.0", "10.0", "9.0"]) == "9.0;10.0;12.0"
    assert req.arch_tag("12.0") == "sm_120" and req.arch_tag("10.0") == "sm_100"
