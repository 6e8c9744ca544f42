#!/usr/bin/python
"""Ansible module: the model facts a stage reads, found once, with the plan's values unwrapped."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_facts_info
short_description: Find the model facts of the introspect stage and unwrap the plan's values
description:
  - Returns the first non-empty document of O(documents) (facts the introspect stage set in this run),
    else the JSON document at O(path) (the C(model_facts.json) it wrote on the controller), else C({}).
  - Also returns the plan with every C({value, reason}) entry replaced by its value, so tasks and
    templates read C(plan_values.generation.chat_template_kwargs) instead of unwrapping entries in Jinja,
    and the entries that are unknown (C(plan_unknown)), whose null value is not a decision.
  - Thin wrapper over C(module_utils/regen_plan.py) (C(plan_values)). Reads only; the role
    the role C(regen) runs it on the controller once per stage play.
version_added: "0.1.0"
author: regen maintainers
options:
  documents:
    description: Facts documents already in memory, most preferred first; empty ones are skipped.
    type: list
    elements: dict
    default: []
  path:
    description: Controller path of C(model_facts.json); a missing file means no facts.
    type: path
    required: true
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Load the model facts once for this play
  model_facts_info:
    documents: ["{{ regen_model_facts | default({}) }}"]
    path: "{{ regen_artifacts_dir }}/model_facts.json"
  delegate_to: localhost
  register: _facts

- name: Use a plan value
  ansible.builtin.debug:
    msg: "{{ _facts.plan_values.generation.chat_template_kwargs | default({}) }}"
"""

RETURN = r"""
facts:
  description: The facts document (C(architecture), C(tokenizer), C(environment), C(plan)); C({}) when none.
  returned: always
  type: dict
plan_values:
  description: >-
    The plan's sections (C(serving), C(generation), C(drafter), C(length)) with each entry's value; every
    section is present (empty without facts).
  returned: always
  type: dict
  sample:
    serving: {tp_size: 8}
    generation: {chat_template_kwargs: {thinking: true}}
    drafter: {}
plan_unknown:
  description: >-
    The plan entries that are unknown (introspection could not read the tokenizer), by C(section.key), each
    with its C(reason) and C(remedy); C({}) when every entry is known. A stage that needs one of them fails
    with that reason unless its own variable sets the value.
  returned: always
  type: dict
  sample:
    drafter.mask_token_id:
      reason: "unknown: /models/Kimi-K2.6 holds no tokenizer files"
      remedy: put the model's tokenizer files into /models/Kimi-K2.6, then re-run the introspect stage
source:
  description: Where the facts came from, C(memory), the file's path, or C(none).
  returned: always
  type: str
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_plan import PLAN_KEYS, plan_values, unknown_entries


def _read(module, path):
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as exc:
        module.fail_json(
            msg=f"{path} cannot be read as JSON ({exc}); re-run the introspect stage "
            "(ansible-playbook regen.yml --tags introspect) or point regen_facts_file at a good copy"
        )
    if not isinstance(document, dict):
        module.fail_json(
            msg=f"{path} holds a JSON {type(document).__name__}, not a facts object; "
            "re-run the introspect stage"
        )
    return document


def main():
    module = AnsibleModule(
        argument_spec={
            "documents": {"type": "list", "elements": "dict", "default": []},
            "path": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    facts, source = next(((doc, "memory") for doc in p["documents"] if doc), ({}, "none"))
    if source == "none" and os.path.isfile(p["path"]):
        facts, source = _read(module, p["path"]), p["path"]
    values = plan_values(facts.get("plan"))
    for section in PLAN_KEYS:  # every section a mapping, so a template can test a key without guards
        if not isinstance(values.get(section), dict):
            values[section] = {}
    module.exit_json(
        changed=False, facts=facts, plan_values=values, plan_unknown=unknown_entries(facts.get("plan")),
        source=source,
    )


if __name__ == "__main__":
    main()
