"""The GPU container's configuration, decided from what the node reports (the lxc_gpu_container role).

Pure functions over real outputs (`pct config`, /proc/devices, `ls -l /dev/nvidia*`-like node lists): which
device nodes go into the container, as Proxmox `devN:` entries (pve-container's device passthrough) or as raw
`lxc.cgroup2.devices.allow` (`lxc.cgroup.devices.allow` where the node's devices controller is on cgroup v1)
+ `lxc.mount.entry` lines (older nodes, and plain LXC), the limits NCCL needs
(memlock unlimited, nofile, a /dev/shm of its own size), and what must change for a config to match
(idempotent: nothing when it already does).

nvidia-uvm's character major is assigned at module load (dynamic: 487, 506, 509 ... on real nodes), so it is
read from the node's /proc/devices, never assumed; the GPUs and nvidiactl are major 195.
"""

from __future__ import annotations

import re

NVIDIA_MAJOR = 195
# Nodes every GPU container needs besides /dev/nvidiaN; nvidia-modeset and nvidia-uvm-tools when the node
# has them.
REQUIRED_NODES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_NODES = ("nvidia-uvm-tools", "nvidia-modeset")
# Lines the role owns in a config: replaced as a whole so a changed GPU count or uvm major never leaves a
# stale line behind.
# The device allow key of each cgroup version: LXC applies the one of the hierarchy that holds the devices
# controller and ignores the other, so a line of the wrong version leaves the GPU nodes unopenable (EPERM)
# in a container that starts fine.
ALLOW_KEYS = {1: "lxc.cgroup.devices.allow", 2: "lxc.cgroup2.devices.allow"}
OWNED_KEYS = (*ALLOW_KEYS.values(), "lxc.mount.entry", "lxc.prlimit.memlock", "lxc.prlimit.nofile")


