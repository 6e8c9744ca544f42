"""GPU facts from nvidia-smi output (query CSV, the summary table, `-q`, and `topo -m`).

The parsers are pure functions over text so that recorded outputs of real machines test them; `gather`
runs the commands through a caller-supplied runner (AnsibleModule.run_command on a host). No GPU, or no
nvidia-smi at all, is an ordinary answer: count 0 with the reason.
"""

from __future__ import annotations

import hashlib
import json
import re

QUERY_FIELDS = ("index", "name", "uuid", "pci.bus_id", "memory.total", "driver_version", "compute_cap")
MIB = 1024 * 1024

# Compute capability by product name, for outputs that do not carry compute_cap (old drivers, tables).
NAME_CAPABILITY = (
    (re.compile(r"\bB(100|200|300)\b|\bGB(200|300)\b"), "10.0"),
    (re.compile(r"RTX PRO \d+.*Blackwell|RTX PRO \d+ Blac|RTX 50\d0|\bGB10\b"), "12.0"),
    (re.compile(r"\bH(100|200|800|20)\b|\bGH200\b"), "9.0"),
    (re.compile(r"\bL40S?\b|\bL4\b|RTX 40\d0|RTX \d+ Ada"), "8.9"),
    (re.compile(r"\bA(100|800|30)\b"), "8.0"),
)
ARCHITECTURE = {"12": "blackwell", "10": "blackwell", "9": "hopper", "8": "ampere", "7": "volta/turing"}


def _none_if_na(value):
    value = value.strip()
    return None if value in ("", "N/A", "[N/A]", "[Not Supported]", "Not Found", "Not Supported") else value


def _mib(value):
    match = re.search(r"(\d+)", value or "")
    return int(match.group(1)) if match else None


def capability_from_name(name):
    for pattern, capability in NAME_CAPABILITY:
        if name and pattern.search(name):
            return capability
    return None


def architecture(capability):
    if not capability:
        return None
    major = capability.split(".")[0]
    if capability == "8.9":
        return "ada"
    return ARCHITECTURE.get(major)


