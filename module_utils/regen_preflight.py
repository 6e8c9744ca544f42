"""The preflight's decisions: one row per thing a run needs, each with a verdict and the fix.

Pure functions over what the preflight_info module gathered on a host (GPU facts, /dev entries, limits,
free space, listening sockets, reachability answers), so they are unit-tested without the host. Verdicts:
`ok`, `warn` (the run may still work; the row says what is unknown or marginal), `fail` (the run would
stop or be wrong later: the preflight stops here with the fix) and `n/a` (not needed on this host, e.g.
GPU lines on the CPU profile). A row never claims more than what was read.
"""

from __future__ import annotations

import re

from .regen_gpu_requirements import (
    check_host,
    fmt,
    parse_version,
)

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"
GIB = 1024**3
# What a tensor-parallel/expert-parallel serving host needs beyond the weights per GPU (KV cache,
# activations, CUDA graphs): the check fails only when the weights alone leave less than this share free.
WEIGHT_SHARE_LIMIT = 0.9


def row(check, verdict, value, fix="", need=""):
    return {"check": check, "verdict": verdict, "value": str(value), "need": str(need), "fix": fix}


def gib(value):
    return "%.1f GiB" % (float(value) / GIB)


# --- parsers of real outputs (fixtures recorded from public sources in tests/fixtures/proxmox) ---------


def parse_nvidia_driver_version(text):
    """/proc/driver/nvidia/version's first line -> '580.95.05' (None when absent or unreadable)."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text or "")
    return match.group(1) if match else None


def parse_lspci_acs(text):
    """`lspci -vvv` (or its `grep ACSCtl` lines) -> [{"device": "00:01.0", "request_redirect": bool}] per
    ACSCtl line: a bridge with ReqRedir+ routes peer-to-peer traffic through the root complex (slow, or
    hangs NCCL). Lines without a device header (grep output) are named bridge #N."""
    found = []
    device = None
    for line in (text or "").splitlines():
        head = re.match(r"^([0-9a-f]{2,4}:[0-9a-f]{2}(?::[0-9a-f]{2})?\.[0-9a-f])\s", line)
        if head:
            device = head.group(1)
            continue
        ctl = re.search(r"ACSCtl:.*?ReqRedir([+-])", line)
        if ctl:
            found.append(
                {"device": device or f"bridge #{len(found) + 1}", "request_redirect": ctl.group(1) == "+"}
            )
            device = None
    return found


def parse_kernel_cmdline(text):
    """/proc/cmdline -> {key: value or True}."""
    args = {}
    for token in (text or "").split():
        key, sep, value = token.partition("=")
        args[key] = value if sep else True
    return args


# --- checks ---------------------------------------------------------------------------------------


def gpu_rows(facts, profile, expected_count, stack_cuda, weights_bytes):
    """GPU count, memory and driver against the pinned serving stack's CUDA."""
    count = int(facts.get("count") or 0)
    if profile != "gpu":
        why = f"regen_profile is {profile!r}: no GPU needed" + (f" ({count} present)" if count else "")
        return [row(name, NA, why) for name in ("GPU count", "GPU memory", "GPU driver")]
    checked = check_host(facts, "gpu", expected_count, stack_cuda)
    errors = checked["errors"]
    rows = []
    count_errors = [e for e in errors if "GPU(s) visible" in e or "no GPU is visible" in e]
    rows.append(
        row(
            "GPU count",
            FAIL if count_errors else OK,
            f"{count} x {', '.join(facts.get('names') or []) or 'GPU'}"
            if count
            else (facts.get("reason") or 0),
            "; ".join(count_errors),
            expected_count if expected_count is not None else "at least 1",
        )
    )
    memory = facts.get("memory_per_gpu_bytes")
    if not count:
        rows.append(row("GPU memory", FAIL, "no GPU", "see GPU count"))
    elif not weights_bytes:
        rows.append(
            row(
                "GPU memory",
                WARN if not memory else OK,
                gib(memory) + " per GPU" if memory else "unknown",
                "" if memory else "nvidia-smi reported no memory size",
                "unknown: the model's weight index (model.safetensors.index.json) is not on the host yet",
            )
        )
    else:
        per_gpu = weights_bytes / count
        too_small = memory and per_gpu > memory * WEIGHT_SHARE_LIMIT
        rows.append(
            row(
                "GPU memory",
                FAIL if too_small else OK,
                f"{gib(memory)} per GPU" if memory else "unknown",
                (
                    f"the weights alone take {gib(per_gpu)} per GPU spread over {count} GPUs; use more GPUs "
                    "or a smaller (quantized) checkpoint"
                )
                if too_small
                else "",
                f"weights {gib(weights_bytes)} / {count} = {gib(per_gpu)} per GPU, under "
                f"{int(WEIGHT_SHARE_LIMIT * 100)}% of each",
            )
        )
    driver_errors = [e for e in errors if e not in count_errors]
    need = f"CUDA {fmt(stack_cuda)} (the serving lock)" if stack_cuda else "the GPU generation's minimum"
    rows.append(
        row(
            "GPU driver",
            FAIL if driver_errors else (OK if count else FAIL),
            f"{facts.get('driver_version') or 'none'} (CUDA {facts.get('cuda_version') or 'unknown'})",
            "; ".join(driver_errors) or ("" if count else "see GPU count"),
            need,
        )
    )
    return rows


