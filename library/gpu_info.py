#!/usr/bin/python
"""Ansible module: NVIDIA GPU facts from nvidia-smi; no GPU is an answer, not a failure."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_info
short_description: NVIDIA GPU count, names, memory, compute capability, driver/CUDA and topology
description:
  - Runs C(nvidia-smi --query-gpu=... --format=csv), the summary table (for the CUDA version) and
    C(nvidia-smi topo -m) (for NVLink versus PCIe), and parses them.
  - A host without C(nvidia-smi), or whose driver does not answer, returns C(count=0) with the C(reason).
version_added: "0.1.0"
author: regen maintainers
options:
  nvidia_smi:
    description: Name or path of the nvidia-smi binary.
    type: str
    default: nvidia-smi
  topology:
    description: Also read C(nvidia-smi topo -m) when there is more than one GPU.
    type: bool
    default: true
  nccl_p2p_file:
    description:
      - The NCCL peer-to-peer measurement C(python -m regen.serving.p2p_probe) wrote on this host at
        provision time. Its decision is returned as C(gpu.nccl_p2p) when it was measured for these GPUs and
        this driver (C(gpu.p2p_fingerprint)); a missing file leaves C(nccl_p2p) out.
    type: path
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: What GPUs does this host have
  gpu_info:
  register: _gpu

- name: Need eight GPUs
  ansible.builtin.assert:
    that: _gpu.gpu.count >= 8
    fail_msg: "{{ _gpu.gpu.count }} GPU(s) found: {{ _gpu.gpu.reason | default('') }}"
"""

RETURN = r"""
gpu:
  description: GPU facts.
  returned: always
  type: dict
  contains:
    count:
      description: Number of GPUs (0 without GPU or driver).
      type: int
    gpus:
      description: One entry per GPU (index, name, uuid, pci_bus_id, memory_total_bytes,
        compute_capability, architecture).
      type: list
      elements: dict
    names:
      description: Distinct product names.
      type: list
      elements: str
    memory_per_gpu_bytes:
      description: Smallest GPU memory on the host.
      type: int
    driver_version:
      description: NVIDIA driver version.
      type: str
    cuda_version:
      description: Highest CUDA version the driver supports.
      type: str
    compute_capabilities:
      description: Distinct compute capabilities (e.g. C(12.0) for RTX PRO 6000 Blackwell, C(9.0) for H100).
      type: list
      elements: str
    interconnect:
      description: C(nvlink), C(pcie), C(mixed) or C(single), from C(nvidia-smi topo -m).
      type: str
    p2p_fingerprint:
      description: The GPUs' UUIDs and the driver, hashed; a P2P measurement holds only for the same value.
      type: str
    nccl_p2p:
      description:
        - With O(nccl_p2p_file) present, C(measured), and when measured C(p2p) (bool), C(env) (what the
          server needs, e.g. C(NCCL_P2P_DISABLE=1)), C(reason) (the bandwidths) and C(busbw_gbps) per mode.
      type: dict
      returned: when O(nccl_p2p_file) exists
    reason:
      description: Why C(count) is 0, when it is.
      type: str
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_gpu import gather, p2p_fingerprint, p2p_measurement


def main():
    module = AnsibleModule(
        argument_spec={
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "topology": {"type": "bool", "default": True},
            "nccl_p2p_file": {"type": "path"},
        },
        supports_check_mode=True,
    )
    path = module.get_bin_path(module.params["nvidia_smi"], required=False)

    def run(argv):
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    gpu = gather(run, path, module.params["topology"])
    gpu["p2p_fingerprint"] = p2p_fingerprint(gpu)
    p2p_file = module.params["nccl_p2p_file"]
    if p2p_file and os.path.isfile(p2p_file):
        try:
            with open(p2p_file, encoding="utf-8") as handle:
                doc = json.load(handle)
        except (OSError, ValueError) as exc:
            doc = None
            module.warn(f"{p2p_file} is not readable JSON ({exc}); re-run the provision stage to measure")
        gpu["nccl_p2p"] = p2p_measurement(doc, gpu["p2p_fingerprint"])
    module.exit_json(changed=False, gpu=gpu)


if __name__ == "__main__":
    main()
