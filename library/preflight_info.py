#!/usr/bin/python
"""Ansible module: read everything a run needs on this host and return one table of verdicts and fixes."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: preflight_info
short_description: One table of what a regen run needs on this host, each line with a verdict and its fix
description:
  - Reads, never changes, the GPU count, memory and driver (from O(gpu), the gpu_info facts) against the
    pinned serving stack's CUDA, the GPU device nodes and their permissions, NCCL peer-to-peer (the
    provision stage's measurement and the ACS state from C(lspci -vvv)), the size of C(/dev/shm), the
    locked-memory limit, the free disk for the weights, completions, features and checkpoints, the ports
    the run binds, and whether the package index and the hub answer (or their offline alternative exists).
  - Verdicts are C(ok), C(warn) (unknown or marginal, said so), C(fail) (the run would stop later) and
    C(n/a) (not needed here, e.g. GPU lines on the CPU profile). The module never fails on a C(fail) row;
    the preflight role does, with the fixes.
version_added: "0.1.0"
author: regen maintainers
options:
  profile:
    description: C(gpu) requires GPUs; C(cpu) makes the GPU lines not applicable.
    type: str
    required: true
    choices: [cpu, gpu]
  gpu:
    description: The C(gpu) document of the gpu_info module.
    type: dict
    required: true
  expected_count:
    description: GPUs that must be visible (omit for any number).
    type: int
  serving_lock:
    description: Text of the serving lock; its CUDA runtime pin sets the driver floor. Empty for none.
    type: str
    default: ""
  model_path:
    description: The model directory on this host (its weight index tells how much is still to fetch).
    type: path
    required: true
  paths:
    description: Host paths of the weights, completions, features and checkpoints (need not exist yet).
    type: dict
    required: true
  facts:
    description: The model facts document; its C(plan.estimate.run) gives the disk and time estimates.
    type: dict
    default: {}
  ports:
    description: Ports the run binds on this host, each C({name, port}) (name is the variable that sets it).
    type: list
    elements: dict
    default: []
  state_dirs:
    description:
      - Directories where regen's supervisor records the pids of the servers it started (C(<name>.pid)); a
        port held by one of them (or its session) is regen's own, not a conflict.
    type: list
    elements: path
    default: []
  endpoints:
    description:
      - Network endpoints the run needs, each C({name, url, offline_path}); with C(offline_path) present
        (a wheelhouse, a local mirror) the endpoint is not contacted.
    type: list
    elements: dict
    default: []
  timeout:
    description: Seconds to wait for each endpoint.
    type: float
    default: 5
  shm_min_bytes:
    description: The smallest C(/dev/shm) a GPU host may have (omit to leave it unchecked, said so).
    type: int
  lspci:
    description: Name or path of lspci (ACS state); absent leaves ACS unknown.
    type: str
    default: lspci
  dev_dir:
    description: Directory of the device nodes.
    type: path
    default: /dev
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Preflight
  preflight_info:
    profile: gpu
    gpu: "{{ _gpu.gpu }}"
    model_path: /root/models/Kimi-K2.6
    paths: {weights: /root/models/Kimi-K2.6, completions: /root/regen, features: /root/regen,
            checkpoints: /root/regen}
    ports: [{name: sglang_server_port, port: 30000}]
    endpoints:
      - {name: package index, url: "https://pypi.org/simple/pip/", offline_path: /root/regen/wheelhouse}
  register: _preflight
"""

RETURN = r"""
rows:
  description: One entry per line of the table.
  returned: always
  type: list
  elements: dict
  contains:
    check: {description: What was checked., type: str}
    verdict: {description: "ok, warn, fail or n/a.", type: str}
    value: {description: What was read., type: str}
    need: {description: What the run needs., type: str}
    fix: {description: What to do (empty when nothing)., type: str}
verdict:
  description: fail when any row fails, warn when any warns, else ok.
  returned: always
  type: str
failing:
  description: The failing rows.
  returned: always
  type: list
  elements: dict
table:
  description: The table as text lines.
  returned: always
  type: list
  elements: str
"""

