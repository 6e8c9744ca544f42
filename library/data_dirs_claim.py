#!/usr/bin/python
"""Ansible module: claim the run's data directories for its inventory, or fail when another owns them."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: data_dirs_claim
short_description: Claim the work and artifacts directories for this inventory, or fail on another's
description:
  - Each directory of O(directories) records the inventory that first used it (C(.regen-owner.json)). An
    unclaimed one is claimed for O(inventory) (changed; not in check mode); one of another inventory fails
    with the fix (its own directories, or O(shared) to share on purpose).
  - Keeps two inventories of one checkout from overwriting each other's prompts, completions, drafter and
    reports unawares.
  - Thin wrapper over C(module_utils/regen_ownership.py).
version_added: "0.1.0"
author: regen maintainers
options:
  directories:
    description: The directories to claim, each C({path, variable, kind}) (kind names it in the message).
    type: list
    elements: dict
    required: true
  inventory:
    description: The run's inventory source (the first of C(ansible_inventory_sources)).
    type: path
    required: true
  shared:
    description: Share directories another inventory claimed (C(regen_shared_dirs)); nothing fails.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Claim the data directories for this inventory
  data_dirs_claim:
    directories:
      - {path: "{{ regen_artifacts_dir }}", variable: regen_artifacts_dir, kind: artifacts directory}
    inventory: "{{ ansible_inventory_sources | first }}"
    shared: "{{ regen_shared_dirs | default(false) }}"
  delegate_to: localhost
"""

RETURN = r"""
directories:
  description: Per directory, its C(path), C(state) (claimed, owned, foreign) and C(owner).
  returned: always
  type: list
  elements: dict
  sample: [{path: /srv/regen/artifacts, state: owned, owner: /srv/regen/inventory/local}]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_ownership import claim, describe_foreign


def main():
    module = AnsibleModule(
        argument_spec={
            "directories": {"type": "list", "elements": "dict", "required": True},
            "inventory": {"type": "path", "required": True},
            "shared": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    results, problems = [], []
    for entry in p["directories"]:
        path = entry.get("path")
        if not path:
            continue
        state, recorded = claim(path, p["inventory"], write=not module.check_mode)
        results.append({"path": path, "state": state, "owner": recorded})
        if state == "foreign" and not p["shared"]:
            problems.append(
                describe_foreign(entry.get("kind", "directory"), entry.get("variable", "?"), path, recorded,
                                 p["inventory"])
            )
    if problems:
        module.fail_json(msg="; ".join(problems), directories=results)
    module.exit_json(changed=any(r["state"] == "claimed" for r in results), directories=results)


if __name__ == "__main__":
    main()
