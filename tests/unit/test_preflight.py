"""The preflight's decisions (module_utils/regen_preflight.py) over recorded real outputs: nvidia-smi tables
(tests/fixtures/nvidia-smi), lspci ACSCtl lines and /proc/driver/nvidia/version (tests/fixtures/proxmox,
sources in its README), and the real serving lock."""

from __future__ import annotations

from pathlib import Path

from ansible.module_utils import regen_gpu
from ansible.module_utils import regen_preflight as pf
from ansible.module_utils.regen_gpu_requirements import stack_cuda_from_pins
from ansible.module_utils.regen_venv import parse_lock

from tests.helpers.nvidia_smi import parse_table

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"
PROXMOX = ROOT / "tests" / "fixtures" / "proxmox"
STACK_CUDA = stack_cuda_from_pins(parse_lock((ROOT / "envs" / "serving.lock").read_text())["pins"])
GIB = 1024**3


def _facts(name: str) -> dict:
    return regen_gpu.summarize(*parse_table((SMI / name).read_text()))


def _by_check(rows: list[dict]) -> dict[str, dict]:
    return {r["check"]: r for r in rows}


def test_cpu_profile_makes_every_gpu_line_not_applicable():
    rows = pf.gpu_rows({"count": 0, "reason": "nvidia-smi not found"}, "cpu", None, STACK_CUDA, None)
    rows += pf.device_node_rows("cpu", 0, {})
    rows += pf.p2p_rows("cpu", 0, None, None, "")
    rows.append(pf.memlock_row("cpu", 8 << 20, 8 << 20))
    assert {r["verdict"] for r in rows} == {"n/a"}
    assert pf.summarize(rows) == ("ok", [])


def test_old_driver_fails_against_the_pinned_serving_stack_with_the_fix():
    facts = _facts("b200-table-driver580.txt")
    old = dict(facts, driver_version="570.86.15", cuda_version="12.8")
    rows = _by_check(pf.gpu_rows(old, "gpu", None, STACK_CUDA, None))
    assert rows["GPU driver"]["verdict"] == "fail"
    assert "upgrade the host driver" in rows["GPU driver"]["fix"]
    assert rows["GPU count"]["verdict"] == "ok"
    current = _by_check(pf.gpu_rows(facts, "gpu", None, STACK_CUDA, None))
    assert current["GPU driver"]["verdict"] == "ok", current["GPU driver"]


def test_gpu_count_and_weights_against_memory():
    facts = _facts("b200-table-driver580.txt")
    count = facts["count"]
    rows = _by_check(pf.gpu_rows(facts, "gpu", count + 6, STACK_CUDA, None))
    assert rows["GPU count"]["verdict"] == "fail" and "regen_expected_gpu_count" in rows["GPU count"]["fix"]
    assert rows["GPU memory"]["verdict"] == "ok" and rows["GPU memory"]["need"].startswith("unknown")
    too_big = facts["memory_per_gpu_bytes"] * count  # weights alone filling every GPU
    assert _by_check(pf.gpu_rows(facts, "gpu", None, STACK_CUDA, too_big))["GPU memory"]["verdict"] == "fail"
    fits = facts["memory_per_gpu_bytes"] * count // 2
    assert _by_check(pf.gpu_rows(facts, "gpu", None, STACK_CUDA, fits))["GPU memory"]["verdict"] == "ok"


def test_device_nodes_missing_or_not_writable_name_the_fix():
    good = {"exists": True, "char": True, "rw": True}
    nodes = {"nvidiactl": good, "nvidia-uvm": good, "nvidia0": good, "nvidia1": good}
    assert pf.device_node_rows("gpu", 2, nodes)[0]["verdict"] == "ok"
    row = pf.device_node_rows("gpu", 2, {**nodes, "nvidia-uvm": {"exists": False}})[0]
    assert row["verdict"] == "fail" and "/dev/nvidia-uvm" in row["fix"] and "nvidia-modprobe" in row["fix"]
    row = pf.device_node_rows("gpu", 2, {**nodes, "nvidia1": {"exists": True, "char": True, "rw": False}})[0]
    assert row["verdict"] == "fail" and "not readable and writable" in row["fix"]


def test_acs_parsed_from_recorded_lspci_outputs():
    enabled = pf.parse_lspci_acs((PROXMOX / "lspci_acsctl_enabled.txt").read_text())
    disabled = pf.parse_lspci_acs((PROXMOX / "lspci_acsctl_disabled.txt").read_text())
    mixed = pf.parse_lspci_acs((PROXMOX / "lspci_acsctl_mixed_tabs.txt").read_text())
    assert [a["request_redirect"] for a in enabled] == [True]
    assert [a["request_redirect"] for a in disabled] == [False]
    assert len(mixed) == 15 and sum(a["request_redirect"] for a in mixed) == 4
    warn = pf.p2p_rows("gpu", 8, None, mixed, "pt (40 groups)")[0]
    assert warn["verdict"] == "warn" and "pcie_settings_disable_acs" in warn["fix"]
    assert pf.p2p_rows("gpu", 8, None, disabled, "")[0]["verdict"] == "ok"
    measured = {"measured": True, "p2p": False, "reason": "P2P slower"}
    assert pf.p2p_rows("gpu", 8, measured, mixed, "")[0]["verdict"] == "ok"
    assert pf.p2p_rows("gpu", 8, None, None, "")[0]["verdict"] == "warn"


def test_lspci_with_device_headers_names_the_bridge():
    text = (
        "00:01.1 PCI bridge: x\n\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+\n"
        + (PROXMOX / "lspci_acsctl_disabled.txt").read_text()
    )
    assert pf.parse_lspci_acs(text) == [
        {"device": "00:01.1", "request_redirect": True},
        {"device": "bridge #2", "request_redirect": False},
    ]


