"""The lxc_gpu_container role's plain-LXC path for real (ansible-playbook on localhost) against an LXC config
file: the GPU lines and NCCL's limits are added once, a second run is changed=0, a changed setting replaces
its line. This machine has neither GPUs nor LXC: /dev/null and /dev/zero stand in for GPU nodes (any
character device proves the mechanism: its own major allowed, bind-mounted), and the container is not
started (restart off); see docs/proxmox.md for what runs on a real node."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tests.helpers.ansible import localhost_inventory, run_playbook


def _play(tmp_path: Path) -> Path:
    play = [
        {
            "name": "GPU container on a plain-LXC host (stand-in nodes)",
            "hosts": "regen_hypervisor",
            "gather_facts": False,
            "roles": ["regen", "lxc_gpu_container"],
        }
    ]
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    return path


def test_plain_lxc_config_gets_gpu_lines_and_limits_once(tmp_path):
    lxcpath = tmp_path / "lxc"
    (lxcpath / "standin").mkdir(parents=True)
    config = lxcpath / "standin" / "config"
    config.write_text("lxc.uts.name = standin\nlxc.rootfs.path = dir:/var/lib/lxc/standin/rootfs\n")
    variables = {
        "regen_model_path": str(tmp_path / "m"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "lxc_gpu_container_platform": "lxc",
        "lxc_gpu_container_name": "standin",
        "lxc_gpu_container_lxc_path": str(lxcpath),
        "lxc_gpu_container_gpu_count": 2,
        "lxc_gpu_container_standin_nodes": ["null", "zero"],
        "lxc_gpu_container_restart_on_change": False,
        "lxc_gpu_container_shm_size_gib": 16,
    }
    inventory = localhost_inventory(tmp_path / "hosts.yml", groups=("regen_hypervisor",), variables=variables)
    first = run_playbook(_play(tmp_path), inventory=inventory)
    assert first.returncode == 0, first.output[-3000:]
    text = config.read_text()
    null = os.stat("/dev/null").st_rdev
    assert f"lxc.cgroup2.devices.allow = c {os.major(null)}:{os.minor(null)} rwm" in text
    assert "lxc.mount.entry = /dev/null dev/null none bind,optional,create=file" in text
    assert "lxc.prlimit.memlock = unlimited" in text and "lxc.prlimit.nofile = 1048576" in text
    assert "lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,size=16G,create=dir 0 0" in text
    assert text.startswith("lxc.uts.name = standin\n")

    second = run_playbook(_play(tmp_path), inventory=inventory)
    assert second.returncode == 0 and second.counts()["changed"] == 0, second.output[-3000:]

    bigger = localhost_inventory(
        tmp_path / "hosts.yml",
        groups=("regen_hypervisor",),
        variables={**variables, "lxc_gpu_container_shm_size_gib": 32},
    )
    third = run_playbook(_play(tmp_path), inventory=bigger)
    assert third.returncode == 0, third.output[-3000:]
    text = config.read_text()
    assert "size=32G" in text and "size=16G" not in text