def parse_query_csv(text, fields=QUERY_FIELDS):
    """`nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]` -> list of GPU dicts."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    first = [c.strip() for c in lines[0].split(",")]
    if any(re.match(r"^[a-z_.]+( \[.*\])?$", c) for c in first) and not first[0].isdigit():
        fields = tuple(re.sub(r" \[.*\]$", "", c) for c in first)
        lines = lines[1:]
    gpus = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < len(fields):
            continue
        # A product name never holds a comma, but be safe: glue extra cells back into the name.
        if len(cells) > len(fields) and "name" in fields:
            at = fields.index("name")
            extra = len(cells) - len(fields)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        row = dict(zip(fields, cells, strict=False))
        gpus.append(_gpu_record(row))
    return gpus


def _gpu_record(row):
    index = _none_if_na(row.get("index", ""))
    name = _none_if_na(row.get("name", "")) or None
    mib = _mib(_none_if_na(row.get("memory.total", "")) or "")
    capability = _none_if_na(row.get("compute_cap", ""))
    source = "nvidia-smi" if capability else None
    if capability is None:
        capability = capability_from_name(name)
        source = "product name" if capability else None
    return {
        "index": int(index) if index and index.isdigit() else None,
        "name": name,
        "uuid": _none_if_na(row.get("uuid", "")),
        "pci_bus_id": _none_if_na(row.get("pci.bus_id", "")),
        "memory_total_mib": mib,
        "memory_total_bytes": mib * MIB if mib is not None else None,
        "driver_version": _none_if_na(row.get("driver_version", "")),
        "compute_capability": capability,
        "compute_capability_source": source,
        "architecture": architecture(capability),
    }


def parse_versions(text):
    """Driver and CUDA versions from the table header or `nvidia-smi -q` (newer drivers say KMD/UMD)."""
    driver = re.search(r"(?:Driver|KMD) Version\s*:\s*([\w.]+)", text)
    cuda = re.search(r"CUDA(?: UMD)? Version\s*:\s*([\w. ]+?)\s*(?:\||$)", text, flags=re.M)
    cuda_value = _none_if_na(cuda.group(1)) if cuda else None
    return (driver.group(1) if driver else None), cuda_value


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_topology(text):
    """`nvidia-smi topo -m` -> {matrix, kind: nvlink|pcie|mixed|single, links}."""
    # nvidia-smi underlines the header with terminal escapes even when its output is a pipe or a file
    # (recorded on a driver 580 H200: "\x1b[4mGPU0\tCPU Affinity...\x1b[0m"); they are not part of a cell.
    lines = ANSI_ESCAPE.sub("", text).splitlines()
    header = None
    for number, line in enumerate(lines):
        tokens = line.split()
        # The header starts with GPU0 followed by column names; the GPU0 row has "X" next.
        if len(tokens) > 1 and tokens[0] == "GPU0" and tokens[1] != "X":
            header = number
            break
    if header is None:
        return None
    columns = []
    for token in lines[header].split():
        if re.match(r"^(GPU|NIC|mlx)\w*\d+$", token):
            columns.append(token)
        else:
            break
    gpu_columns = [c for c in columns if c.startswith("GPU")]
    matrix = {}
    for line in lines[header + 1 :]:
        tokens = line.split()
        if not tokens or not re.match(r"^GPU\d+$", tokens[0]):
            if tokens and tokens[0].startswith("Legend"):
                break
            continue
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) < len(gpu_columns):
            continue
        matrix[tokens[0]] = {
            col: cells[i] for i, col in enumerate(columns) if col in gpu_columns and i < len(cells)
        }
    links = set()
    for row, cells in matrix.items():
        for col, value in cells.items():
            if col != row and value != "X":
                links.add(value)
    if len(gpu_columns) <= 1:
        kind = "single"
    elif links and all(v.startswith("NV") for v in links):
        kind = "nvlink"
    elif any(v.startswith("NV") for v in links):
        kind = "mixed"
    else:
        kind = "pcie"
    return {"gpus": len(matrix), "kind": kind, "links": sorted(links), "matrix": matrix}


def summarize(gpus, driver=None, cuda=None, topology=None, reason=None, nvidia_smi=None):
    """The facts document."""
    memories = [g["memory_total_bytes"] for g in gpus if g["memory_total_bytes"]]
    capabilities = sorted({g["compute_capability"] for g in gpus if g["compute_capability"]})
    driver = driver or next((g["driver_version"] for g in gpus if g["driver_version"]), None)
    return {
        "count": len(gpus),
        "gpus": gpus,
        "names": sorted({g["name"] for g in gpus if g["name"]}),
        "memory_total_bytes": sum(memories) if memories else 0,
        "memory_per_gpu_bytes": min(memories) if memories else None,
        "driver_version": driver,
        "cuda_version": cuda,
        "compute_capabilities": capabilities,
        "architectures": sorted({architecture(c) for c in capabilities if architecture(c)}),
        "interconnect": topology["kind"] if topology else ("single" if len(gpus) == 1 else None),
        "topology": topology,
        "nvidia_smi": nvidia_smi,
        "reason": reason,
    }


def gather(run, nvidia_smi_path, want_topology=True):
    """run(argv) -> (rc, stdout, stderr). nvidia_smi_path None means not installed."""
    if not nvidia_smi_path:
        return summarize([], reason="nvidia-smi not found on PATH: no NVIDIA GPU or no driver installed")
    fields = list(QUERY_FIELDS)
    rc, out, err = run(
        [nvidia_smi_path, "--query-gpu={}".format(",".join(fields)), "--format=csv,noheader,nounits"]
    )
    if rc != 0 and "compute_cap" in (out + err):
        # Drivers before R510 do not know compute_cap; ask without it and infer from the product name.
        fields.remove("compute_cap")
        rc, out, err = run(
            [nvidia_smi_path, "--query-gpu={}".format(",".join(fields)), "--format=csv,noheader,nounits"]
        )
    if rc != 0:
        message = (err or out).strip().splitlines()
        return summarize(
            [],
            reason=f"nvidia-smi failed (rc {rc}): {message[0] if message else 'no output'}",
            nvidia_smi=nvidia_smi_path,
        )
    gpus = parse_query_csv(out, tuple(fields))
    # --query-gpu has no CUDA field: the summary table's header carries the highest CUDA the driver supports.
    rc, table, _ = run([nvidia_smi_path])
    table_driver, cuda = parse_versions(table) if rc == 0 else (None, None)
    driver = next((g["driver_version"] for g in gpus if g["driver_version"]), None) or table_driver
    topology = None
    if want_topology and len(gpus) > 1:
        rc, topo, _ = run([nvidia_smi_path, "topo", "-m"])
        topology = parse_topology(topo) if rc == 0 else None
    reason = None if gpus else "nvidia-smi lists no GPU"
    return summarize(gpus, driver, cuda, topology, reason, nvidia_smi_path)


# The NCCL peer-to-peer measurement (regen.serving.p2p_probe) recorded on the host at provision time.
P2P_SCHEMA = "regen.nccl_p2p/1"


def p2p_fingerprint(gpu):
    """What a P2P measurement holds for: the GPUs (by UUID, so a swapped card re-measures) and the driver."""
    uuids = sorted(g.get("uuid") or g.get("pci_bus_id") or "" for g in gpu.get("gpus") or [])
    text = json.dumps([uuids, gpu.get("driver_version")], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def p2p_measurement(doc, fingerprint):
    """The facts' `nccl_p2p` entry from a measurement document: the decision when it was measured for these
    GPUs and this driver, else `measured: false` with why (the serving plan then keeps its default)."""
    if not isinstance(doc, dict) or doc.get("schema") != P2P_SCHEMA:
        return {"measured": False, "reason": "the recorded measurement is not a regen.nccl_p2p/1 document"}
    if doc.get("fingerprint") != fingerprint:
        return {
            "measured": False,
            "reason": "the recorded measurement was taken on other GPUs or another driver; "
            "re-run the provision stage to measure again",
        }
    decision = doc.get("decision") if isinstance(doc.get("decision"), dict) else {}
    modes = doc.get("modes") if isinstance(doc.get("modes"), dict) else {}
    return {
        "measured": True,
        "p2p": bool(decision.get("p2p")),
        "env": {str(k): str(v) for k, v in (decision.get("env") or {}).items()},
        "reason": str(decision.get("reason") or ""),
        "busbw_gbps": {mode: (modes.get(mode) or {}).get("busbw_gbps") for mode in ("p2p_on", "p2p_off")},
        "world_size": doc.get("world_size"),
    }


def described(count, memory_per_gpu_bytes=None, compute_capability=None, source="described"):
    """Pure: the GPU facts of `count` identical GPUs that nobody queried (`regen facts --model-path --gpus N
    --gpu-memory-gib G --compute-capability X.Y` plans for hardware it is not running on). The document has
    gather's shape; what is not described (names, driver, interconnect) is null, and `reason` says so."""
    if count <= 0:
        return summarize([], reason=f"{source}: no GPU")
    mib = memory_per_gpu_bytes // MIB if memory_per_gpu_bytes else None
    record = {
        "index": None,
        "name": None,
        "uuid": None,
        "pci_bus_id": None,
        "memory_total_mib": mib,
        "memory_total_bytes": memory_per_gpu_bytes,
        "driver_version": None,
        "compute_capability": compute_capability,
        "compute_capability_source": source if compute_capability else None,
        "architecture": architecture(compute_capability),
    }
    gpus = [dict(record, index=i) for i in range(count)]
    facts = summarize(gpus, reason=f"{source}: not queried with nvidia-smi (no names, driver or topology)")
    facts["interconnect"] = None  # unknown, not "single": nothing was measured
    return facts


