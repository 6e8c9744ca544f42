"""Filter `regen_model_plan`: the plan from the facts, computed on the controller.

The planning logic lives once, in module_utils/regen_plan.py (unit-tested there); filters cannot import
project module_utils as `ansible.module_utils.*`, so the file is loaded by its path in the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

_PLAN_FILE = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "module_utils", "regen_plan.py"
    )
)
_MODULE = None


def _plan_module():
    global _MODULE
    if _MODULE is None:
        # regen_plan imports its sibling regen_families (the model-family registry) as a plain module here.
        if os.path.dirname(_PLAN_FILE) not in sys.path:
            sys.path.append(os.path.dirname(_PLAN_FILE))
        spec = importlib.util.spec_from_file_location("regen_plan_filter_impl", _PLAN_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULE = module
    return _MODULE


def _plain(value):
    # Templating hands us tagged containers; the planner wants plain JSON data.
    return json.loads(json.dumps(value)) if value is not None else None


def regen_model_plan(architecture, tokenizer=None, gpu=None, overrides=None):
    """{{ arch | regen_model_plan(tokenizer, gpu, overrides) }} -> {serving, generation, drafter, ...}."""
    return _plan_module().make_plan(
        _plain(architecture), _plain(tokenizer), _plain(gpu), _plain(overrides) or {}
    )


def regen_plan_override_errors(overrides):
    """{{ model_facts_plan_overrides | regen_plan_override_errors }} -> messages for unknown sections/keys."""
    return _plan_module().override_errors(_plain(overrides) or {})


class FilterModule:
    def filters(self):
        return {
            "regen_model_plan": regen_model_plan,
            "regen_plan_override_errors": regen_plan_override_errors,
        }
