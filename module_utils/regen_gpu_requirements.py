"""Does this GPU host fit the pinned serving stack? Pure decisions over gpu_info facts, a /dev listing,
the serving lock's pins and what torch reports; the gpu_host role's module only gathers and calls these.

Numbers (sources in roles/gpu_host/README.md):
- CUDA minor-version compatibility (NVIDIA): CUDA 13.x needs driver >= 580, CUDA 12.x needs >= 525.
- Blackwell (sm_100 B200, sm_120 RTX PRO 6000 / RTX 50xx) needs code built with CUDA 12.8 or newer,
  which ships with the R570 driver branch; older drivers do not know these GPUs.
- SGLang's current line requires CUDA 13 (its CUDA 12 lane ended with SGLang 0.5.19).
"""

from __future__ import annotations

import re

# Minimum driver (major, minor) per CUDA major, through CUDA minor-version compatibility.
DRIVER_FOR_CUDA_MAJOR = {13: (580, 0), 12: (525, 60), 11: (450, 80)}
# The oldest CUDA that has native code generation for a compute capability (major, minor) -> (major, minor).
CUDA_FOR_CAPABILITY = (
    ((12, 0), (12, 8)),  # Blackwell workstation/consumer: RTX PRO 6000, RTX 5090 (sm_120)
    ((10, 0), (12, 8)),  # Blackwell data center: B200/GB200 (sm_100)
    ((9, 0), (11, 8)),  # Hopper H100/H200
    ((8, 9), (11, 8)),  # Ada
    ((8, 0), (11, 0)),  # Ampere
)
# The driver branch that introduced CUDA 12.8 and with it Blackwell support.
BLACKWELL_MIN_DRIVER = (570, 0)
GENERATION = {"12": "Blackwell", "10": "Blackwell", "9": "Hopper", "8": "Ampere/Ada", "7": "Volta/Turing"}


def parse_version(text):
    """'580.95.05' -> (580, 95, 5); '13.0' -> (13, 0); None/'' -> None."""
    if not text:
        return None
    numbers = re.findall(r"\d+", str(text))
    return tuple(int(n) for n in numbers) if numbers else None


def fmt(version):
    return ".".join(str(part) for part in version)


def arch_tag(capability):
    """'12.0' -> 'sm_120'."""
    major, minor = parse_version(capability)[:2]
    return f"sm_{major}{minor}"


def generation(capability):
    return GENERATION.get(str(capability).split(".")[0], "unknown generation")


def min_cuda_for_capability(capability):
    """The oldest CUDA that supports a compute capability natively (None when unknown/older)."""
    cap = parse_version(capability)
    if not cap:
        return None
    cap = cap[:2]
    for floor, cuda in CUDA_FOR_CAPABILITY:
        if cap >= floor:
            return cuda
    return None


def stack_cuda_from_pins(pins):
    """The CUDA (major, minor) a pinned stack was built for, read from its CUDA runtime wheel or its torch
    build tag; None for a CPU-only stack (the demo set)."""
    for name in (
        "nvidia-cuda-runtime",
        "nvidia-cuda-runtime-cu13",
        "nvidia-cuda-runtime-cu12",
        "nvidia-cuda-runtime-cu11",
    ):
        if name in pins:
            version = parse_version(pins[name])
            if version:
                return version[:2]
    torch = pins.get("torch", "")
    match = re.search(r"\+cu(\d+)(\d)$", torch)
    if match:
        return int(match.group(1)), int(match.group(2))
    return None


def min_driver_for_cuda(cuda):
    return DRIVER_FOR_CUDA_MAJOR.get(cuda[0]) if cuda else None


