#!/usr/bin/python
"""Ansible module: which inventory hosts may reach this host's unauthenticated services, as an nft table."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: cluster_firewall_info
short_description: Derive the sources admitted to the pipeline's unauthenticated services on this host
description:
  - For each service (capture server, Mooncake master and metadata server, torch rendezvous store) that
    this host serves to users on other hosts, the addresses of the inventory hosts in the groups that use
    it, and the nftables script of regen's own table that admits only them on the service's TCP ports.
  - A service whose users all run on this host needs no rule; when none needs one, C(needed) is false and
    the role leaves the host alone.
  - Thin wrapper over C(module_utils/regen_cluster_firewall.py). Reads nothing on the host.
version_added: "0.1.0"
author: regen maintainers
options:
  services:
    description:
      - Entries with C(name), C(ports) (TCP ports, or ranges written C(first-last)), C(servers) and
        C(clients) (inventory group or host names), and optionally C(guard), either C(shared) (the
        default; a rule only where some client is on another host) or C(always) (closed to every host but
        the admitted ones even when all clients are local, for a service that listens on every interface
        whatever it is told).
    type: list
    elements: dict
    required: true
  groups:
    description: The inventory's groups (the C(groups) magic variable).
    type: dict
    required: true
  host:
    description: This host's inventory name.
    type: str
    required: true
  table:
    description: Name of regen's nftables table (family inet).
    type: str
    required: true
  addresses:
    description: Inventory host to cluster IP address, overriding C(ansible_host).
    type: dict
    default: {}
  inventory_addresses:
    description: Inventory host to its C(ansible_host) (empty when unset).
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Derive the admitted sources
  cluster_firewall_info:
    services:
      - {name: capture server, ports: [30200], servers: [regen_capture], clients: [regen_train]}
    groups: "{{ groups }}"
    host: "{{ inventory_hostname }}"
    table: regen_cluster
  register: _firewall
"""

RETURN = r"""
needed:
  description: Whether any service on this host has users on other hosts.
  returned: always
  type: bool
rules:
  description: Per guarded service, C(name), C(ports), C(clients) (hosts) and the admitted C(ipv4)/C(ipv6).
  returned: always
  type: list
  elements: dict
summary:
  description: One line per guarded service (ports, admitted hosts and addresses) for the play's output.
  returned: always
  type: list
  elements: str
ruleset:
  description: The nft script that replaces the table atomically (empty when not needed).
  returned: always
  type: str
digest:
  description: Digest of the rules, carried in the chain's comment to compare with the live table.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_cluster_firewall import FirewallPlanError, firewall_plan


def main():
    module = AnsibleModule(
        argument_spec={
            "services": {"type": "list", "elements": "dict", "required": True},
            "groups": {"type": "dict", "required": True},
            "host": {"type": "str", "required": True},
            "table": {"type": "str", "required": True},
            "addresses": {"type": "dict", "default": {}},
            "inventory_addresses": {"type": "dict", "default": {}},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        plan = firewall_plan(
            p["services"], p["groups"], p["host"], p["table"], p["addresses"], p["inventory_addresses"]
        )
    except FirewallPlanError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **plan)


if __name__ == "__main__":
    main()
