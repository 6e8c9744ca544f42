#!/usr/bin/python
"""Ansible module: plan the model server's (or router's) launch line and check the host can run it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: serving_launch_info
short_description: Plan the launch line of a model server (SGLang, transformers serve) or sglang-router
description:
  - Turns the model facts, the introspection plan and inventory overrides into the argv, environment,
    endpoint and readiness probe of one server, or of an sglang-router in front of several servers.
  - Checks what only the host can tell. The model directory exists, enough GPUs are visible (counted
    with nvidia-smi), and whether the port is already taken.
  - Reads only; never changes the host, so it runs the same in check mode.
  - Fails with a message naming the variable to fix when the plan cannot work (more GPUs than the host
    has, an EP size that does not divide the tensor-parallel size, a non-loopback bind without an API
    key, a missing model directory).
options:
  kind:
    description: What to plan.
    type: str
    choices: [server, router]
    default: server
  backend:
    description: Server implementation.
    type: str
    choices: [sglang, transformers]
    default: sglang
  name:
    description: Instance name (unit C(regen-serve-<name>), state files C(<name>.*)).
    type: str
    default: main
  model_path:
    description: Model directory on the host.
    type: path
  check_model_path:
    description: Fail when O(model_path) is not a directory holding C(config.json).
    type: bool
    default: true
  python:
    description: Python of the serving venv (runs C(-m sglang.launch_server) or C(-m transformers...)).
    type: str
    required: true
  facts:
    description: The model_facts document (C(architecture), C(tokenizer), C(plan)); may be empty.
    type: dict
    default: {}
  overrides:
    description: Inventory overrides of planned values (null entries take the plan).
    type: dict
    default: {}
  host:
    description: Bind address.
    type: str
    default: 127.0.0.1
  port:
    description: Port.
    type: int
    default: 30000
  api_key:
    description: API key; only whether it is set is used here, it is never returned.
    type: str
    default: ''
  secret_config_path:
    description: YAML file (mode 0600) holding the API key that SGLang reads with C(--config).
    type: path
  extra_args:
    description: Extra argv elements appended to the launch line.
    type: list
    elements: str
    default: []
  environment:
    description: Environment variables for the server.
    type: dict
    default: {}
  gpu_count:
    description: GPUs visible on the host; C(-1) counts them with nvidia-smi (sglang only).
    type: int
    default: -1
  gpu_ids:
    description: GPU indices to use (sets C(CUDA_VISIBLE_DEVICES)); empty uses all.
    type: list
    elements: int
    default: []
  nnodes:
    description: Number of nodes one server spans.
    type: int
    default: 1
  node_rank:
    description: This host's rank among them (0 serves the API).
    type: int
    default: 0
  dist_init_addr:
    description: C(HOST:PORT) of rank 0 for multi-node initialisation.
    type: str
  pcie_blackwell_environment:
    description:
      - Environment applied when the GPU facts show several PCIe-only Blackwell (sm_120) GPUs, where
        NCCL peer-to-peer hangs unless IOMMU/ACS are off on the host. C({}) applies nothing.
    type: dict
  device:
    description: Device for the transformers backend.
    type: str
    default: cpu
  worker_urls:
    description: Router only; the servers behind it.
    type: list
    elements: str
    default: []
  policy:
    description: Router only; load-balancing policy.
    type: str
    default: cache_aware
  metrics_host:
    description:
      - Router only; bind address of its Prometheus metrics (C(--prometheus-host)), which have no
        authentication. sglang-router's own default is C(0.0.0.0).
    type: str
    default: 127.0.0.1
  metrics_port:
    description: Router only; port of its Prometheus metrics (C(--prometheus-port)).
    type: int
    default: 29000
author:
  - regen project
"""

EXAMPLES = r"""
- name: Plan the SGLang launch line from the facts
  serving_launch_info:
    backend: sglang
    model_path: /root/models/Kimi-K2.6
    python: /root/venv_sglang/bin/python
    facts: "{{ regen_model_facts }}"
    overrides:
      ep_size: 8
  register: plan

- name: Plan a router over two servers
  serving_launch_info:
    kind: router
    python: /root/venv_sglang/bin/python
    worker_urls: [http://10.0.0.1:30000, http://10.0.0.2:30000]
    port: 30100
"""

