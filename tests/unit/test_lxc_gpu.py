"""The GPU container's config decisions (module_utils/regen_lxc_gpu.py) over real recorded outputs
(tests/fixtures/proxmox, sources in its README): Proxmox CT configs with raw lxc.* GPU lines and with devN
entries, `ls -l` of the NVIDIA nodes (nvidia-uvm's dynamic major), and this machine's own /proc/devices."""

from __future__ import annotations

import re
from pathlib import Path

from ansible.module_utils import regen_lxc_gpu as lxc

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "proxmox"
NODES_2 = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
# Proxmox's dev[n] format: the path as the default key, then deny-write, gid, mode (octal), uid.
PVE_DEV = re.compile(r"^(path=)?/dev/[\w./-]+(,(deny-write=[01]|gid=\d+|mode=0?[0-7]{3,4}|uid=\d+))*$")


def _uvm_major() -> int:
    return lxc.parse_ls_dev((FIX / "ls_dev_nvidia_uvm.txt").read_text())["/dev/nvidia-uvm"]["major"]


def test_nvidia_uvm_major_is_read_not_assumed():
    nodes = lxc.parse_ls_dev((FIX / "ls_dev_nvidia_uvm.txt").read_text())
    assert nodes["/dev/nvidia-uvm"]["major"] == 487 and nodes["/dev/nvidia-modeset"]["major"] == 195
    lines = lxc.raw_device_lines(NODES_2, {"nvidia-uvm": _uvm_major()})
    assert ("lxc.cgroup2.devices.allow", "c 487:* rwm") in lines
    assert ("lxc.cgroup2.devices.allow", "c 195:* rwm") in lines


def test_proc_devices_parser_on_this_machine():
    text = Path("/proc/devices").read_text()
    parsed = lxc.parse_proc_devices(text)
    assert parsed["character"]["mem"] == 1  # the kernel's memory devices are major 1 everywhere
    try:
        lxc.raw_device_lines(
            NODES_2, {k: v for k, v in parsed["character"].items() if k.startswith("nvidia")}
        )
    except ValueError as exc:  # no NVIDIA driver here: the error says what to load
        assert "nvidia-uvm" in str(exc)


def test_raw_lines_replace_an_operators_gpu_lines_and_keep_other_devices():
    current = lxc.parse_pct_config((FIX / "pve_lxc_2051.conf").read_text())
    want = lxc.raw_device_lines(NODES_2, {"nvidia-uvm": _uvm_major()}) + lxc.limit_lines(1048576, 64)
    changes = lxc.plan(current, {}, want)
    removed = set(changes["remove"])
    assert ("lxc.cgroup2.devices.allow", "c 195:0 rwm") in removed
    assert (
        "lxc.mount.entry",
        "/lxc/102010/devices/nvidia0 dev/nvidia0 none bind,optional,create=file",
    ) in removed
    assert not any("120:" in v or "apex" in v for _, v in removed)  # the TPU's lines stay
    assert ("lxc.prlimit.memlock", "unlimited") in changes["add"]
    assert ("lxc.mount.entry", "tmpfs dev/shm tmpfs rw,nosuid,nodev,size=64G,create=dir 0 0") in changes[
        "add"
    ]
    # Applied, the same decision changes nothing: idempotent against the config it produced.
    after = [pair for pair in current if pair not in removed] + changes["add"]
    again = lxc.plan(after, {}, want)
    assert again["changed"] is False and again == {
        "set": {},
        "delete": [],
        "add": [],
        "remove": [],
        "changed": False,
    }


def test_dev_entries_follow_proxmox_syntax_and_replace_raw_lines():
    current = lxc.parse_pct_config((FIX / "pve_lxc_raw_nvidia.conf").read_text())
    want_dev = lxc.dev_entries(NODES_2)
    assert all(PVE_DEV.match(v) for v in want_dev.values()), want_dev
    changes = lxc.plan(current, want_dev, lxc.limit_lines(1048576, 64))
    argv = lxc.pct_set_argv(200, changes)
    assert argv[:3] == ["pct", "set", "200"] and argv[3:5] == ["--dev0", "/dev/nvidia0,mode=0666"]
    removed = {v for _, v in changes["remove"]}
    assert "c 195:* rwm" in removed and "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file" in removed
    assert "/dev/dri dev/dri none bind,optional,create=dir" not in removed
    # A config that already holds the entries (the recorded devN config's syntax) needs no pct set.
    recorded = lxc.parse_pct_config((FIX / "pve_lxc_dev_entries.conf").read_text())
    assert dict(recorded)["dev0"] == "/dev/dri/card0,gid=44" and PVE_DEV.match(dict(recorded)["dev0"])
    same = lxc.plan(recorded, {"dev0": "/dev/dri/card0,gid=44", "dev1": "/dev/dri/renderD128,gid=104"}, [])
    assert lxc.pct_set_argv(200, same) is None


