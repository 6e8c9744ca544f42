#!/usr/bin/python
"""Check gpu_info facts (and optionally torch's view) against the GPU generation and the serving stack."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_requirements_info
short_description: Decide whether a host's GPUs, driver and device nodes fit the pinned serving stack
description:
  - Thin wrapper over module_utils/regen_gpu_requirements.py. Lists C(/dev) on the host for the
    C(/dev/nvidia*) nodes a container needs, and fails with every problem found, each naming the fix.
  - In check mode problems are returned as warnings, so a dry run still shows what the later stages
    would install.
options:
  facts:
    description: The C(gpu) document of gpu_info.
    type: dict
    required: true
  profile:
    description: regen_profile; C(gpu) requires GPUs.
    type: str
    default: cpu
  expected_count:
    description: GPUs that must be visible (omit to accept any number).
    type: int
  serving_lock:
    description: Text of the serving lock (its CUDA runtime pin sets the driver floor).
    type: str
    default: ''
  python_env:
    description: The C(python_env) document of python_env_info run with C(modules=[torch]) on the serving
      venv; when given, torch's build and the GPUs it sees are checked instead of the host.
    type: dict
  dev_dir:
    description: Where the device nodes are.
    type: path
    default: /dev
author: regen
"""

EXAMPLES = r"""
- name: Check the GPU host
  gpu_requirements_info:
    facts: "{{ _gpu.gpu }}"
    profile: gpu
    expected_count: 8
    serving_lock: "{{ lookup('ansible.builtin.file', 'envs/serving.lock') }}"

- name: Ask torch in the serving venv what it sees
  python_env_info:
    python: /root/venv_sglang/bin/python
    modules: [torch]
  register: _serving_torch

- name: Check torch against the GPUs
  gpu_requirements_info:
    facts: "{{ _gpu.gpu }}"
    python_env: "{{ _serving_torch.python_env }}"
"""

RETURN = r"""
errors: {description: Problems found., type: list, returned: always}
cautions: {description: Problems that do not stop provisioning (warnings)., type: list, returned: always}
notes: {description: What was found (one line per fact)., type: list, returned: always}
stack_cuda: {description: CUDA version the serving lock is built for., type: str, returned: always}
torch_cuda_arch_list: {description: TORCH_CUDA_ARCH_LIST for this host's GPUs., type: str, returned: always}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_gpu_requirements import (
    check_device_nodes,
    check_host,
    check_torch,
    fmt,
    stack_cuda_from_pins,
    torch_cuda_arch_list,
)
from ansible.module_utils.regen_pyenv import torch_view
from ansible.module_utils.regen_venv import LockError, parse_lock


def main():
    module = AnsibleModule(
        argument_spec=dict(
            facts=dict(type="dict", required=True),
            profile=dict(type="str", default="cpu"),
            expected_count=dict(type="int"),
            serving_lock=dict(type="str", default=""),
            python_env=dict(type="dict"),
            dev_dir=dict(type="path", default="/dev"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    facts = p["facts"]
    stack_cuda = None
    if p["serving_lock"].strip():
        try:
            pins = parse_lock(p["serving_lock"], "the serving lock (serving_lock)")["pins"]
        except LockError as exc:
            module.fail_json(msg=str(exc))
        stack_cuda = stack_cuda_from_pins(pins)
    if p["python_env"] is not None:
        torch = torch_view(p["python_env"])
        result = check_torch(torch, facts, p["expected_count"])
        result["notes"] = [
            "torch {}, CUDA {}, sees {} GPU(s), arch list {}".format(
                torch.get("version"),
                torch.get("cuda"),
                torch.get("device_count"),
                " ".join(torch.get("arch_list") or []),
            )
        ]
    else:
        result = check_host(facts, p["profile"], p["expected_count"], stack_cuda)
        try:
            entries = os.listdir(p["dev_dir"])
        except OSError:
            entries = []
        result["errors"] += check_device_nodes(entries, int(facts.get("count") or 0))
    summary = dict(
        result,
        stack_cuda=fmt(stack_cuda) if stack_cuda else "",
        torch_cuda_arch_list=torch_cuda_arch_list(facts.get("compute_capabilities")),
        changed=False,
    )
    # Returned as `cautions` (and shown through module.warn): `warnings` is a reserved result key.
    summary["cautions"] = summary.pop("warnings")
    for caution in summary["cautions"]:
        module.warn(caution)
    if result["errors"]:
        if module.check_mode:
            for error in result["errors"]:
                module.warn(f"check mode: provisioning would stop here: {error}")
            module.exit_json(**summary)
        module.fail_json(
            msg="; ".join(result["errors"]), **{k: v for k, v in summary.items() if k != "changed"}
        )
    module.exit_json(**summary)


if __name__ == "__main__":
    main()
