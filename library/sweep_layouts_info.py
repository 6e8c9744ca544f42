#!/usr/bin/python
"""Ansible module: the serving layouts the layout sweep measures, which of them fit, and their estimates."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sweep_layouts_info
short_description: List the layouts the layout sweep measures, each with its feasibility and estimate
description:
  - Thin wrapper over C(module_utils/regen_sweep.py). The plan's own serving choice first (O(include_plan)),
    then the inventory's O(layouts), or, when none are given, the simulator's best O(simulator_top)
    candidates (C(plan.serving.simulator_estimate) of the facts).
  - Each layout is checked against the host by the plan's memory arithmetic (GPUs needed, weights per
    GPU within the static memory share); an infeasible one carries the reason and is recorded, not run.
  - Fails naming the layout and the key when O(layouts) is malformed. Reads nothing, changes nothing.
version_added: "0.1.0"
author: regen maintainers
options:
  layouts:
    description: The inventory's layouts (layout_sweep_layouts); empty takes the simulator's candidates.
    type: list
    elements: dict
    default: []
  facts:
    description: The model facts (regen_facts), for the plan and the simulator's estimate; may be empty.
    type: dict
    default: {}
  architecture:
    description: The model's architecture facts as read now (model_config_info); empty takes the facts'.
    type: dict
    default: {}
  gpu:
    description: The host's GPU facts as read now (gpu_info); empty takes the facts'.
    type: dict
    default: {}
  include_plan:
    description: Measure the plan's own layout first.
    type: bool
    default: true
  simulator_top:
    description: How many of the simulator's candidates to take when O(layouts) is empty.
    type: int
    default: 3
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Decide the layouts to measure
  sweep_layouts_info:
    layouts: "{{ layout_sweep_layouts }}"
    facts: "{{ regen_facts }}"
  register: _layouts
"""

RETURN = r"""
layouts:
  description: In sweep order, each C({name, settings, source, feasible, reason, estimate}).
  returned: always
  type: list
  elements: dict
model_identity:
  description: What identifies the measured model (model type and shape), recorded in the report.
  returned: always
  type: dict
gpu_count:
  description: GPUs on the host, recorded in the report (the plan applies a report only for the same count).
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_plan import plan_values
from ansible.module_utils.regen_sweep import LayoutError, model_identity, sweep_layouts


def main():
    module = AnsibleModule(
        argument_spec={
            "layouts": {"type": "list", "elements": "dict", "default": []},
            "facts": {"type": "dict", "default": {}},
            "architecture": {"type": "dict", "default": {}},
            "gpu": {"type": "dict", "default": {}},
            "include_plan": {"type": "bool", "default": True},
            "simulator_top": {"type": "int", "default": 3},
        },
        supports_check_mode=True,
    )
    p = module.params
    facts = p["facts"] or {}
    plan = facts.get("plan") or {}
    serving = (plan_values(plan) or {}).get("serving") or {}
    simulation_entry = (plan.get("serving") or {}).get("simulator_estimate") or {}
    value = simulation_entry.get("value") if isinstance(simulation_entry, dict) else None
    simulation = (
        {"covered": True, "candidates": value.get("candidates"), "tool": value.get("tool")}
        if value
        else {
            "covered": False,
            "reason": (simulation_entry or {}).get("reason")
            or "the facts hold no simulator estimate (introspect first)",
        }
    )
    architecture = p["architecture"] or facts.get("architecture") or {}
    gpu = p["gpu"] or (facts.get("environment") or {}).get("gpu") or {}
    try:
        layouts = sweep_layouts(
            p["layouts"],
            serving,
            simulation,
            architecture,
            gpu,
            include_plan=p["include_plan"],
            simulator_top=p["simulator_top"],
        )
    except LayoutError as exc:
        module.fail_json(msg=str(exc))
    if not layouts:
        module.fail_json(
            msg="no layout to measure: list some in layout_sweep_layouts, or keep "
            "layout_sweep_include_plan true"
        )
    module.exit_json(
        changed=False,
        layouts=layouts,
        model_identity=model_identity(architecture),
        gpu_count=int(gpu.get("count") or 0),
    )


if __name__ == "__main__":
    main()
