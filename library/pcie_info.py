#!/usr/bin/python
"""Ansible module: the node's PCIe state for NCCL (IOMMU, ACS, nvidia_uvm's HMM) and kernel arguments."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pcie_info
short_description: Report IOMMU mode, ACS request redirection, nvidia_uvm's HMM setting, kernel arguments
description:
  - Reads C(/proc/cmdline), C(/sys/kernel/iommu_groups), C(lspci -vvv) (ACSCtl lines, as root) and
    C(/sys/module/nvidia_uvm/parameters/uvm_disable_hmm). Changes nothing.
  - Returns the exact kernel-argument change that O(want_kernel_args) asks for (what to add), so the role can
    print it, and apply it only when the operator sets a variable for that.
version_added: "0.1.0"
author: regen maintainers
options:
  want_kernel_args:
    description: Kernel arguments the node should boot with, e.g. C([iommu=pt]).
    type: list
    elements: str
    default: []
  lspci:
    description: Name or path of lspci.
    type: str
    default: lspci
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Read the node's PCIe state
  pcie_info:
    want_kernel_args: [iommu=pt]
  register: _pcie
"""

RETURN = r"""
iommu:
  description: C(off), C(on) or C(pt) (passthrough), with the number of IOMMU groups.
  returned: always
  type: str
acs:
  description: One entry per ACSCtl line, C({device, request_redirect}); empty when lspci shows none.
  returned: always
  type: list
  elements: dict
acs_redirecting:
  description: Devices with ACS request redirection on (P2P through the root complex).
  returned: always
  type: list
  elements: str
uvm_disable_hmm:
  description: The loaded nvidia_uvm's uvm_disable_hmm (C(Y)/C(N)), empty when the module is not loaded.
  returned: always
  type: str
kernel_args_missing:
  description: The arguments of O(want_kernel_args) the running kernel was not booted with.
  returned: always
  type: list
  elements: str
cmdline:
  description: The running kernel's command line.
  returned: always
  type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_preflight import parse_kernel_cmdline, parse_lspci_acs


def _read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            want_kernel_args=dict(type="list", elements="str", default=[]),
            lspci=dict(type="str", default="lspci"),
        ),
        supports_check_mode=True,
    )
    cmdline = _read("/proc/cmdline")
    args = parse_kernel_cmdline(cmdline)
    try:
        groups = len(os.listdir("/sys/kernel/iommu_groups"))
    except OSError:
        groups = 0
    mode = "pt" if args.get("iommu") == "pt" else ("on" if groups else "off")
    acs = []
    lspci = module.get_bin_path(module.params["lspci"], required=False)
    if lspci:
        rc, out, _ = module.run_command([lspci, "-vvv"], environ_update={"LC_ALL": "C"})
        if rc == 0:
            acs = parse_lspci_acs(out)
    missing = []
    for wanted in module.params["want_kernel_args"]:
        key, sep, value = wanted.partition("=")
        if args.get(key) != (value if sep else True):
            missing.append(wanted)
    module.exit_json(
        changed=False,
        iommu=f"{mode} ({groups} groups)",
        acs=acs,
        acs_redirecting=[a["device"] for a in acs if a["request_redirect"]],
        uvm_disable_hmm=_read("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm"),
        kernel_args_missing=missing,
        cmdline=cmdline,
    )


if __name__ == "__main__":
    main()
