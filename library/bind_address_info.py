#!/usr/bin/python
"""Ansible module: what a bind address means under the pipeline's one address policy."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: bind_address_info
short_description: Judge a bind address by parsing it (loopback, one address, every interface)
description:
  - Thin wrapper over C(module_utils/regen_address.py) (the same file as C(regen.bind_address), so a role
    and a job judge an address alike).
  - Every spelling of "every interface" is recognised by parsing, not by comparing strings - C(0.0.0.0),
    C(::), C([::]), C(0), C(0x0), C(0.0), C(::ffff:0.0.0.0), an empty string, C(*), C(0.0.0.0/0) and more.
  - Fails naming O(variable) when the address is not an IP address (C(localhost) included, as the services'
    flags take an IP), when it is a wildcard and O(allow_wildcard) is false, or when it is another
    address of the host and O(allow_specific) is false. Reads nothing, changes nothing.
version_added: "0.1.0"
author: regen maintainers
options:
  address:
    description: The bind address as the inventory gives it.
    type: str
    required: true
  service:
    description: What binds it, as the failure message names it (C(the Mooncake master)).
    type: str
    required: true
  variable:
    description: The variable that holds O(address), named in the failure message.
    type: str
    required: true
  allow_variable:
    description: The variable that allows a wildcard, named in the failure message.
    type: str
    required: true
  allow_wildcard:
    description: The value of O(allow_variable).
    type: bool
    default: false
  allow_specific:
    description: Whether one non-loopback address of the host (its cluster address) is accepted.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Judge the Mooncake master's bind address
  bind_address_info:
    address: "{{ mooncake_master_bind_address }}"
    service: the Mooncake master
    variable: mooncake_master_bind_address
    allow_variable: mooncake_master_allow_any_address
    allow_wildcard: "{{ mooncake_master_allow_any_address }}"
  register: _bind
"""

RETURN = r"""
kind:
  description: C(loopback), C(wildcard) or C(specific).
  returned: always
  type: str
address:
  description: The canonical IP address (C(0.0.0.0) or C(::) for a wildcard).
  returned: always
  type: str
family:
  description: 4 or 6.
  returned: always
  type: int
local_url_host:
  description: How a client on this host reaches the service (a wildcard via loopback), IPv6 bracketed.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_address import BindAddressError, check, local_url_host


def main():
    module = AnsibleModule(
        argument_spec={
            "address": {"type": "str", "required": True},
            "service": {"type": "str", "required": True},
            "variable": {"type": "str", "required": True},
            "allow_variable": {"type": "str", "required": True},
            "allow_wildcard": {"type": "bool", "default": False},
            "allow_specific": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        info = check(
            p["address"],
            service=p["service"],
            variable=p["variable"],
            allow_variable=p["allow_variable"],
            allowed=p["allow_wildcard"],
            specific_allowed=p["allow_specific"],
        )
    except BindAddressError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(
        changed=False,
        kind=info["kind"],
        address=info["address"],
        family=info["family"],
        local_url_host=local_url_host(p["address"]),
    )


if __name__ == "__main__":
    main()