# NCCL's peer-to-peer path hangs on the first all-reduce on PCIe-only Blackwell workstation cards unless
# IOMMU/ACS are off on the host (NVIDIA/nccl#1999); without a measurement that is the safe default there.
PCIE_BLACKWELL_NCCL_ENV = {"NCCL_P2P_DISABLE": "1"}


def nccl_decision(gpu, processes, who="this process", default_env=None):
    """(env, reason, source): the NCCL settings for `processes` GPU processes of one host talking over NCCL
    (the SGLang server's TP ranks, the capture server's, the FSDP trainer's), from the GPU facts.

    The provision-time measurement (`gpu.nccl_p2p`, regen.serving.p2p_probe) wins; without one, PCIe-only
    sm_120 hosts get `default_env` (PCIE_BLACKWELL_NCCL_ENV unless given; {} opts out); elsewhere NCCL's
    own defaults. One function, so that the server, the capture server and the trainer agree."""
    gpu = gpu if isinstance(gpu, dict) else {}
    if not processes or processes <= 1:
        return {}, f"{who} runs one GPU process per host: no NCCL peer traffic to configure", "facts"
    measured = gpu.get("nccl_p2p") if isinstance(gpu.get("nccl_p2p"), dict) else {}
    if measured.get("measured"):
        env = {str(k): str(v) for k, v in (measured.get("env") or {}).items()}
        why = measured.get("reason") or "no reason recorded"
        return env, f"{who}: measured at provision time: {why}", "measured"
    capabilities = [c for c in gpu.get("compute_capabilities") or [] if isinstance(c, str)]
    sm120 = any(c.startswith("12.") for c in capabilities)
    not_measured = measured.get("reason") or "no measurement recorded (the provision stage takes one)"
    default_env = PCIE_BLACKWELL_NCCL_ENV if default_env is None else default_env
    if sm120 and gpu.get("interconnect") == "pcie" and default_env:
        return dict(default_env), (
            f"{who}: PCIe-only Blackwell (sm_120) GPUs: NCCL peer-to-peer hangs unless IOMMU/ACS are off "
            f"(NVIDIA/nccl#1999), and P2P was not measured here ({not_measured})"), "default"
    where = gpu.get("interconnect") or "interconnect unknown"
    note = ("; sm_120 cards have no NVLink, so the provision-time P2P measurement decides on the host"
            if sm120 else "")
    return {}, f"{who}: NCCL's own defaults ({where}; P2P not measured: {not_measured}){note}", "default"
