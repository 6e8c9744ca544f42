"""The lxc_gpu_container role's plain-LXC path for real (ansible-playbook on localhost) against an LXC config
file: the GPU lines and NCCL's limits are added once, a second run is changed=0, a changed setting replaces
its line. This machine has neither GPUs nor LXC: /dev/null and /dev/zero stand in for GPU nodes (any
character device proves the mechanism: its own major allowed, bind-mounted), and the container is not
started (restart off); see docs/proxmox.md for what runs on a real node, and
tests/e2e/test_gpu_container_and_weights_lxc.py for the role against a running container."""

from __future__ import annotations

import os
import resource
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


def _grantable_limits() -> dict[str, object]:
    """Limits this machine's root can give a container whatever its capabilities: its own hard limits (a
    test host in a sandbox may not raise them; a real node grants memlock unlimited)."""
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    return {
        "lxc_gpu_container_memlock": "unlimited" if memlock == resource.RLIM_INFINITY else str(memlock),
        "lxc_gpu_container_nofile": nr_open if nofile == resource.RLIM_INFINITY else min(nofile, nr_open),
    }


def _allow_key() -> str:
    # The devices controller mounted as a v1 hierarchy (a hybrid host) takes the v1 key; unified hosts v2.
    return (
        "lxc.cgroup.devices.allow" if Path("/sys/fs/cgroup/devices").is_dir() else "lxc.cgroup2.devices.allow"
    )


def _standin(tmp_path: Path, text: str, **overrides: object) -> tuple[Path, dict[str, object]]:
    """A plain-LXC config file `standin` holding `text`, and the role's variables for it (restart off)."""
    lxcpath = tmp_path / "lxc"
    (lxcpath / "standin").mkdir(parents=True)
    config = lxcpath / "standin" / "config"
    config.write_text(text)
    variables = {
        "regen_model_path": str(tmp_path / "m"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "lxc_gpu_container_platform": "lxc",
        "lxc_gpu_container_name": "standin",
        "lxc_gpu_container_lxc_path": str(lxcpath),
        "lxc_gpu_container_restart_on_change": False,
        **_grantable_limits(),
        **overrides,
    }
    return config, variables


def test_plain_lxc_config_gets_gpu_lines_and_limits_once(tmp_path):
    config, variables = _standin(
        tmp_path,
        "lxc.uts.name = standin\nlxc.rootfs.path = dir:/var/lib/lxc/standin/rootfs\n",
        lxc_gpu_container_gpu_count=2,
        lxc_gpu_container_standin_nodes=["null", "zero"],
        lxc_gpu_container_shm_size_gib=16,
    )
    inventory = localhost_inventory(tmp_path / "hosts.yml", groups=("regen_hypervisor",), variables=variables)
    first = run_playbook(_play(tmp_path), inventory=inventory)
    assert first.returncode == 0, first.output[-3000:]
    text = config.read_text()
    null = os.stat("/dev/null").st_rdev
    assert f"{_allow_key()} = c {os.major(null)}:{os.minor(null)} rwm" in text
    assert "lxc.mount.entry = /dev/null dev/null none bind,optional,create=file" in text
    limits = _grantable_limits()
    assert f"lxc.prlimit.memlock = {limits['lxc_gpu_container_memlock']}" in text
    assert f"lxc.prlimit.nofile = {limits['lxc_gpu_container_nofile']}" in text
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


def test_limits_the_node_cannot_grant_are_refused_before_the_config_changes(tmp_path):
    """LXC sets the limits on the container's init at start: one above fs.nr_open (any node) would leave the
    container stopped, so the role refuses it before writing anything, naming the variable."""
    original = "lxc.uts.name = standin\n"
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    config, variables = _standin(
        tmp_path,
        original,
        lxc_gpu_container_gpu_count=1,
        lxc_gpu_container_standin_nodes=["null"],
        lxc_gpu_container_nofile=nr_open + 1,
    )
    inventory = localhost_inventory(tmp_path / "hosts.yml", groups=("regen_hypervisor",), variables=variables)
    run = run_playbook(_play(tmp_path), inventory=inventory)
    assert run.returncode != 0, run.output[-3000:]
    assert "the container would not start" in run.output and f"fs.nr_open {nr_open}" in run.output
    assert "lxc_gpu_container_nofile" in run.output
    assert config.read_text() == original