def device_node_rows(profile, count, nodes):
    """nodes: {name: {"exists", "char", "rw"}} for nvidiaN, nvidiactl, nvidia-uvm, nvidia-uvm-tools."""
    if profile != "gpu":
        return [row("GPU device nodes", NA, f"regen_profile is {profile!r}")]
    wanted = ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(max(count, 1))]
    missing = [n for n in wanted if not (nodes.get(n) or {}).get("exists")]
    not_char = [n for n in wanted if n not in missing and not nodes[n].get("char")]
    no_access = [n for n in wanted if n not in missing and n not in not_char and not nodes[n].get("rw")]
    fixes = []
    if missing:
        fixes.append(
            "missing /dev/{}: on the node run `nvidia-modprobe -c0 -u` (the nodes exist only after the first "
            "CUDA call) and pass them into the container (roles/lxc_gpu_container: devN: entries or "
            "lxc.mount.entry lines)".format(", /dev/".join(missing))
        )
    if not_char:
        fixes.append(
            "/dev/{} is not a character device (a bind-mounted file?); mount the node itself".format(
                ", /dev/".join(not_char)
            )
        )
    if no_access:
        fixes.append(
            "/dev/{} not readable and writable by this user: allow the major in lxc.cgroup2.devices.allow "
            "or give the devN: entry mode=0666".format(", /dev/".join(no_access))
        )
    return [
        row(
            "GPU device nodes",
            FAIL if fixes else OK,
            f"{len(wanted) - len(missing)}/{len(wanted)} present, character devices, read-write"
            if not fixes
            else f"{len(wanted) - len(missing)}/{len(wanted)} present",
            "; ".join(fixes),
            ", ".join("/dev/" + n for n in wanted),
        )
    ]


def p2p_rows(profile, count, nccl_p2p, acs, iommu):
    """NCCL peer-to-peer: the provision stage's measurement when there is one, the ACS/IOMMU state."""
    if profile != "gpu" or count < 2:
        return [row("P2P / ACS", NA, f"{count} GPU(s): no peer-to-peer traffic")]
    parts, fixes, verdict = [], [], OK
    if nccl_p2p and nccl_p2p.get("measured"):
        parts.append(f"measured: P2P {'on' if nccl_p2p.get('p2p') else 'off'} ({nccl_p2p.get('reason', '')})")
    else:
        parts.append("not measured yet (the provision stage measures it)")
    if acs is None:
        parts.append("ACS unknown (lspci -vvv not readable here; run the preflight on the node)")
        verdict = WARN
    else:
        redirect = [a["device"] for a in acs if a["request_redirect"]]
        parts.append(f"ACS ReqRedir on {len(redirect)} of {len(acs)} bridge(s)")
        if redirect and not (nccl_p2p or {}).get("measured"):
            verdict = WARN
            fixes.append(
                "ACS request redirection is on ({}): P2P goes through the root complex and NCCL may hang; "
                "disable it on the node (pcie_settings_disable_acs: true) or let the provision stage measure "
                "and set NCCL_P2P_DISABLE".format(
                    ", ".join(redirect[:4]) + (" ..." if len(redirect) > 4 else "")
                )
            )
    if iommu:
        parts.append(f"IOMMU {iommu}")
    return [row("P2P / ACS", verdict, "; ".join(parts), "; ".join(fixes))]


def shm_row(profile, shm_bytes, min_bytes):
    if shm_bytes is None:
        return row("/dev/shm", FAIL if profile == "gpu" else WARN, "not mounted", "mount a tmpfs on /dev/shm")
    if profile != "gpu":
        return row("/dev/shm", OK, gib(shm_bytes), need="any (CPU profile)")
    if min_bytes is None:
        return row("/dev/shm", WARN, gib(shm_bytes), "set preflight_shm_min_gib to check it", "unknown")
    low = shm_bytes < min_bytes
    return row(
        "/dev/shm",
        FAIL if low else OK,
        gib(shm_bytes),
        "NCCL and SGLang's processes exchange tensors through /dev/shm: raise its size (container: "
        "lxc_gpu_container_shm_size_gib; Docker: --shm-size)"
        if low
        else "",
        f">= {gib(min_bytes)}",
    )


