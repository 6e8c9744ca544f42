#!/usr/bin/python
"""Ansible module: the endpoints the serve stage recorded, so a stage run alone reaches that server."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: serving_endpoints_info
short_description: Read the endpoints the serve stage recorded on the controller
description:
  - Reads every C(<path>/*/state.json) the serving role wrote (one per server or router it runs) and
    returns the running ones' endpoints, a running router's before the servers behind it.
  - Thin wrapper over C(module_utils/regen_endpoints.py). A missing directory means no record; the caller
    decides what that means (the generate stage fails naming its variable and this directory).
  - Reads only; run it on the controller.
version_added: "0.1.0"
author: regen maintainers
options:
  path:
    description: The serving records' directory on the controller (C(<regen_artifacts_dir>/serving)).
    type: path
    required: true
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Find the endpoints the serve stage recorded
  serving_endpoints_info:
    path: "{{ regen_artifacts_dir }}/serving"
  delegate_to: localhost
  register: _recorded
"""

RETURN = r"""
endpoints:
  description: Base URLs of the running routers, else of the running servers; empty when none is recorded.
  returned: always
  type: list
  elements: str
served_model_name:
  description: The model name the recorded server answers to (null when none is recorded).
  returned: always
  type: str
kind:
  description: C(router) or C(server), whose endpoints these are; null when none is recorded.
  returned: always
  type: str
records:
  description: The record directories (C(<host>-<instance>)) the endpoints come from.
  returned: always
  type: list
  elements: str
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_endpoints import STATE_FILE, recorded_endpoints


def main():
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True}}, supports_check_mode=True
    )
    root = module.params["path"]
    states = {}
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name, STATE_FILE)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                states[name] = json.load(handle)
        except (OSError, ValueError) as exc:
            module.fail_json(msg=f"{path} cannot be read ({exc}): re-run the serve stage")
    module.exit_json(changed=False, **recorded_endpoints(states))


if __name__ == "__main__":
    main()
