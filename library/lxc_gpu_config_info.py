#!/usr/bin/python
"""Ansible module: what a GPU container's config must gain or lose, from what this node reports."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: lxc_gpu_config_info
short_description: Decide the GPU passthrough and limit lines of an LXC container's config on this node
description:
  - Reads the node's C(/proc/devices) (the nvidia-uvm major is dynamic) and which C(/dev/nvidia*) nodes exist,
    and compares the container's current config (O(config), e.g. C(pct config <vmid>) or the plain-LXC config
    file) with what it must hold, as Proxmox C(devN) entries or raw C(lxc.cgroup2.devices.allow) and
    C(lxc.mount.entry) lines (C(lxc.cgroup.devices.allow) where C(/proc/cgroups) puts the node's devices
    controller on a cgroup v1 hierarchy, since LXC ignores the other version's lines), plus
    C(lxc.prlimit.memlock) (unlimited), C(lxc.prlimit.nofile) and a C(/dev/shm) tmpfs of O(shm_size_gib).
  - Fails, before anything is changed, when the node could not grant those limits. LXC sets them on the
    container's init at start and the container does not start where the node's root may not raise its hard
    limit that far (no C(CAP_SYS_RESOURCE)) or O(nofile) exceeds C(fs.nr_open).
  - Changes nothing; returns the one C(pct set) call and the lines to add and remove (empty when the config
    already matches, so the role's second run is changed=0).
version_added: "0.1.0"
author: regen maintainers
options:
  style:
    description: C(proxmox) (colon-separated lines, devN entries possible) or C(lxc) (C(key = value) lines).
    type: str
    required: true
    choices: [proxmox, lxc]
  config:
    description: The container's current config text.
    type: str
    default: ""
  gpu_count:
    description: How many GPUs to pass (C(/dev/nvidia0) to C(/dev/nvidia<count-1>)).
    type: int
    required: true
  use_dev_entries:
    description:
      - Pass devices as Proxmox C(devN) entries (pve-container's device passthrough) instead of raw lines.
    type: bool
    default: false
  vmid:
    description: The Proxmox container id (for the C(pct set) call).
    type: str
    default: ""
  device_mode:
    description: Access mode of the device nodes in the container (devN entries).
    type: str
    default: "0666"
  nofile:
    description: The container's open-files limit.
    type: int
    required: true
  memlock:
    description: The container's locked-memory limit in bytes, or C(unlimited) (what NCCL and CUDA want).
    type: str
    default: unlimited
  shm_size_gib:
    description: Size of the container's C(/dev/shm) tmpfs.
    type: int
    required: true
  proc_devices:
    description: Path of the node's device list.
    type: path
    default: /proc/devices
  proc_cgroups:
    description: Path of the node's cgroup controller list (which cgroup version holds devices).
    type: path
    default: /proc/cgroups
  dev_dir:
    description: Directory of the device nodes on the node.
    type: path
    default: /dev
  node_names:
    description:
      - Names of the GPU device nodes, in order (default nvidia0..N-1, nvidiactl, nvidia-uvm). A test host
        without a GPU names character devices it has instead (a stand-in, named as such in the test).
    type: list
    elements: str
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Decide the GPU lines of CT200
  lxc_gpu_config_info:
    style: proxmox
    config: "{{ _pct_config.stdout }}"
    gpu_count: 8
    use_dev_entries: true
    vmid: "200"
    nofile: 1048576
    shm_size_gib: 64
  register: _gpu_config
"""

RETURN = r"""
nodes:
  description: Device node paths passed into the container.
  returned: always
  type: list
  elements: str
cgroup_version:
  description: The cgroup version of the node's devices controller, whose allow key the lines use (1 or 2).
  returned: always
  type: int
majors:
  description: Character majors of the NVIDIA drivers from /proc/devices (name to major).
  returned: always
  type: dict
pct_set:
  description: The C(pct set) argv for the devN part (empty when nothing to set).
  returned: always
  type: list
  elements: str
add:
  description: Config lines to add.
  returned: always
  type: list
  elements: str
remove:
  description: Config lines to remove.
  returned: always
  type: list
  elements: str
needs_change:
  description: Whether anything differs.
  returned: always
  type: bool
"""