def test_driver_version_from_recorded_proc_file_and_exact_match():
    version = pf.parse_nvidia_driver_version((PROXMOX / "proc_driver_nvidia_version.txt").read_text())
    assert version == "580.173.02"
    assert pf.version_matches(version, "580.173.02")
    assert not pf.version_matches(version, "580.178.04")
    assert not pf.version_matches(None, "580.173.02")


def test_shm_and_memlock_on_gpu_hosts():
    assert pf.shm_row("gpu", 64 * 1024**2, 32 * GIB)["verdict"] == "fail"
    assert pf.shm_row("gpu", 64 * GIB, 32 * GIB)["verdict"] == "ok"
    assert pf.shm_row("gpu", 64 * GIB, None)["verdict"] == "warn"
    assert pf.memlock_row("gpu", None, None)["verdict"] == "ok"
    row = pf.memlock_row("gpu", 8 << 20, 8 << 20)
    assert row["verdict"] == "fail" and "lxc.prlimit.memlock" in row["fix"]


def _estimate(disk=None, generation_s=None, capture_s=None):
    """The shape of plan.estimate.run (regen_estimate.run_estimate's entry)."""
    return {"plan": {"estimate": {"run": {"value": {
        "disk": disk or {},
        "generation": {"seconds": generation_s, "arithmetic": "generation arithmetic"},
        "capture": {"seconds": capture_s, "arithmetic": "capture arithmetic"},
    }, "reason": "test"}}}}


def test_disk_needs_add_up_per_filesystem_and_unknowns_are_named():
    facts = _estimate({"completions_bytes": 10 * GIB, "features_bytes": 600 * GIB, "checkpoint_bytes": None})
    paths = {"weights": "/m", "completions": "/w", "features": "/w", "checkpoints": "/w"}
    needs = pf.disk_needs(paths, facts, 554 * GIB, "index")
    filesystems = {"/m": {"fs": 1, "free": 1000 * GIB}, "/w": {"fs": 2, "free": 500 * GIB}}
    rows = _by_check(pf.disk_rows(needs, filesystems))
    assert rows["disk: checkpoints"]["verdict"] == "warn"
    assert "estimate.run has no disk.checkpoint_bytes" in rows["disk: checkpoints"]["need"]
    assert rows["disk: weights"]["verdict"] == "ok"
    total = rows["disk: completions + features"]
    assert total["verdict"] == "fail" and "110.0 GiB short" in total["fix"]
    assert pf.disk_rows(needs, {**filesystems, "/w": {"fs": 2, "free": 700 * GIB}})[-1]["verdict"] == "ok"
    unknown = pf.disk_needs(paths, {}, None, "no index")
    assert all(r["verdict"] == "warn" for r in pf.disk_rows(unknown, filesystems))


def test_weights_state_from_index_and_present_shards():
    index = {"metadata": {"total_size": 300}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    assert pf.weights_state(index, {})[:2] == (300, 300)
    assert pf.weights_state(index, {"s1.safetensors": 100})[:2] == (300, 200)
    assert pf.weights_state(index, {"s1.safetensors": 100, "s2.safetensors": 200})[:2] == (300, 0)
    assert pf.weights_state(None, {})[:2] == (None, None)


def test_ports_and_reachability_rows():
    rows = pf.port_rows(
        [
            {"name": "sglang_server_port", "port": 30000, "listening": False},
            {"name": "a", "port": 1, "listening": True, "owner": {"pid": 7, "cmdline": "x", "regen": True}},
            {
                "name": "b",
                "port": 2,
                "listening": True,
                "owner": {"pid": 8, "cmdline": "nc -l", "regen": False},
            },
        ]
    )
    assert [r["verdict"] for r in rows] == ["ok", "ok", "fail"]
    assert "set b to a free port" in rows[2]["fix"]
    rows = pf.reachability_rows(
        [
            {"name": "index", "url": "u", "reachable": False, "error": "refused", "offline_path": "/wh"},
            {"name": "hub", "url": "h", "offline_present": True, "offline_path": "/mirror"},
        ]
    )
    assert [r["verdict"] for r in rows] == ["fail", "ok"] and "/wh" in rows[0]["fix"]


def test_time_estimate_is_unknown_without_a_plan_estimate():
    _, hours, reason = pf.estimate_of({})
    assert pf.time_row(hours, reason)["verdict"] == "warn"
    _, hours, reason = pf.estimate_of(_estimate(generation_s=5400, capture_s=1800))
    assert pf.time_row(hours, reason)["value"] == "2.0 h" and "training time is measured" in reason
    _, hours, reason = pf.estimate_of(_estimate(generation_s=None, capture_s=1800))
    assert hours is None and "generation arithmetic" in reason


def test_the_estimate_of_a_real_plan_reaches_the_disk_rows():
    """Kimi K2.6 NVFP4 (the wheel's config) planned for CT200 with 100,000 prompts: the plan's features
    estimate is what the features row needs; the completions size needs the prompt set's statistics."""
    from ansible.module_utils.regen_config import read_model_dir
    from ansible.module_utils.regen_plan import make_plan

    arch = read_model_dir(str(ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.6-nvfp4"))
    plan = make_plan(arch, None, regen_gpu.described(8, 97887 * 1024**2, "12.0"), prompts={"rows": 100_000})
    disk, hours, reason = pf.estimate_of({"plan": plan})
    assert disk["features"] == plan["estimate"]["run"]["value"]["disk"]["features_bytes"] > 0
    assert disk["completions"] is None and hours is None and "no time" in reason