def check_host(facts, profile="cpu", expected_count=None, stack_cuda=None):
    """Errors, warnings and notes about the GPUs of a host for the serving stack.

    facts: gpu_info's `gpu` document. profile: `gpu` requires GPUs; anything else accepts none.
    stack_cuda: (major, minor) the pinned serving stack needs, or None.
    """
    errors, warnings, notes = [], [], []
    count = int(facts.get("count") or 0)
    if count == 0:
        reason = facts.get("reason") or "no GPU found"
        if profile == "gpu":
            errors.append(
                f"no GPU is visible on this host ({reason}) but regen_profile is 'gpu'; check the driver on "
                "the host and, in a container, that /dev/nvidia* are passed through"
            )
        else:
            notes.append(
                f"no GPU on this host ({reason}); profile '{profile}' needs none, GPU checks skipped"
            )
        return {"errors": errors, "warnings": warnings, "notes": notes}

    if expected_count is not None and expected_count != count:
        errors.append(
            f"{count} GPU(s) visible but regen_expected_gpu_count is {expected_count}; check "
            "CUDA_VISIBLE_DEVICES and the container's device passthrough (every /dev/nvidiaN)"
        )

    driver = parse_version(facts.get("driver_version"))
    driver_cuda = parse_version(facts.get("cuda_version"))
    names = ", ".join(facts.get("names") or []) or "GPU"
    if driver is None:
        errors.append("the NVIDIA driver version could not be read (nvidia-smi gave none)")
    if driver_cuda is None:
        warnings.append(
            "nvidia-smi reports no CUDA version (vGPU or a driver without CUDA); the checks use the "
            "driver version alone"
        )

    for capability in facts.get("compute_capabilities") or []:
        need = min_cuda_for_capability(capability)
        if need is None:
            warnings.append(
                f"compute capability {capability} is older than anything the serving stack targets"
            )
            continue
        label = f"{names} ({arch_tag(capability)}, {generation(capability)})"
        if driver_cuda and driver_cuda[:2] < need:
            errors.append(
                "{} needs CUDA {} or newer, but the driver {} supports only CUDA {}; upgrade the host's "
                "NVIDIA driver".format(label, fmt(need), facts.get("driver_version"), fmt(driver_cuda[:2]))
            )
        if generation(capability) == "Blackwell" and driver and driver[:2] < BLACKWELL_MIN_DRIVER:
            errors.append(
                f"{label} needs driver R{BLACKWELL_MIN_DRIVER[0]} or newer (CUDA 12.8 and Blackwell "
                f"support); this host has {facts.get('driver_version')}"
            )

    if stack_cuda:
        need_driver = min_driver_for_cuda(stack_cuda)
        if need_driver and driver and driver[:2] < need_driver:
            errors.append(
                "the pinned serving stack is built for CUDA {}, which needs driver {} or newer; this host "
                "has {} (CUDA {}); upgrade the host driver (never inside the container)".format(
                    fmt(stack_cuda),
                    fmt(need_driver),
                    facts.get("driver_version"),
                    fmt(driver_cuda[:2]) if driver_cuda else "unknown",
                )
            )
        elif driver_cuda and driver_cuda[:2] < stack_cuda:
            errors.append(
                f"the pinned serving stack needs CUDA {fmt(stack_cuda)} but the driver supports "
                f"CUDA {fmt(driver_cuda[:2])}"
            )
    notes.append(f"{count} x {names}, driver {facts.get('driver_version')}, CUDA {facts.get('cuda_version')}")
    return {"errors": errors, "warnings": warnings, "notes": notes}


def check_device_nodes(dev_entries, count):
    """Which /dev/nvidia* nodes a container needs and lacks (dev_entries: names in /dev)."""
    if count == 0:
        return []
    present = set(dev_entries)
    wanted = ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(count)]
    missing = [f"/dev/{name}" for name in wanted if name not in present]
    if not missing:
        return []
    return [
        "{} missing: pass the GPU device nodes into the container (on Proxmox: lxc.cgroup2.devices.allow "
        "for majors 195 and nvidia-uvm's, and an lxc.mount.entry per node in the CT's config)".format(
            ", ".join(missing)
        )
    ]


def check_torch(torch_info, facts, expected_count=None):
    """Errors and warnings about torch in the serving venv against the host's GPUs."""
    errors, warnings = [], []
    count = int(facts.get("count") or 0)
    if not torch_info or torch_info.get("ok") is False:
        errors.append(
            "torch does not import in the serving venv: %s"
            % ((torch_info or {}).get("error") or "not installed")
        )
        return {"errors": errors, "warnings": warnings}
    if count == 0:
        return {"errors": errors, "warnings": warnings}
    if not torch_info.get("cuda"):
        errors.append(
            "torch {} in the serving venv is a CPU-only build; the serving lock must pin a CUDA build".format(
                torch_info.get("version")
            )
        )
        return {"errors": errors, "warnings": warnings}
    if not torch_info.get("cuda_available"):
        errors.append(
            "torch {} (CUDA {}) cannot use the GPUs (torch.cuda.is_available() is False); the driver is "
            "too old for this CUDA build or /dev/nvidia* are missing".format(
                torch_info.get("version"), torch_info.get("cuda")
            )
        )
        return {"errors": errors, "warnings": warnings}
    want = expected_count if expected_count is not None else count
    if torch_info.get("device_count") != want:
        errors.append(f"torch sees {torch_info.get('device_count')} GPU(s), expected {want}")
    arch_list = torch_info.get("arch_list") or []
    for capability in facts.get("compute_capabilities") or []:
        tag = arch_tag(capability)
        if tag in arch_list:
            continue
        cap = parse_version(capability)[:2]
        ptx = [
            a
            for a in arch_list
            if a.startswith("compute_") and parse_version(a) and divmod(parse_version(a)[0], 10) <= cap
        ]
        if ptx:
            warnings.append(
                "torch {} has no {} kernels; it will JIT from {} PTX (slow first start, some kernels "
                "missing)".format(torch_info.get("version"), tag, ptx[-1])
            )
        else:
            errors.append(
                "torch {} (CUDA {}) is not built for {} ({}): its arch list is {}; pin a torch built with "
                "CUDA {}+".format(
                    torch_info.get("version"),
                    torch_info.get("cuda"),
                    tag,
                    generation(capability),
                    " ".join(arch_list) or "empty",
                    fmt(min_cuda_for_capability(capability) or (0,)),
                )
            )
    return {"errors": errors, "warnings": warnings}


def torch_cuda_arch_list(capabilities):
    """TORCH_CUDA_ARCH_LIST for JIT-compiled kernels: '10.0;12.0'."""
    return ";".join(sorted(set(capabilities or []), key=lambda c: parse_version(c)))