def test_stale_dev_entries_for_gpus_are_deleted():
    current = [
        ("dev0", "/dev/nvidia0,mode=0666"),
        ("dev1", "/dev/nvidia1,mode=0666"),
        ("dev2", "/dev/dri/card0"),
    ]
    changes = lxc.plan(current, {"dev0": "/dev/nvidia0,mode=0666"}, [])
    assert changes["delete"] == ["dev1"]  # dev2 is not a GPU node: not the role's
    assert lxc.pct_set_argv(200, changes) == ["pct", "set", "200", "--delete", "dev1"]


def test_missing_nodes_name_the_fix_and_versions_gate_dev_entries():
    try:
        lxc.gpu_nodes(2, {"/dev/nvidia0", "/dev/nvidiactl"})
    except ValueError as exc:
        assert "/dev/nvidia1" in str(exc) and "nvidia-modprobe" in str(exc)
    else:
        raise AssertionError("missing nodes accepted")
    assert lxc.gpu_nodes(1, {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"})[
        -1
    ] == ("/dev/nvidia-uvm-tools")
    assert lxc.supports_dev_entries("5.0.7") and lxc.supports_dev_entries("6.0.9")
    assert not lxc.supports_dev_entries("5.0.6") and not lxc.supports_dev_entries("")


def test_snapshot_sections_are_not_the_running_config():
    text = (FIX / "pve_lxc_dev_entries.conf").read_text() + "\n[before-upgrade]\ndev0: /dev/old\n"
    assert dict(lxc.parse_pct_config(text))["dev0"] == "/dev/dri/card0,gid=44"


# /proc/cgroups of a hybrid host (this workplace's machine: the devices controller on v1 hierarchy 5) and of a
# unified one (every controller at hierarchy 0, as on Proxmox VE 7 and later).
HYBRID_CGROUPS = """#subsys_name\thierarchy\tnum_cgroups\tenabled
cpuset\t3\t4\t1
devices\t5\t14\t1
net_cls\t0\t15\t1
"""
UNIFIED_CGROUPS = """#subsys_name\thierarchy\tnum_cgroups\tenabled
cpuset\t0\t120\t1
devices\t0\t120\t1
"""


def test_allow_lines_take_the_key_of_the_nodes_devices_cgroup():
    assert lxc.devices_cgroup_version(HYBRID_CGROUPS) == 1
    assert lxc.devices_cgroup_version(UNIFIED_CGROUPS) == 2
    assert lxc.devices_cgroup_version(Path("/proc/cgroups").read_text()) in (1, 2)
    v1 = lxc.raw_device_lines(NODES_2, {"nvidia-uvm": _uvm_major()}, cgroup_version=1)
    assert ("lxc.cgroup.devices.allow", "c 487:* rwm") in v1
    assert not any(key == "lxc.cgroup2.devices.allow" for key, _ in v1)
    # A config written for the other version is corrected: its GPU allow lines go, the new key's come.
    v2 = lxc.raw_device_lines(NODES_2, {"nvidia-uvm": _uvm_major()}, cgroup_version=2)
    changes = lxc.plan(v2, {}, v1)
    assert {v for k, v in changes["remove"] if k == "lxc.cgroup2.devices.allow"} == {
        "c 195:* rwm",
        "c 487:* rwm",
    }
    assert ("lxc.cgroup.devices.allow", "c 195:* rwm") in changes["add"]


def test_limits_above_what_the_node_can_grant_are_named_with_their_variable():
    capped = {"memlock": 8388608, "nofile": 20000}
    refusals = lxc.limits_the_node_cannot_grant("unlimited", 1048576, capped, False, 1048576)
    assert len(refusals) == 2
    assert "memlock = unlimited" in refusals[0] and "lxc_gpu_container_memlock" in refusals[0]
    assert "at most 8388608" in refusals[0] and "at most 20000" in refusals[1]
    # A root that may raise its hard limits (CAP_SYS_RESOURCE, a real node) gets them; fs.nr_open still caps
    # nofile for everyone.
    assert lxc.limits_the_node_cannot_grant("unlimited", 1048576, capped, True, 1048576) == []
    over = lxc.limits_the_node_cannot_grant("unlimited", 1048577, capped, True, 1048576)
    assert len(over) == 1 and "fs.nr_open 1048576" in over[0]
    # Within the caps nothing is refused; unlimited hard limits never refuse.
    assert lxc.limits_the_node_cannot_grant(8388608, 20000, capped, False, 1048576) == []
    assert (
        lxc.limits_the_node_cannot_grant("unlimited", 1048576, {"memlock": None, "nofile": None}, False, None)
        == []
    )
