#!/usr/bin/python
"""Ansible module: the plan (serving layout, generation kwargs, drafter layout) derived from the facts."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_plan_info
short_description: Derive the plan every later stage reads from the architecture, tokenizer and GPU facts
description:
  - Thin wrapper over C(module_utils/regen_plan.py). Computes the C(plan) section of the model facts
    (serving parallelism and fit, generation kwargs, drafter layout), each value with a one-line reason.
  - Checks O(overrides) first and fails, naming every unknown section or key, so an inventory typo
    never passes silently. Without O(architecture) only that check runs.
  - The C(length) section is the run's one length budget (prompt tokens from O(prompts) + generated tokens
    per turn); the serving context length, generation C(max_tokens) and concurrency, and the
    tokenize/capture/training C(max_length) read it. A budget that cannot hold the longest prompt fails.
  - Reads nothing from the host and changes nothing; the role runs it on the controller.
version_added: "0.1.0"
author: regen maintainers
options:
  architecture:
    description: The C(architecture) document of model_config_info; omit it to only check O(overrides).
    type: dict
  tokenizer:
    description: The C(tokenizer) document of tokenizer_info (without it, or with C(available=false), the
      entries that depend on the tokenizer are unknown, each with the reason and the remedy).
    type: dict
  gpu:
    description: The C(gpu) document of gpu_info.
    type: dict
  overrides:
    description: Plan values set in inventory (model_facts_plan_overrides), a mapping of section to values.
    type: dict
    default: {}
  simulation:
    description:
      - What layout_simulation_info returned (aiconfigurator's ranking, or why it does not cover this
        model and GPU). Recorded as C(serving.simulator_estimate) beside the plan's choice; it never
        changes the choice.
    type: dict
  sweep_report:
    description:
      - The layout sweep's C(artifacts/sweep/report.json) when it exists. Its recommended layout replaces
        the plan's serving values (unless O(overrides) sets them) when it was measured for this model,
        GPU count and O(backend); C(serving.sweep) says what was applied or why not.
    type: dict
  backend:
    description: The server the run uses (sglang or transformers), to match the sweep report against.
    type: str
  prompts:
    description:
      - The prompt set's statistics, C({fingerprint, rows, lengths}) of the prompts stage's C(manifest.json).
      - Without them the budget assumes 2,048 prompt tokens and says so.
    type: dict
  length_budget:
    description: The user's one length override (C(regen_length_budget)), tokens per sequence; null plans it.
    type: int
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Check the plan overrides before reading any facts
  model_plan_info:
    overrides: "{{ model_facts_plan_overrides }}"
  delegate_to: localhost

- name: Derive the plan
  model_plan_info:
    architecture: "{{ _arch.architecture }}"
    tokenizer: "{{ _tok.tokenizer }}"
    gpu: "{{ _gpu.gpu }}"
    overrides: "{{ model_facts_plan_overrides }}"
    prompts: "{{ _manifest | default({}) }}"
    length_budget: "{{ regen_length_budget }}"
  delegate_to: localhost
  register: _plan
"""

RETURN = r"""
plan:
  description: >-
    The plan (C(serving), C(generation), C(drafter), C(length), C(warnings)); null without O(architecture).
  returned: always
  type: dict
plan_values:
  description:
    - The same plan with each C({value, reason}) entry unwrapped to its value (C(plan_values) in
      C(module_utils/regen_plan.py)), so readers of the facts document never unwrap entries themselves.
    - Null without O(architecture).
  returned: always
  type: dict
plan_unknown:
  description:
    - The entries that are unknown (C(unknown_entries) in C(module_utils/regen_plan.py)), by C(section.key),
      each with C(reason) and C(remedy); without tokenizer facts these are the thinking switch, the
      chat-template kwargs, the stop tokens, the reasoning parser (where the family has one) and the mask
      token. C({}) when all are known or without O(architecture).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_budget import BudgetError
from ansible.module_utils.regen_plan import (
    make_plan,
    override_errors,
    plan_values,
    refresh_estimate,
    unknown_entries,
)
from ansible.module_utils.regen_simulator import plan_entry as simulator_entry
from ansible.module_utils.regen_sweep import apply_report


def main():
    module = AnsibleModule(
        argument_spec={
            "architecture": {"type": "dict"},
            "tokenizer": {"type": "dict"},
            "gpu": {"type": "dict"},
            "overrides": {"type": "dict", "default": {}},
            "simulation": {"type": "dict"},
            "sweep_report": {"type": "dict"},
            "backend": {"type": "str"},
            "prompts": {"type": "dict"},
            "length_budget": {"type": "int"},
        },
        supports_check_mode=True,
    )
    p = module.params
    errors = override_errors(p["overrides"])
    if errors:
        module.fail_json(msg="; ".join(errors), override_errors=errors)
    plan = None
    if p["architecture"] is not None:
        try:
            plan = make_plan(p["architecture"], p["tokenizer"], p["gpu"], p["overrides"],
                             prompts=p["prompts"], length_budget=p["length_budget"])
        except BudgetError as exc:
            module.fail_json(msg=str(exc))
        # The measured layout (when a sweep report fits this model and host), then the simulator's estimate
        # beside the final choice; each only when the role passed it.
        if p["sweep_report"] is not None:
            plan = apply_report(
                plan, p["sweep_report"], p["overrides"], p["architecture"], p["gpu"], p["backend"]
            )
        if p["simulation"] is not None:
            serving = plan_values(plan)["serving"]
            plan["serving"]["simulator_estimate"] = simulator_entry(p["simulation"], serving)
            # The run estimate again, now with the simulator's throughput for the chosen layout.
            refresh_estimate(plan, p["architecture"], p["prompts"], p["overrides"])
    module.exit_json(
        changed=False, plan=plan, plan_values=plan_values(plan) if plan is not None else None,
        plan_unknown=unknown_entries(plan),
    )


if __name__ == "__main__":
    main()
