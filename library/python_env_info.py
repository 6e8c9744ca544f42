#!/usr/bin/python
"""Ansible module: what imports in this interpreter, with versions and the reason for failures."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: python_env_info
short_description: Which modules import in the task's interpreter, their versions and torch's CUDA build
description:
  - Imports each listed module in a child process of the task's interpreter and reports its version, or the
    exception type and message when it fails (a crash of the interpreter is reported as such).
  - For C(torch) also reports C(torch.version.cuda), CUDA availability, device count and the compiled
    arch list.
  - Never fails because a module is missing, nor because O(python) does not exist (every module is then
    reported as failed with the reason); assert on the result instead.
  - The one probe of what a venv can import (module_utils/regen_pyenv.py), also used by python_venv.
version_added: "0.1.0"
author: regen maintainers
options:
  modules:
    description: Import names to try.
    type: list
    elements: str
    default: [torch, transformers, tiktoken, tokenizers, safetensors, jinja2, sglang]
  python:
    description: Interpreter to inspect; default the one running the task (C(ansible_python_interpreter)).
    type: path
  timeout:
    description: Seconds allowed for all the imports together.
    type: int
    default: 300
attributes:
  check_mode:
    support: full
notes:
  - Set C(ansible_python_interpreter) to the python of the venv under inspection.
"""

EXAMPLES = r"""
- name: What can the serving venv import
  python_env_info:
    modules: [torch, sglang, tiktoken]
  vars:
    ansible_python_interpreter: /root/venv_sglang/bin/python
  register: _env

- name: Does the training venv have SpecForge (the venv may not exist yet)
  python_env_info:
    python: /root/venv_specforge/bin/python
    modules: [specforge.cli]
  register: _training
"""

RETURN = r"""
python_env:
  description: Interpreter and import facts.
  returned: success
  type: dict
  contains:
    python:
      description: C(executable), C(version), C(prefix) (the venv) and C(is_venv); C(version) is null when
        the interpreter does not run.
      type: dict
    imported:
      description: Module name to version for every module that imported.
      type: dict
    missing:
      description: Modules that are not installed.
      type: list
      elements: str
    failed:
      description: Module name to C(error_type), C(error) and C(missing_module) for every import that failed.
      type: dict
    torch:
      description: C(cuda), C(cuda_available), C(device_count), C(arch_list) when torch imported.
      type: dict
    modules:
      description: One record per requested module, in order.
      type: list
      elements: dict
"""

import sys

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_pyenv import probe, summarize


def main():
    module = AnsibleModule(
        argument_spec={
            "modules": {
                "type": "list",
                "elements": "str",
                "default": [
                    "torch",
                    "transformers",
                    "tiktoken",
                    "tokenizers",
                    "safetensors",
                    "jinja2",
                    "sglang",
                ],
            },
            "python": {"type": "path"},
            "timeout": {"type": "int", "default": 300},
        },
        supports_check_mode=True,
    )
    python = module.params["python"] or sys.executable
    modules = module.params["modules"]
    records, interpreter, error = probe(modules, python, timeout=module.params["timeout"])
    if error:
        # The interpreter itself is the problem: every module is unusable for the same reason.
        interpreter = {"executable": python}
        records = [
            {
                "name": name,
                "ok": False,
                "version": None,
                "error_type": "InterpreterError",
                "error": error,
                "missing_module": None,
            }
            for name in modules
        ]
    module.exit_json(changed=False, python_env=summarize(records, interpreter))


if __name__ == "__main__":
    main()