RETURN = r"""
plan:
  description: The launch plan.
  returned: always
  type: dict
  contains:
    argv: {description: The command line, one element per argument., type: list}
    command_line: {description: The same, shell-quoted on one line., type: str}
    env: {description: Environment for the server., type: dict}
    endpoint: {description: Base URL (null on ranks without an HTTP API)., type: str}
    readiness: {description: Method and path that answers when the server is ready., type: dict}
    served_model_name: {description: Model name the API serves., type: str}
    settings: {description: Each derived value with its source and reason., type: dict}
    config_hash: {description: Fingerprint of argv and environment., type: str}
    warnings: {description: Things worth knowing that do not stop the launch., type: list}
exec_start:
  description: The argv quoted for a systemd C(ExecStart=) line.
  returned: always
  type: str
environment_lines:
  description: Quoted C(Environment=) values for a systemd unit.
  returned: always
  type: list
gpu_count:
  description: GPUs visible on the host (null when not counted).
  returned: always
  type: int
gpu_count_source:
  description: Where RV(gpu_count) came from (the O(gpu_count) option or nvidia-smi), or why it is unknown.
  returned: always
  type: str
router_python:
  description: >-
    What the check of the router's interpreter found (it imports C(sglang_router), or why it was not
    checked); a router whose interpreter cannot import it fails the module, naming
    C(sglang_server_router_python).
  returned: when O(kind) is C(router)
  type: str
"""

import os
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_serving import (
    ServingPlanError,
    plan_router,
    plan_server,
    systemd_env_line,
    systemd_exec,
)