import json
import os
import resource
import socket
import stat
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_gpu_requirements import stack_cuda_from_pins
from ansible.module_utils.regen_preflight import (
    device_node_rows,
    disk_needs,
    disk_rows,
    estimate_of,
    gpu_rows,
    memlock_row,
    p2p_rows,
    parse_kernel_cmdline,
    parse_lspci_acs,
    port_rows,
    reachability_rows,
    render_table,
    shm_row,
    summarize,
    time_row,
    weights_state,
)
from ansible.module_utils.regen_venv import LockError, parse_lock

NODE_NAMES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def _nodes(dev_dir, count):
    nodes = {}
    for name in NODE_NAMES + tuple(f"nvidia{i}" for i in range(max(count, 1))):
        path = os.path.join(dev_dir, name)
        try:
            st = os.stat(path)
        except OSError:
            nodes[name] = {"exists": False}
            continue
        nodes[name] = {
            "exists": True,
            "char": stat.S_ISCHR(st.st_mode),
            "rw": os.access(path, os.R_OK | os.W_OK),
        }
    return nodes


def _existing(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _filesystems(paths):
    result = {}
    for path in paths:
        where = _existing(path)
        try:
            vfs = os.statvfs(where)
            result[path] = {"fs": os.stat(where).st_dev, "free": vfs.f_bavail * vfs.f_frsize}
        except OSError:
            result[path] = {"fs": None, "free": None}
    return result


def _weights(model_path):
    index = None
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
    except (OSError, ValueError):
        index = None
    sizes = {}
    if os.path.isdir(model_path):
        for name in os.listdir(model_path):
            if name.endswith(".safetensors"):
                sizes[name] = os.path.getsize(os.path.join(model_path, name))
    return weights_state(index, sizes)


def _listening_inodes():
    """{port: [socket inode]} of every TCP socket in LISTEN state (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":
                port = int(fields[1].rsplit(":", 1)[1], 16)
                found.setdefault(port, []).append(fields[9])
    return found


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _regen_pids(state_dirs):
    """The pids regen's supervisor recorded (<state_dir>/<name>.pid) for the servers it started."""
    pids = set()
    for directory in state_dirs:
        try:
            names = [n for n in os.listdir(directory) if n.endswith(".pid")]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(directory, name), encoding="ascii") as handle:
                    pids.add(int(handle.read().strip()))
            except (OSError, ValueError):
                continue
    return pids