def devices_cgroup_version(proc_cgroups):
    """1 when the node's devices controller sits on a cgroup v1 hierarchy (a hybrid layout: /proc/cgroups
    gives it a hierarchy id), else 2 (the unified layout of Proxmox VE 7 and later: every id is 0)."""
    for line in (proc_cgroups or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == "devices":
            return 1 if fields[1] != "0" and fields[3] == "1" else 2
    return 2


def parse_proc_devices(text):
    """/proc/devices -> {"character": {name: major}, "block": {name: major}}."""
    result = {"character": {}, "block": {}}
    section = None
    for line in (text or "").splitlines():
        stripped = line.strip()
        if stripped.startswith("Character devices"):
            section = "character"
        elif stripped.startswith("Block devices"):
            section = "block"
        elif section and stripped:
            major, _, name = stripped.partition(" ")
            if major.isdigit() and name.strip():
                result[section].setdefault(name.strip(), int(major))
    return result


def parse_ls_dev(text):
    """`ls -l /dev/...` -> {"/dev/nvidia-uvm": {"type": "c", "major": 487, "minor": 0, "mode": ...}}."""
    nodes = {}
    for line in (text or "").splitlines():
        match = re.match(
            r"^([cbdl-][rwxst-]{9})\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+.*?\s(/\S+)$", line.strip()
        )
        if match:
            mode, major, minor, path = match.groups()
            nodes[path] = {"type": mode[0], "major": int(major), "minor": int(minor), "mode": mode}
    return nodes


def parse_pct_config(text):
    """`pct config <vmid>` (or /etc/pve/lxc/<vmid>.conf) -> [(key, value)] of the current section, in order
    (lxc.* keys repeat). Snapshot sections ([name]) end it: their lines are not the running config."""
    pairs = []
    for line in (text or "").splitlines():
        if line.startswith("["):
            break
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition(":")
        if sep:
            pairs.append((key.strip(), value.strip()))
    return pairs


def gpu_nodes(gpu_count, present):
    """The node paths to pass: /dev/nvidia0..N-1, the required ones, and the optional ones the node has.
    Fails (ValueError) naming what the node lacks."""
    wanted = [f"nvidia{i}" for i in range(gpu_count)] + list(REQUIRED_NODES)
    missing = [n for n in wanted if f"/dev/{n}" not in present]
    if missing:
        raise ValueError(
            "the node has no /dev/{}: load the driver and create the nodes first (`nvidia-modprobe -c0 -u`; "
            "the pcie_settings role installs a unit that does it at boot)".format(", /dev/".join(missing))
        )
    return [f"/dev/{n}" for n in wanted] + [f"/dev/{n}" for n in OPTIONAL_NODES if f"/dev/{n}" in present]


def dev_entries(nodes, mode="0666", gid=None):
    """Proxmox `devN:` values (path first, then properties), numbered from dev0."""
    entries = {}
    for i, node in enumerate(nodes):
        value = node + (f",gid={gid}" if gid is not None else "") + (f",mode={mode}" if mode else "")
        entries[f"dev{i}"] = value
    return entries


def raw_device_lines(nodes, majors, cgroup_version=2):
    """A device allow line per major (195 and nvidia-uvm's, read from /proc/devices; the key of the node's
    cgroup version) and one `lxc.mount.entry` per node, as (key, value) pairs."""
    uvm = majors.get("nvidia-uvm")
    if uvm is None:
        raise ValueError(
            "/proc/devices on the node lists no nvidia-uvm: load nvidia_uvm (`nvidia-modprobe -u`)"
        )
    allow = [NVIDIA_MAJOR] + ([uvm] if uvm != NVIDIA_MAJOR else [])
    for name in ("nvidia-caps",):
        if majors.get(name) is not None:
            allow.append(majors[name])
    lines = [(ALLOW_KEYS[cgroup_version], f"c {major}:* rwm") for major in allow]
    lines += [
        ("lxc.mount.entry", f"{node} {node.lstrip('/')} none bind,optional,create=file") for node in nodes
    ]
    return lines


def limit_lines(nofile, shm_size_gib, memlock="unlimited"):
    """memlock (unlimited: NCCL, CUDA pinned memory, Mooncake), nofile, a /dev/shm tmpfs of its own size."""
    return [
        ("lxc.prlimit.memlock", str(memlock)),
        ("lxc.prlimit.nofile", str(int(nofile))),
        ("lxc.mount.entry", f"tmpfs dev/shm tmpfs rw,nosuid,nodev,size={int(shm_size_gib)}G,create=dir 0 0"),
    ]


def _limit_value(value):
    """An lxc.prlimit value (or an rlimit) as a number, None for unlimited."""
    if value is None or str(value).strip().lower() in ("unlimited", "infinity"):
        return None
    return int(value)


def limits_the_node_cannot_grant(memlock, nofile, hard, can_raise_hard, nr_open):
    """Why the container would not start with these limits ([] when it would): LXC sets them on the
    container's init when it starts, which fails, and leaves the container stopped, where the starting
    process may not raise its hard limit that far (no CAP_SYS_RESOURCE) or nofile exceeds fs.nr_open.

    `hard` is {"memlock": bytes or None, "nofile": count or None} of the node's root; None is unlimited."""
    refusals = []
    for name, variable, wanted in (
        ("memlock", "lxc_gpu_container_memlock", _limit_value(memlock)),
        ("nofile", "lxc_gpu_container_nofile", _limit_value(nofile)),
    ):
        limit = _limit_value(hard.get(name))
        if not can_raise_hard and limit is not None and (wanted is None or wanted > limit):
            refusals.append(
                f"lxc.prlimit.{name} = {'unlimited' if wanted is None else wanted} is above the node's hard "
                f"limit {limit} and the node's root may not raise it (no CAP_SYS_RESOURCE): raise the node's "
                f"limit (systemd DefaultLimit{name.upper()}, /etc/security/limits.conf) or set {variable} "
                f"to at most {limit}"
            )
    wanted_nofile = _limit_value(nofile)
    if nr_open is not None and (wanted_nofile is None or wanted_nofile > int(nr_open)):
        refusals.append(
            f"lxc.prlimit.nofile = {nofile} is above the node's fs.nr_open {nr_open}: raise it "
            f"(sysctl fs.nr_open) or set lxc_gpu_container_nofile to at most {nr_open}"
        )
    return refusals


def _owned(key, value):
    if key in ("lxc.prlimit.memlock", "lxc.prlimit.nofile"):
        return True
    if key in ALLOW_KEYS.values():
        return True
    if key == "lxc.mount.entry":
        # By its target: a GPU node or /dev/shm in the container, wherever the source is (some operators
        # bind copies such as /lxc/<id>/devices/nvidia0).
        fields = value.split()
        return len(fields) > 1 and (fields[1].startswith("dev/nvidia") or fields[1] == "dev/shm")
    return False


def plan(current_pairs, want_dev, want_lines):
    """What to change so the config matches: {"set": {devN: value}, "delete": [devN], "add": [(k, v)],
    "remove": [(k, v)], "changed": bool}. Only the keys the role owns are touched (devN, the GPU/shm mount
    entries, device allows and the two prlimits); an allow line for another device stays unless it is one
    the role would write."""
    current_dev = {k: v for k, v in current_pairs if re.fullmatch(r"dev\d+", k)}
    to_set = {k: v for k, v in want_dev.items() if current_dev.get(k) != v}
    to_delete = sorted(
        k for k in current_dev if k not in want_dev and current_dev[k].startswith("/dev/nvidia")
    )
    current_owned = [(k, v) for k, v in current_pairs if k in OWNED_KEYS and _owned(k, v)]
    wanted = list(want_lines)
    allow_wanted = {v for k, v in wanted if k in ALLOW_KEYS.values()}
    remove = []
    for pair in current_owned:
        if pair in wanted:
            continue
        key, value = pair
        # Another device's allow line (e.g. a TPU's c 120:0 rwm) is not the role's to remove: only allow
        # lines for the GPU majors are owned.
        if key in ALLOW_KEYS.values() and not _gpu_allow(value, allow_wanted):
            continue
        remove.append(pair)
    add = [pair for pair in wanted if pair not in current_pairs]
    return {
        "set": to_set,
        "delete": to_delete,
        "add": add,
        "remove": remove,
        "changed": bool(to_set or to_delete or add or remove),
    }


def _gpu_allow(value, allow_wanted):
    match = re.match(r"c (\d+):", value)
    majors = {int(re.match(r"c (\d+):", v).group(1)) for v in allow_wanted if re.match(r"c (\d+):", v)}
    return bool(match) and (int(match.group(1)) == NVIDIA_MAJOR or int(match.group(1)) in majors)


def pct_set_argv(vmid, changes):
    """The one `pct set` call for the devN part of a plan (None when nothing to set or delete)."""
    if not changes["set"] and not changes["delete"]:
        return None
    argv = ["pct", "set", str(vmid)]
    for key, value in sorted(changes["set"].items(), key=lambda kv: int(kv[0][3:])):
        argv += [f"--{key}", value]
    if changes["delete"]:
        argv += ["--delete", ",".join(changes["delete"])]
    return argv


def render_lines(pairs, style):
    """(key, value) pairs as config lines: `key: value` for Proxmox, `key = value` for plain LXC."""
    sep = ": " if style == "proxmox" else " = "
    return [f"{key}{sep}{value}" for key, value in pairs]


def supports_dev_entries(pve_container_version, minimum=(5, 0, 7)):
    """Whether the node's pve-container knows `devN:` (the issue filed against regen names 5.0.7)."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", str(pve_container_version or ""))[:3])
    return bool(numbers) and numbers >= minimum