def memlock_row(profile, soft, hard):
    """soft/hard: bytes, or None for unlimited."""

    def show(value):
        return "unlimited" if value is None else gib(value) if value >= GIB else f"{value // 1024} KiB"

    value = f"soft {show(soft)}, hard {show(hard)}"
    if profile != "gpu":
        return row("memlock", NA, value + " (CPU profile: no pinned memory)")
    if soft is None:
        return row("memlock", OK, value, need="unlimited")
    return row(
        "memlock",
        FAIL,
        value,
        "NCCL, Mooncake and CUDA's pinned host memory need an unlimited locked-memory limit: set "
        "lxc.prlimit.memlock: unlimited in the container (lxc_gpu_container does) or LimitMEMLOCK=infinity",
        "unlimited",
    )


def disk_rows(needs, filesystems):
    """needs: [{"name", "path", "bytes" (None: unknown), "source"}]; filesystems: {path: {"fs", "free"}}
    (fs: the device id, so needs on one filesystem add up). One row per need, one per filesystem total."""
    rows, per_fs = [], {}
    for need in needs:
        fs = filesystems.get(need["path"]) or {}
        if need.get("bytes") is None:
            rows.append(
                row(
                    f"disk: {need['name']}",
                    WARN,
                    f"{gib(fs['free'])} free at {need['path']}"
                    if fs.get("free") is not None
                    else need["path"],
                    "",
                    f"unknown: {need.get('source') or 'no estimate'}",
                )
            )
            continue
        per_fs.setdefault(
            fs.get("fs"), {"free": fs.get("free"), "names": [], "bytes": 0, "path": need["path"]}
        )
        entry = per_fs[fs.get("fs")]
        entry["names"].append(need["name"])
        entry["bytes"] += int(need["bytes"])
        rows.append(
            row(
                f"disk: {need['name']}",
                OK,
                f"{gib(need['bytes'])} at {need['path']}",
                "",
                need.get("source") or "",
            )
        )
    for entry in per_fs.values():
        free = entry["free"]
        short = free is not None and entry["bytes"] > free
        rows.append(
            row(
                "disk: " + " + ".join(entry["names"]),
                FAIL if short else (WARN if free is None else OK),
                f"{gib(free)} free" if free is not None else "free space unreadable",
                f"{gib(entry['bytes'] - free)} short on the filesystem of {entry['path']}: free space there "
                "or point the paths (regen_model_path, regen_work_dir) at a larger disk"
                if short
                else "",
                gib(entry["bytes"]),
            )
        )
    return rows


def port_rows(ports):
    """ports: [{"name", "port", "bind", "listening", "owner": {"pid", "cmdline", "regen"} or None}]."""
    rows = []
    for port in ports:
        label = f"port {port['port']} ({port['name']})"
        if not port.get("listening"):
            rows.append(row(label, OK, "free"))
            continue
        owner = port.get("owner") or {}
        if owner.get("regen"):
            rows.append(
                row(
                    label,
                    OK,
                    f"held by regen's own server (pid {owner.get('pid')}); its stage keeps or restarts it",
                )
            )
            continue
        who = (
            f"pid {owner['pid']}: {owner.get('cmdline', '')[:80]}" if owner.get("pid") else "another process"
        )
        rows.append(
            row(
                label,
                FAIL,
                f"in use by {who}",
                f"stop that process (`ss -ltnp 'sport = :{port['port']}'` shows it) or set "
                f"{port['name']} to a free port",
                "free",
            )
        )
    return rows


def reachability_rows(endpoints):
    """endpoints: [{"name", "url", "reachable", "error", "offline_path", "offline_present"}]. An endpoint
    whose offline alternative (a wheelhouse, a local mirror) is present needs no network."""
    rows = []
    for ep in endpoints:
        label = f"reach {ep['name']}"
        if ep.get("offline_present"):
            rows.append(row(label, OK, f"offline: {ep['offline_path']} present (not contacted)"))
            continue
        if ep.get("reachable"):
            rows.append(row(label, OK, f"{ep['url']} answered"))
            continue
        alternative = f", or provide {ep['offline_path']}" if ep.get("offline_path") else ""
        rows.append(
            row(
                label,
                FAIL,
                f"{ep['url']}: {ep.get('error') or 'no answer'}",
                f"open the network path to {ep['url']} (proxy settings: HTTPS_PROXY){alternative}",
                "reachable",
            )
        )
    return rows


# The plan's disk estimate (plan.estimate.run, regen_estimate.run_estimate) by the name preflight checks.
ESTIMATE_DISK_KEYS = {
    "completions": "completions_bytes",
    "features": "features_bytes",
    "checkpoints": "checkpoint_bytes",  # one resumable checkpoint: the newest is what a resume needs
}