def _is_regen(pid, regen_pids):
    """A regen server: its systemd unit is regen-* (cgroup), its session or process group is one the
    supervisor started (a recorded pid: the server leads its own session), or an ancestor is regen's."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            if "/regen-" in handle.read():
                return True
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        if int(fields[2]) in regen_pids or int(fields[3]) in regen_pids:
            return True
    except (OSError, ValueError, IndexError):
        pass
    seen = 0
    while pid and pid > 1 and seen < 32:
        if "regen.serving" in _cmdline(pid):
            return True
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        seen += 1
    return False


def _owner(inodes, regen_pids):
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    return {
                        "pid": int(pid),
                        "cmdline": _cmdline(pid),
                        "regen": _is_regen(int(pid), regen_pids),
                    }
        except OSError:
            continue
    return None


def _ports(ports, state_dirs):
    listening = _listening_inodes()
    regen_pids = _regen_pids(state_dirs)
    result = []
    for entry in ports:
        port = int(entry["port"])
        inodes = listening.get(port)
        result.append(
            {
                "name": entry["name"],
                "port": port,
                "listening": bool(inodes),
                "owner": _owner(inodes, regen_pids) if inodes else None,
            }
        )
    return result


def _endpoints(endpoints, timeout):
    result = []
    for ep in endpoints:
        entry = dict(ep)
        offline = ep.get("offline_path")
        entry["offline_present"] = (
            bool(offline)
            and os.path.exists(offline)
            and bool(not os.path.isdir(offline) or os.listdir(offline))
        )
        if entry["offline_present"]:
            result.append(entry)
            continue
        request = urllib.request.Request(ep["url"], method="HEAD", headers={"User-Agent": "regen-preflight"})
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                entry["reachable"] = True
        except urllib.error.HTTPError as exc:
            # The server answered (401, 404, 405 ...): the path to it is open.
            entry["reachable"], entry["error"] = True, f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            entry["reachable"] = False
            entry["error"] = str(getattr(exc, "reason", exc))
        result.append(entry)
    return result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            profile=dict(type="str", required=True, choices=["cpu", "gpu"]),
            gpu=dict(type="dict", required=True),
            expected_count=dict(type="int"),
            serving_lock=dict(type="str", default=""),
            model_path=dict(type="path", required=True),
            paths=dict(type="dict", required=True),
            facts=dict(type="dict", default={}),
            ports=dict(type="list", elements="dict", default=[]),
            state_dirs=dict(type="list", elements="path", default=[]),
            endpoints=dict(type="list", elements="dict", default=[]),
            timeout=dict(type="float", default=5),
            shm_min_bytes=dict(type="int"),
            lspci=dict(type="str", default="lspci"),
            dev_dir=dict(type="path", default="/dev"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    missing = [k for k in ("weights", "completions", "features", "checkpoints") if not p["paths"].get(k)]
    if missing:
        module.fail_json(msg=f"paths lacks {', '.join(missing)}")
    gpu = p["gpu"]
    count = int(gpu.get("count") or 0)
    stack_cuda = None
    if p["serving_lock"].strip():
        try:
            stack_cuda = stack_cuda_from_pins(parse_lock(p["serving_lock"], "the serving lock")["pins"])
        except LockError as exc:
            module.fail_json(msg=str(exc))

    total, missing_bytes, weights_reason = _weights(p["model_path"])
    rows = gpu_rows(gpu, p["profile"], p["expected_count"], stack_cuda, total)
    rows += device_node_rows(p["profile"], count, _nodes(p["dev_dir"], count))

    acs, iommu = None, ""
    if p["profile"] == "gpu" and count >= 2:
        lspci = module.get_bin_path(p["lspci"], required=False)
        if lspci:
            rc, out, _ = module.run_command([lspci, "-vvv"], environ_update={"LC_ALL": "C"})
            if rc == 0 and "ACSCtl" in out:
                acs = parse_lspci_acs(out)
        try:
            groups = os.listdir("/sys/kernel/iommu_groups")
            with open("/proc/cmdline", encoding="utf-8") as handle:
                args = parse_kernel_cmdline(handle.read())
            mode = "pt" if args.get("iommu") == "pt" else "on" if groups else "off"
            iommu = f"{mode} ({len(groups)} groups)"
        except OSError:
            iommu = ""
    rows += p2p_rows(p["profile"], count, gpu.get("nccl_p2p"), acs, iommu)

    try:
        vfs = os.statvfs("/dev/shm")
        shm = vfs.f_blocks * vfs.f_frsize
    except OSError:
        shm = None
    rows.append(shm_row(p["profile"], shm, p["shm_min_bytes"]))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    rows.append(
        memlock_row(p["profile"], None if soft == unlimited else soft, None if hard == unlimited else hard)
    )

    needs = disk_needs(p["paths"], p["facts"], missing_bytes, weights_reason)
    rows += disk_rows(needs, _filesystems([n["path"] for n in needs]))
    rows += port_rows(_ports(p["ports"], p["state_dirs"]))
    rows += reachability_rows(_endpoints(p["endpoints"], p["timeout"]))
    _, hours, reason = estimate_of(p["facts"])
    rows.append(time_row(hours, reason))

    verdict, failing = summarize(rows)
    host = socket.gethostname()
    module.exit_json(
        changed=False, rows=rows, verdict=verdict, failing=failing, table=render_table(host, rows)
    )


if __name__ == "__main__":
    main()
