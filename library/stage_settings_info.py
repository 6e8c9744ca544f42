#!/usr/bin/python
"""Ansible module: a stage's plan-backed settings, each with where it came from and why."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stage_settings_info
short_description: Resolve a stage's plan-backed settings (override, else plan, else a documented default)
description:
  - Thin wrapper over C(module_utils/regen_settings.py), the one table of the settings the plan decides.
    For each stage and setting it names the plan entry it comes from, the role variable that overrides
    it, and what happens when neither gives a value (a failure naming the variable, or a default
    documented in the table).
  - Fails naming the variable when a setting has no value, and when the call does not pass exactly the
    stage's override variables (so a new table row cannot be forgotten in the role).
  - In check mode a setting without a value (the introspect stage has not run yet) is returned as null
    and listed in RV(unresolved) instead of failing.
  - Reads nothing from the host and changes nothing.
version_added: "0.1.0"
author: regen maintainers
options:
  stage:
    description: The stage whose settings to resolve.
    type: str
    required: true
    choices: [generate, tokenize, train, capture, evaluate]
  plan:
    description: The facts' C(plan) (entries C({value, reason})); null or C({}) when there are no facts.
    type: dict
  overrides:
    description: Every override variable of the stage's rows, by name, with its value (null when unset).
    type: dict
    required: true
  inputs:
    description:
      - What derived settings need (C(evaluate) - C(max_new_tokens); C(tokenize) - C(truncation), for the
        note on an override).
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Resolve the generate stage's settings
  stage_settings_info:
    stage: generate
    plan: "{{ regen_facts.plan | default(none) }}"
    overrides:
      completions_max_tokens: "{{ completions_max_tokens }}"
      completions_concurrency: "{{ completions_concurrency }}"
      completions_chat_template_kwargs: "{{ completions_chat_template_kwargs }}"
  register: _completions_settings
"""

RETURN = r"""
settings:
  description: Each setting's value by name (null only in check mode, for an unresolved one).
  returned: always
  type: dict
  sample: {max_tokens: 4096, concurrency: 64, chat_template_kwargs: {thinking: true}}
sources:
  description:
    - Each setting's C(value), C(source) (override, plan, default, derived or unresolved), C(variable),
      C(plan_path) and C(reason).
  returned: always
  type: dict
notes:
  description: One line per override that differs from the plan's value, saying what it overrides.
  returned: always
  type: list
  elements: str
unresolved:
  description: Why each setting without a value has none (check mode only; otherwise the module fails).
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_settings import STAGES, SettingsError, resolve


def main():
    module = AnsibleModule(
        argument_spec={
            "stage": {"type": "str", "required": True, "choices": list(STAGES)},
            "plan": {"type": "dict"},
            "overrides": {"type": "dict", "required": True},
            "inputs": {"type": "dict", "default": {}},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        resolved, notes, unresolved = resolve(
            p["stage"], p["plan"], p["overrides"], p["inputs"], partial=module.check_mode
        )
    except SettingsError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(
        changed=False,
        settings={name: entry["value"] for name, entry in resolved.items()},
        sources=resolved,
        notes=notes,
        unresolved=unresolved,
    )


if __name__ == "__main__":
    main()