def _count_gpus(module):
    """GPUs nvidia-smi lists; 0 when the tool is missing (a CPU host)."""
    tool = shutil.which("nvidia-smi")
    if not tool:
        return 0, "nvidia-smi not found"
    proc = subprocess.run([tool, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        module.fail_json(msg="nvidia-smi failed (%s); check the NVIDIA driver on this host"
                         % (proc.stderr.strip() or proc.returncode))
    return len([line for line in proc.stdout.splitlines() if line.strip()]), "nvidia-smi"


def _check_router_python(module, python):
    """Fail, naming the variable, when the router's interpreter cannot import sglang_router.

    sglang[all] does not pull sglang-router in: a serving venv built from an older lock has SGLang and no
    router, and the router's unit would die at its first line. Check mode on a host whose venv does not exist
    yet (the provision stage would build it) passes, saying so in the result."""
    found = python if os.path.isabs(python) else shutil.which(python)
    remedy = ("set sglang_server_router_python to an interpreter with sglang-router 0.3.2 (it is in "
              "envs/serving.lock and envs/demo-serving.lock; sglang[all] does not install it)")
    if not found or not os.path.exists(found):
        if module.check_mode:
            return f"not checked: {python} does not exist yet (check mode)"
        module.fail_json(msg=f"the router's python {python} does not exist on this host; run the provision "
                         f"stage, or {remedy}")
    proc = subprocess.run([found, "-c", "import sglang_router"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        module.fail_json(msg=f"the router's python {python} cannot import sglang_router ({why}): run the "
                         f"provision stage again, or {remedy}")
    return "imports sglang_router"


def main():
    module = AnsibleModule(
        argument_spec={
            "kind": {"type": "str", "choices": ["server", "router"], "default": "server"},
            "backend": {"type": "str", "choices": ["sglang", "transformers"], "default": "sglang"},
            "name": {"type": "str", "default": "main"},
            "model_path": {"type": "path"},
            "check_model_path": {"type": "bool", "default": True},
            "python": {"type": "str", "required": True},
            "facts": {"type": "dict", "default": {}},
            "overrides": {"type": "dict", "default": {}},
            "host": {"type": "str", "default": "127.0.0.1"},
            "port": {"type": "int", "default": 30000},
            "api_key": {"type": "str", "default": "", "no_log": True},
            "secret_config_path": {"type": "path"},
            "extra_args": {"type": "list", "elements": "str", "default": []},
            "environment": {"type": "dict", "default": {}},
            "gpu_count": {"type": "int", "default": -1},
            "gpu_ids": {"type": "list", "elements": "int", "default": []},
            "nnodes": {"type": "int", "default": 1},
            "node_rank": {"type": "int", "default": 0},
            "dist_init_addr": {"type": "str"},
            "device": {"type": "str", "default": "cpu"},
            "pcie_blackwell_environment": {"type": "dict"},
            "worker_urls": {"type": "list", "elements": "str", "default": []},
            "policy": {"type": "str", "default": "cache_aware"},
            "metrics_host": {"type": "str", "default": "127.0.0.1"},
            "metrics_port": {"type": "int", "default": 29000},
        },
        supports_check_mode=True,
    )
    p = module.params
    api_key_set = bool(p["api_key"])
    result = {"changed": False, "gpu_count": None, "gpu_count_source": None}
    try:
        if p["kind"] == "router":
            result["router_python"] = _check_router_python(module, p["python"])
            plan = plan_router({
                "python": p["python"], "worker_urls": p["worker_urls"], "policy": p["policy"],
                "host": p["host"], "port": p["port"], "api_key_set": api_key_set,
                "extra_args": p["extra_args"], "env": p["environment"],
                "metrics_host": p["metrics_host"], "metrics_port": p["metrics_port"],
            })
        else:
            model_path = p["model_path"]
            if p["check_model_path"] and model_path:
                if not os.path.isdir(model_path):
                    module.fail_json(
                        msg=f"model path {model_path} does not exist on this host; build or copy the model "
                        f"there (the demo: python -m regen.demo.build --output {model_path}) or set "
                        "sglang_server_model_path")
                if not os.path.isfile(os.path.join(model_path, "config.json")):
                    module.fail_json(msg=f"model path {model_path} has no config.json; it is not a Hugging "
                                     "Face model directory (incomplete copy?)")
            gpu_count = p["gpu_count"] if p["gpu_count"] >= 0 else None
            source = "inventory" if gpu_count is not None else None
            if gpu_count is None and p["backend"] == "sglang":
                gpu_count, source = _count_gpus(module)
            if gpu_count is not None and p["gpu_ids"]:
                missing = [i for i in p["gpu_ids"] if i >= gpu_count]
                if missing:
                    module.fail_json(msg=f"sglang_server_gpu_ids names GPU(s) {missing} but the host has "
                                     f"{gpu_count} (0..{gpu_count - 1})")
                gpu_count = len(p["gpu_ids"])
            result.update(gpu_count=gpu_count, gpu_count_source=source)
            plan = plan_server({
                "backend": p["backend"], "name": p["name"], "model_path": model_path, "python": p["python"],
                "facts": p["facts"], "overrides": p["overrides"], "host": p["host"], "port": p["port"],
                "api_key_set": api_key_set, "secret_config_path": p["secret_config_path"],
                "extra_args": p["extra_args"], "env": p["environment"], "gpu_count": gpu_count,
                "gpu_ids": p["gpu_ids"], "nnodes": p["nnodes"], "node_rank": p["node_rank"],
                "dist_init_addr": p["dist_init_addr"], "device": p["device"],
                "pcie_blackwell_env": p["pcie_blackwell_environment"],
            })
        result["plan"] = plan
        result["exec_start"] = systemd_exec(plan["argv"])
        result["environment_lines"] = [systemd_env_line(k, v) for k, v in sorted(plan["env"].items())]
    except ServingPlanError as exc:
        msg = str(exc)
        if result.get("gpu_count_source") == "nvidia-smi not found" and "GPUs per node" in msg:
            msg += (" (nvidia-smi is not on this host's PATH; on a CPU host use "
                    "sglang_server_backend: transformers)")
        module.fail_json(msg=msg, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
