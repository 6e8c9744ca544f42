#!/usr/bin/python
"""Ansible module: fail on a variable the inventory or -e sets that no role declares."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: variable_names_check
short_description: Fail on variables set in inventory or with -e that no role declares
description:
  - Compares O(names) (the variables the inventory and C(-e) set for a host) with every variable the roles
    under O(roles_path) declare (the options of each C(meta/argument_specs.yml) and the keys of each
    C(defaults/main.yml); the globals are the C(regen) role's), Ansible's own names and O(user_variables).
  - Fails naming each unknown variable with the closest declared names, so a misspelled
    C(prompt_data_souces) stops the run at its start instead of leaving the role on its default.
  - Thin wrapper over C(module_utils/regen_variables.py). Reads only.
version_added: "0.1.0"
author: regen maintainers
options:
  names:
    description: The names of the variables set for the host (the keys of C(hostvars[inventory_hostname])).
    type: list
    elements: str
    required: true
  roles_path:
    description: Directories holding the roles (the configured C(roles_path)).
    type: list
    elements: path
    required: true
  user_variables:
    description: Names the user declares as their own (C(regen_user_variables)); never reported.
    type: list
    elements: str
    default: []
  facts:
    description: >-
      The names of the host's facts (the keys of C(ansible_facts)); never reported (a warm fact cache brings
      facts such as C(gather_subset) back as host variables).
    type: list
    elements: str
    default: []
  host:
    description: The host the names belong to (for the message).
    type: str
    required: true
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Check the variable names of this host
  variable_names_check:
    names: "{{ hostvars[inventory_hostname].keys() | list }}"
    roles_path: "{{ lookup('ansible.builtin.config', 'DEFAULT_ROLES_PATH') }}"
    user_variables: "{{ regen_user_variables | default([]) }}"
    facts: "{{ ansible_facts | list }}"
    host: "{{ inventory_hostname }}"
  delegate_to: localhost
"""

RETURN = r"""
declared:
  description: How many variable names the roles declare.
  returned: always
  type: int
  sample: 412
unknown:
  description: The unknown names, each with its closest declared names (the module fails when any).
  returned: always
  type: list
  elements: dict
  sample: [{name: prompt_data_souces, suggestions: [prompt_data_sources]}]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_variables import describe_unknown, role_variables, unknown_variables


def main():
    module = AnsibleModule(
        argument_spec={
            "names": {"type": "list", "elements": "str", "required": True},
            "roles_path": {"type": "list", "elements": "path", "required": True},
            "user_variables": {"type": "list", "elements": "str", "default": []},
            "facts": {"type": "list", "elements": "str", "default": []},
            "host": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    declared = {}
    for roles_dir in p["roles_path"]:
        for name, role in role_variables(roles_dir).items():
            declared.setdefault(name, role)
    unknown = unknown_variables(p["names"], declared, p["user_variables"], p["facts"])
    if unknown:
        module.fail_json(msg=describe_unknown(unknown, p["host"]), declared=len(declared), unknown=unknown)
    module.exit_json(changed=False, declared=len(declared), unknown=[])


if __name__ == "__main__":
    main()