import os
import resource

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_lxc_gpu import (
    ALLOW_KEYS,
    dev_entries,
    devices_cgroup_version,
    gpu_nodes,
    limit_lines,
    limits_the_node_cannot_grant,
    parse_pct_config,
    parse_proc_devices,
    pct_set_argv,
    plan,
    raw_device_lines,
    render_lines,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            style=dict(type="str", required=True, choices=["proxmox", "lxc"]),
            config=dict(type="str", default=""),
            gpu_count=dict(type="int", required=True),
            use_dev_entries=dict(type="bool", default=False),
            vmid=dict(type="str", default=""),
            device_mode=dict(type="str", default="0666"),
            nofile=dict(type="int", required=True),
            memlock=dict(type="str", default="unlimited"),
            shm_size_gib=dict(type="int", required=True),
            proc_devices=dict(type="path", default="/proc/devices"),
            proc_cgroups=dict(type="path", default="/proc/cgroups"),
            dev_dir=dict(type="path", default="/dev"),
            node_names=dict(type="list", elements="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["use_dev_entries"] and p["style"] != "proxmox":
        module.fail_json(msg="devN entries are Proxmox's; plain LXC takes raw lines (use_dev_entries: false)")
    try:
        with open(p["proc_devices"], encoding="utf-8") as handle:
            majors_all = parse_proc_devices(handle.read())["character"]
    except OSError as exc:
        module.fail_json(msg=f"cannot read {p['proc_devices']}: {exc}")
    try:
        with open(p["proc_cgroups"], encoding="utf-8") as handle:
            cgroup_version = devices_cgroup_version(handle.read())
    except OSError as exc:
        module.fail_json(msg=f"cannot read {p['proc_cgroups']}: {exc}")
    present = {os.path.join("/dev", n) for n in os.listdir(p["dev_dir"])}
    try:
        if p["node_names"]:
            missing = [n for n in p["node_names"] if f"/dev/{n}" not in present]
            if missing:
                raise ValueError(f"the node has no /dev/{', /dev/'.join(missing)}")
            nodes = [f"/dev/{n}" for n in p["node_names"]]
            majors = {n: majors_all[n] for n in majors_all}
        else:
            nodes = gpu_nodes(p["gpu_count"], present)
            majors = {n: m for n, m in majors_all.items() if n.startswith("nvidia")}
        current = parse_pct_config(p["config"]) if p["style"] == "proxmox" else _lxc_pairs(p["config"])
        refusals = limits_the_node_cannot_grant(p["memlock"], p["nofile"], **_node_limits())
        if refusals:
            raise ValueError("the container would not start: " + "; ".join(refusals))
        limits = limit_lines(p["nofile"], p["shm_size_gib"], p["memlock"])
        if p["use_dev_entries"]:
            want_dev, want_lines = dev_entries(nodes, mode=p["device_mode"]), limits
        else:
            want_dev = {}
            if p["node_names"]:
                want_lines = _standin_lines(nodes, p["dev_dir"], cgroup_version) + limits
            else:
                want_lines = raw_device_lines(nodes, majors, cgroup_version) + limits
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    changes = plan(current, want_dev, want_lines)
    module.exit_json(
        changed=False,
        nodes=nodes,
        majors=majors,
        cgroup_version=cgroup_version,
        pct_set=pct_set_argv(p["vmid"], changes) or [],
        add=render_lines(changes["add"], p["style"]),
        remove=render_lines(changes["remove"], p["style"]),
        needs_change=changes["changed"],
    )


# CAP_SYS_RESOURCE: lets a process raise its hard limits (capabilities(7)).
_CAP_SYS_RESOURCE = 24


def _node_limits():
    """What this node's root can give a container it starts: its hard limits, whether it may raise them, and
    fs.nr_open (the kernel's ceiling on nofile)."""
    hard = {}
    for name, which in (("memlock", resource.RLIMIT_MEMLOCK), ("nofile", resource.RLIMIT_NOFILE)):
        limit = resource.getrlimit(which)[1]
        hard[name] = None if limit == resource.RLIM_INFINITY else limit
    can_raise = False
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                can_raise = bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    try:
        with open("/proc/sys/fs/nr_open", encoding="utf-8") as handle:
            nr_open = int(handle.read())
    except (OSError, ValueError):
        nr_open = None
    return {"hard": hard, "can_raise_hard": can_raise, "nr_open": nr_open}


def _lxc_pairs(text):
    pairs = []
    for line in (text or "").splitlines():
        if line.strip().startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _standin_lines(nodes, dev_dir, cgroup_version):
    """For stand-in nodes (any character device): allow each one's own major:minor and bind it."""
    lines = []
    for node in nodes:
        st = os.stat(os.path.join(dev_dir, os.path.basename(node)))
        lines.append((ALLOW_KEYS[cgroup_version], f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm"))
    lines += [("lxc.mount.entry", f"{n} {n.lstrip('/')} none bind,optional,create=file") for n in nodes]
    return lines


if __name__ == "__main__":
    main()
