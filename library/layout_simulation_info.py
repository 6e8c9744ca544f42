#!/usr/bin/python
"""Ansible module: aiconfigurator's simulated ranking of SGLang serving layouts for this model and GPUs."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layout_simulation_info
short_description: Rank SGLang serving layouts with aiconfigurator (the field's own simulator)
description:
  - Thin wrapper over C(module_utils/regen_simulator.py). Decides whether aiconfigurator 0.12.0 covers
    this model and GPU system (it simulates NVIDIA GPU systems only, for the architectures it parses)
    and, with O(run), runs C(aiconfigurator cli default) in a temporary directory and returns its ranked
    layouts, each mapped to SGLang's C(--tp-size)/C(--ep-size)/C(--attn-dp-size).
  - The model is given by its C(config.json) (O(config)), written to a temporary directory for the run, so
    the simulator needs neither the checkpoint nor a model hub.
  - Changes nothing (the temporary directory is removed), so it runs in check mode too. A run that fails
    or a model it does not cover is not an error here - C(covered) is false with the reason - because
    the plan then falls back to its own rules.
version_added: "0.1.0"
author: regen maintainers
options:
  architecture:
    description: The C(architecture) document of model_config_info.
    type: dict
    required: true
  gpu:
    description: The C(gpu) document of gpu_info.
    type: dict
    required: true
  config:
    description: The served model's C(config.json) (needed with O(run)).
    type: dict
    default: {}
  quant_config:
    description: Its C(hf_quant_config.json) when the checkpoint has one (NVFP4 exports).
    type: dict
    default: {}
  run:
    description: Run the simulator (true) or only decide whether it covers the model and GPUs (false).
    type: bool
    default: false
  bin_dir:
    description: The C(bin) directory of the aiconfigurator venv.
    type: path
    default: ''
  total_gpus:
    description: GPUs of the deployment; 0 takes the GPU facts' count.
    type: int
    default: 0
  isl:
    description: Input (prompt) tokens per request of the length budget.
    type: int
    default: 1024
  osl:
    description: Output tokens per request of the length budget.
    type: int
    default: 4096
  top_n:
    description: How many ranked layouts to return.
    type: int
    default: 10
  timeout:
    description: Seconds the simulator may take.
    type: int
    default: 300
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Does aiconfigurator cover this model on these GPUs?
  layout_simulation_info:
    architecture: "{{ facts.architecture }}"
    gpu: "{{ facts.environment.gpu }}"
  delegate_to: localhost
  register: _coverage

- name: Rank the layouts
  layout_simulation_info:
    architecture: "{{ facts.architecture }}"
    gpu: "{{ facts.environment.gpu }}"
    config: "{{ _config.content | b64decode | from_json }}"
    run: true
    bin_dir: "{{ regen_root }}/.cache/aiconfigurator-0.12.0/bin"
    isl: 1024
    osl: 4096
  delegate_to: localhost
"""

RETURN = r"""
simulation:
  description:
    - C(covered) (bool) and C(reason); C(system), C(isl), C(osl), C(total_gpus); with O(run) and coverage,
      C(candidates) (ranked; each with C(rank), C(name), C(settings) for SGLang, C(parallel) in
      aiconfigurator's notation, C(output_tokens_per_s), C(tokens_per_s_per_gpu), C(concurrency),
      C(ttft_ms), C(tpot_ms), C(perf_db_version)) and C(command).
  returned: always
  type: dict
"""

import json
import os
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_simulator import (
    TOOL,
    VERSION,
    command,
    coverage,
    failure_reason,
    parse_best_configs,
)


def _find_csv(root):
    for folder, _dirs, files in os.walk(root):
        if "best_config_topn.csv" in files and os.path.basename(folder) == "agg":
            return os.path.join(folder, "best_config_topn.csv")
    return None


def main():
    module = AnsibleModule(
        argument_spec={
            "architecture": {"type": "dict", "required": True},
            "gpu": {"type": "dict", "required": True},
            "config": {"type": "dict", "default": {}},
            "quant_config": {"type": "dict", "default": {}},
            "run": {"type": "bool", "default": False},
            "bin_dir": {"type": "path", "default": ""},
            "total_gpus": {"type": "int", "default": 0},
            "isl": {"type": "int", "default": 1024},
            "osl": {"type": "int", "default": 4096},
            "top_n": {"type": "int", "default": 10},
            "timeout": {"type": "int", "default": 300},
        },
        supports_check_mode=True,
    )
    p = module.params
    system, reason = coverage(p["architecture"], p["gpu"])
    total = p["total_gpus"] or int((p["gpu"] or {}).get("count") or 0)
    result = {
        "covered": system is not None,
        "reason": reason,
        "system": system,
        "isl": p["isl"],
        "osl": p["osl"],
        "total_gpus": total,
        "tool": f"{TOOL} {VERSION}",
    }
    if system is None or not p["run"]:
        module.exit_json(changed=False, simulation=result)
    if not p["config"]:
        module.fail_json(msg="layout_simulation_info: run=true needs the model's config.json in config")
    executable = os.path.join(p["bin_dir"], "aiconfigurator")
    if not os.access(executable, os.X_OK):
        module.fail_json(
            msg=f"{executable} is not there: build the aiconfigurator venv first "
            "(role serving_simulator, tasks_from venv)"
        )
    workdir = tempfile.mkdtemp(prefix="regen-aiconfigurator-")
    try:
        model_dir = os.path.join(workdir, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(p["config"], f)
        if p["quant_config"]:
            with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
                json.dump(p["quant_config"], f)
        save = os.path.join(workdir, "out")
        argv = command(p["bin_dir"], model_dir, system, total, p["isl"], p["osl"], save, p["top_n"])
        # Offline: the config is local, and the simulator must never reach a model hub.
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
        rc, out, err = module.run_command(argv, environ_update=env)
        result["command"] = " ".join(argv).replace(workdir, "<tmp>")
        found = _find_csv(save) if rc == 0 else None
        if found is None:
            result.update(
                covered=False,
                reason=f"{TOOL} {VERSION} gave no answer (exit {rc}): {failure_reason(out + err)}",
            )
            module.exit_json(changed=False, simulation=result)
        with open(found) as f:
            text = f.read()
        try:
            candidates = parse_best_configs(text)
        except ValueError as exc:
            module.fail_json(msg=f"{found}: {exc}")
        result["candidates"] = candidates[: p["top_n"]]
        if not candidates:
            result["reason"] += "; no layout met its default latency limits for this length budget"
        module.exit_json(changed=False, simulation=result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