def estimate_of(facts):
    """The plan's run estimate (`plan.estimate.run`), when the plan has one: (disk {name: bytes or None},
    hours or None, reason). The hours are generation plus capture, the parts the plan estimates; training
    time is measured by the train stage, not estimated, and the reason says so."""
    plan = (facts or {}).get("plan") or {}
    entry = (plan.get("estimate") or {}).get("run") if isinstance(plan.get("estimate"), dict) else None
    estimate = entry.get("value") if isinstance(entry, dict) and "value" in entry else entry
    if not isinstance(estimate, dict):
        why = "the plan has no run estimate yet (introspect has not run, or its plan carries no estimate.run)"
        return {}, None, why
    raw = estimate.get("disk") or {}
    disk = {name: raw.get(key) for name, key in ESTIMATE_DISK_KEYS.items()} if isinstance(raw, dict) else {}
    parts = [estimate.get(step) or {} for step in ("generation", "capture")]
    seconds = [p.get("seconds") for p in parts if isinstance(p, dict)]
    if seconds and all(isinstance(v, (int, float)) for v in seconds):
        hours = sum(seconds) / 3600
        reason = "the plan's estimate.run: generation + capture (training time is measured, not estimated)"
    else:
        hours = None
        why = [p.get("reason") or p.get("arithmetic") for p in parts if isinstance(p, dict)]
        reason = "the plan's estimate.run has no time: " + "; ".join(w for w in why if w)
    return disk, hours, reason


def time_row(hours, reason):
    if hours is None:
        return row("time estimate", WARN, "unknown", need=f"unknown: {reason}")
    return row("time estimate", OK, f"{float(hours):.1f} h", need=reason)


def disk_needs(paths, facts, weights_missing_bytes, weights_reason):
    """The disk needs of a run: the weights still to fetch (from the weight index on the host) and the
    plan's estimate for completions, features (hidden states) and checkpoints."""
    disk, _, reason = estimate_of(facts)
    needs = [
        {
            "name": "weights",
            "path": paths["weights"],
            "bytes": weights_missing_bytes,
            "source": weights_reason,
        }
    ]
    for name in ("completions", "features", "checkpoints"):
        value = disk.get(name)
        needs.append(
            {
                "name": name,
                "path": paths[name],
                "bytes": None if value is None else int(value),
                "source": f"the plan's estimate.run disk.{ESTIMATE_DISK_KEYS[name]}"
                if value is not None
                else f"{reason}"
                if not disk
                else f"the plan's estimate.run has no disk.{ESTIMATE_DISK_KEYS[name]} ({reason})",
            }
        )
    return needs


def weights_state(index, present_sizes):
    """(total bytes or None, bytes still missing or None, reason) from a model.safetensors.index.json
    document (None: absent) and the sizes of the shard files already on disk ({file: bytes})."""
    if not index:
        if present_sizes:
            return sum(present_sizes.values()), 0, "weights present (no index: single-file checkpoint)"
        return (
            None,
            None,
            "no model.safetensors.index.json on the host yet (the model_weights role fetches it first)",
        )
    total = (index.get("metadata") or {}).get("total_size")
    shards = sorted(set((index.get("weight_map") or {}).values()))
    if total is None:
        return None, None, "the weight index has no metadata.total_size"
    total = int(total)
    missing = [s for s in shards if s not in present_sizes]
    if not missing:
        return total, 0, f"all {len(shards)} shards present"
    have = sum(present_sizes.get(s, 0) for s in shards)
    return (
        total,
        max(0, total - have),
        f"{len(missing)} of {len(shards)} shards to fetch (index total_size {gib(total)})",
    )


def summarize(rows):
    """(verdict of the whole table, the failing rows)."""
    failing = [r for r in rows if r["verdict"] == FAIL]
    if failing:
        return FAIL, failing
    return (WARN if any(r["verdict"] == WARN for r in rows) else OK), []


def render_table(host, rows):
    """Plain text table (the play prints it; the CLI renders the same rows with rich)."""
    widths = [
        max(len(r[k]) for r in [*rows, dict(check="check", verdict="verdict", value="value")])
        for k in ("check", "verdict", "value")
    ]
    widths = [min(w, 60) for w in widths]
    lines = [f"preflight on {host}"]
    for r in rows:
        line = "  ".join(
            [
                r["check"].ljust(widths[0]),
                r["verdict"].upper().ljust(widths[1]),
                r["value"][:60].ljust(widths[2]),
            ]
        )
        if r["fix"]:
            line += "  fix: " + r["fix"]
        lines.append(line.rstrip())
    return lines


def version_matches(host_version, container_version):
    """The container's userspace driver must be exactly the node's kernel module version."""
    return bool(host_version) and parse_version(host_version) == parse_version(container_version)
