#!/usr/bin/python
"""Ansible module: the plain and the speculative server of the GPU evaluation, and SGLang's DFLASH rules."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: evaluation_servers_info
short_description: Plan the two SGLang servers of the GPU evaluation (target alone, target with its drafter)
description:
  - Thin wrapper over C(module_utils/regen_evaluation.py). Both servers take the plan's layout through the
    serving role; this module gives the flags each adds on top of the inventory's, so the drafter is the only
    difference between them.
  - Follows SGLang 0.5.23's DFLASH rules (C(speculative_hook._handle_dflash)) and states each one in
    RV(constraints) - CUDA only, no pipeline parallelism, C(--enable-dp-lm-head) with DP attention (for both
    servers), the drafter's block size as C(--speculative-num-draft-tokens), the same explicit
    C(--max-running-requests) on both (DFLASH resets an unset one to 48), the overlap scheduler kept.
  - Fails with what to change when the plan cannot serve DFLASH (pp_size above 1, a CPU plan, speculative
    flags already in the inventory, a cap on running requests below the batch setting). Reads nothing,
    changes nothing.
version_added: "0.1.0"
author: regen maintainers
options:
  serving:
    description: The plan's serving values (C(regen_plan_values.serving)); may be empty.
    type: dict
    default: {}
  checkpoint:
    description: The drafter directory on the evaluation host (what C(--speculative-draft-model-path) names).
    type: str
    required: true
  block_size:
    description: The drafter's block size (C(block_size) in its config.json).
    type: int
    required: true
  batch_concurrency:
    description: Requests in flight at the batch setting.
    type: int
    required: true
  extra_args:
    description: >-
      Flags both servers get anyway (the inventory's C(sglang_server_extra_args), the plan's sweep settings).
    type: list
    elements: str
    default: []
  environment:
    description: Environment both servers get anyway (C(sglang_server_environment)).
    type: dict
    default: {}
  train_args:
    description: >-
      The train stage's C(sglang_dflash.args) next to the export, when there is one; empty derives them.
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Plan the evaluation servers
  evaluation_servers_info:
    serving: "{{ regen_plan_values.serving }}"
    checkpoint: /root/regen/drafter/runs/dflash-0123/export
    block_size: 16
    batch_concurrency: 16
  register: _servers
"""

RETURN = r"""
plain:
  description: The target alone, C({extra_args, identity}); the identity keys its records.
  returned: always
  type: dict
dflash:
  description: >-
    The target with the drafter, C({extra_args, identity}); its extra args end with the drafter's flags.
  returned: always
  type: dict
drafter_args:
  description: The drafter's flags (C(--speculative-algorithm DFLASH ...)).
  returned: always
  type: list
  elements: str
drafter_args_source:
  description: Whether they are the train stage's C(sglang_dflash.args) or derived from the plan, and why.
  returned: always
  type: str
constraints:
  description: SGLang's DFLASH rules and how the two launch lines follow them, one line each.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_evaluation import EvaluationPlanError, evaluation_servers


def main():
    module = AnsibleModule(
        argument_spec={
            "serving": {"type": "dict", "default": {}},
            "checkpoint": {"type": "str", "required": True},
            "block_size": {"type": "int", "required": True},
            "batch_concurrency": {"type": "int", "required": True},
            "extra_args": {"type": "list", "elements": "str", "default": []},
            "environment": {"type": "dict", "default": {}},
            "train_args": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        servers = evaluation_servers(
            p["serving"],
            p["checkpoint"],
            p["block_size"],
            p["batch_concurrency"],
            extra_args=p["extra_args"],
            environment=p["environment"],
            train_args=p["train_args"],
        )
    except EvaluationPlanError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **servers)


if __name__ == "__main__":
    main()
