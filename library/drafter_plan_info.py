#!/usr/bin/python
"""Ansible module: plan a SpecForge DFlash drafter run from the model facts."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: drafter_plan_info
short_description: Plan a SpecForge DFlash drafter from the model facts
description:
  - Derives the DFlash drafter's C(config.json) (hidden size, vocabulary, target layer count,
    C(dflash_config.target_layer_ids), C(mask_token_id), C(block_size)) from the facts that the
    introspect stage produced and the target's own C(config.json), as SpecForge 0.2.0 derives them.
  - Sizes the hidden-state capture (bytes per token, bytes on disk, free space where the features go)
    and chooses offline capture, online streaming or rolling offline (shards that fit the disk budget,
    trained one after another as one SpecForge run with a fixed step horizon).
  - Works out the optimizer-step horizon, the trainer topology (node rank per host in inventory order),
    the target's embedding and LM-head tensor names, and a run id that changes whenever the recipe does.
  - Only reads; safe in check mode. Standard library only (logic in module_utils/regen_drafter.py).
version_added: "0.1.0"
author: regen maintainers
options:
  facts:
    description: The model facts document (C(regen_model_facts)) with C(architecture), C(tokenizer), C(plan).
    type: dict
    required: true
  model_path:
    description: Target model directory on this host (its C(config.json) and safetensors index are read).
    type: path
    required: true
  require_model:
    description: Fail when the target directory cannot be read (off in check mode for a host not yet set up).
    type: bool
    default: true
  num_draft_layers:
    description: Draft layers; null takes the plan's value, else SpecForge's default.
    type: int
  block_size:
    description: Tokens drafted per block; null takes the plan's value, else 16.
    type: int
  target_layer_ids:
    description: Target layers feeding the drafter; null spreads them as SpecForge does.
    type: list
    elements: int
  mask_token_id:
    description: Mask token id; null takes the plan's or the tokenizer facts' candidate.
    type: int
  head_dim:
    description: Draft attention head width; null derives it from the target.
    type: int
  num_key_value_heads:
    description: Draft KV heads; null derives it from the target (at most 8).
    type: int
  hidden_states:
    description: C(offline) capture to disk, C(online) streaming, or C(auto) (offline when it fits the disk).
    type: str
    choices: [auto, offline, online]
    default: auto
  hidden_states_dir:
    description: Where offline features go; the free space of the disk holding it is measured.
    type: path
    required: true
  max_fill:
    description:
      - Largest fraction of the free space offline features may take (features already captured for this
        data count as free).
    type: float
    default: 0.85
  hidden_states_max_bytes:
    description:
      - At most this many bytes of features on disk (null - only O(max_fill) of the free space); the disk
        budget of offline capture and of each rolling shard.
    type: int
  samples:
    description: Training samples (after SpecForge's filters).
    type: int
    default: 0
  tokens:
    description: Tokens in those samples.
    type: int
    default: 0
  data_fingerprint:
    description: Digest of those samples (regen.training.capture --count-only); features are kept per data.
    type: str
    default: ""
  batch_size:
    description: Per-rank batch size.
    type: int
    default: 1
  accumulation_steps:
    description: Gradient accumulation steps.
    type: int
    default: 1
  epochs:
    description: Epochs over the data.
    type: int
    default: 1
  max_steps:
    description: Stop after this many optimizer steps (null runs the epochs).
    type: int
  hosts:
    description: The training hosts in inventory order (node ranks follow it).
    type: list
    elements: str
    required: true
  host:
    description: This host's inventory name.
    type: str
    required: true
  gpus_per_host:
    description: Trainer processes per host (GPUs; 1 on a CPU host).
    type: int
    default: 1
  master_port:
    description: Rendezvous port of node rank 0.
    type: int
    default: 29500
  recipe:
    description:
      - SpecForge C(training.*) settings (learning rate, schedule, intervals, ...); None values are left to
        SpecForge's defaults. Part of the run id.
    type: dict
    default: {}
  work_dir:
    description: Host directory of the drafter stage; runs live in C(work_dir/runs/<run id>).
    type: path
    required: true
  max_length:
    description: Longest sample in tokens.
    type: int
    default: 2048
  chat_template:
    description: SpecForge chat template name (null picks the model family's).
    type: str
  embedding_key:
    description: Target embedding tensor name (null finds it in the checkpoint).
    type: str
  lm_head_key:
    description: Target LM-head tensor name (null finds it in the checkpoint).
    type: str
  master_addr:
    description: Address of node rank 0 for multi-node runs.
    type: str
    default: 127.0.0.1
  report_to:
    description: SpecForge tracking backend.
    type: str
    default: none
  dataloader_num_workers:
    description: SpecForge feature-loader workers (null keeps SpecForge's default).
    type: int
  online:
    description:
      - Online mode settings. C(manage) true (the default) plans the stack the train stage starts itself
        (module_utils/regen_disagg.py) from C(bind_address), C(rpc_port), C(metadata_port) (the Mooncake
        master on the first training host), C(protocol), C(capture_port), C(segment_bytes),
        C(local_buffer_bytes), C(transfer_ports) (first and last port of Mooncake's transfer engine
        listeners) and C(addresses) (inventory host to address, for capture hosts other than
        the training host). C(manage) false takes external services from C(server_urls) and C(mooncake)
        (C(master_server_addr), C(metadata_server), C(local_hostname), C(protocol)).
      - Either way the control and consumer-state directories are per attempt, under
        C(<run dir>/online/attempt-<n>); a new attempt follows one that ended without success.
    type: dict
    default: {}
  extra_config:
    description: Merged into the SpecForge run config section by section.
    type: dict
    default: {}
  run_prefix:
    description: Prefix of the run id.
    type: str
    default: dflash
  training_topology:
    description:
      - Where hidden states come from and where the drafter trains (module_utils/regen_training_topology.py);
        C(auto) plans offline when the features fit the disk budget, else online when a capture server fits
        beside the trainer, else rolling offline; null follows O(hidden_states).
    type: str
    choices: [auto, offline, online, rolling]
  capture_hosts:
    description:
      - Hosts that may run a capture server (group C(regen_capture), else C(regen_serve)); each is taken to
        have the GPUs the facts describe (C(environment.gpu)).
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Plan the drafter
  drafter_plan_info:
    facts: "{{ regen_model_facts }}"
    model_path: /root/models/Kimi-K2.6
    hidden_states_dir: /root/regen/drafter/hidden_states
    samples: 20000
    tokens: 41000000
    hosts: "{{ groups['regen_train'] }}"
    host: "{{ inventory_hostname }}"
    gpus_per_host: 8
  register: _plan
"""

RETURN = r"""
nccl:
  description:
    - The NCCL settings for the trainer's ranks on this host (C(regen_gpu.nccl_decision)). The provision-time
      P2P measurement decides; without one, PCIe-only sm_120 hosts get C(NCCL_P2P_DISABLE=1) and others none.
    - C(env), C(reason), and C(env_args) (C(--env NAME=VALUE) pairs for C(regen.training.launcher)). Each
      managed capture server's C(online.capture_servers[].environment) carries the same decision for
      its ranks.
  returned: always
  type: dict
draft_config:
  description: The drafter's config.json (SpecForge DFlashDraftModel, Qwen3 layers).
  returned: success
  type: dict
reasons:
  description: One line per derived value saying where it came from.
  returned: success
  type: dict
hidden_states:
  description: Capture mode, bytes per token, bytes on disk, free bytes, the arithmetic as a sentence.
  returned: success
  type: dict
  sample: {mode: offline, bytes_per_token: 71680, arithmetic: "5 layers x 7168 hidden x 2 B ..."}
total_steps:
  description: Optimizer steps of the run (null when there is no data yet).
  returned: success
  type: int
topology:
  description: nnodes, node_rank, nproc_per_node, master_host, master_port.
  returned: success
  type: dict
world_size:
  description: Trainer processes over all hosts.
  returned: success
  type: int
embedding_key:
  description: The target's input-embedding tensor name.
  returned: success
  type: str
  sample: language_model.model.embed_tokens.weight
lm_head_key:
  description: The target's LM-head tensor name.
  returned: success
  type: str
chat_template:
  description: SpecForge's chat template name for the model family.
  returned: success
  type: str
run_id:
  description: Identity of this recipe (prefix + digest of the draft config, data size and recipe).
  returned: success
  type: str
sglang_args:
  description: SGLang flags that add the trained drafter (its export directory).
  returned: success
  type: list
paths:
  description:
    - run_dir, draft_config, run_config, output_dir, hidden_states (C(rolling-<id>) for a rolling run),
      rolling_ledger, prompts, export, status, log.
  returned: success
  type: dict
run_config:
  description: The SpecForge run config (C(specforge train --config)) as a dict.
  returned: success
  type: dict
training_topology:
  description:
    - C(mode) (offline, online or rolling), C(reason), C(arithmetic) (lines an operator can check),
      C(rounds) and C(shard_samples) (rolling, an estimate), C(capture_servers), C(trainer_gpus) and
      C(trainer_gpu_ids) (online), C(trainer_gpu_bytes), C(disk_budget_bytes).
  returned: success
  type: dict
online:
  description:
    - The online stack, empty unless the hidden states stream. C(manage), C(attempt), C(attempt_reason),
      C(paths) (attempt directory, control and consumer-state directories), C(server_urls),
      C(mooncake) (endpoints), C(capture_servers) (host, url, gpu_ids and the C(MOONCAKE_*) and
      C(MC_*_RPC_PORT) C(environment) of each),
      C(layers), C(context_length), C(sglang_args) (the capture flags of the patched SGLang),
      C(runtime) (SpecForge's flow-control watermarks) with its C(runtime_arithmetic), and
      C(trainer_gpu_ids) of this host, C(transfer_env_args) (the launcher's C(--env) arguments that put
      the producer's and consumer's transfer engine on the same port range).
  returned: success
  type: dict
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_disagg import (
    DisaggPlanError,
    attempt_numbers,
    attempt_paths,
    capture_context_length,
    capture_environment,
    capture_urls,
    check_reachable,
    choose_attempt,
    mooncake_endpoints,
    online_total_steps,
    runtime_watermarks,
    sglang_capture_args,
    transfer_environment,
)
from ansible.module_utils.regen_drafter import (
    DrafterPlanError,
    config_digest,
    draft_config,
    embedding_and_head_keys,
    plan_hidden_states,
    sglang_dflash_args,
    specforge_chat_template,
    specforge_run_config,
    total_steps,
    trainer_topology,
    weight_keys,
)
from ansible.module_utils.regen_gpu import nccl_decision
from ansible.module_utils.regen_plan import nested
from ansible.module_utils.regen_training_topology import TopologyError, layout_refusal, plan_topology


def _free_bytes(path):
    """Free bytes on the filesystem that holds `path` (its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    stat = os.statvfs(probe)
    return stat.f_bavail * stat.f_frsize


def _attempt(module, run_dir, status_path):
    """This launch's attempt number and why (regen_disagg.choose_attempt), from what is on disk."""
    online_dir = os.path.join(run_dir, "online")
    existing = attempt_numbers(os.listdir(online_dir)) if os.path.isdir(online_dir) else []
    last_used = bool(existing) and os.path.exists(attempt_paths(run_dir, max(existing))["claim"])
    try:
        with open(status_path, encoding="utf-8") as handle:
            status = json.load(handle)
    except (OSError, ValueError):
        status = {}
    state = status.get("state")
    alive = False
    if state in ("starting", "running"):
        if status.get("mode") == "systemd" and status.get("unit"):
            rc, _, _ = module.run_command(["systemctl", "is-active", "--quiet", status["unit"]])
            alive = rc == 0
        elif status.get("pid"):
            try:
                os.kill(int(status["pid"]), 0)
                alive = True
            except (OSError, ValueError):
                alive = False
    return choose_attempt(existing, last_used, state, alive)


def _online_stack(module, p, placement, states, config, run_dir, status_path, quantum):
    """The online block of the result and the run config's online settings (module_utils/regen_disagg)."""
    given = dict(p["online"])
    # A free-form dict: a templated boolean may arrive as a string.
    manage = str(given.get("manage", True)).lower() in ("true", "yes", "on", "1")
    manage = manage and not given.get("server_urls")
    attempt, reason = _attempt(module, run_dir, status_path)
    paths = attempt_paths(run_dir, attempt)
    layers = config["dflash_config"]["target_layer_ids"]
    servers = placement.get("capture_servers") or []
    bind = given.get("bind_address") or "127.0.0.1"
    addresses = {}
    if manage:
        check_reachable(p["hosts"], [s["host"] for s in servers], bind)
        addresses.update(given.get("addresses") or {})
        for server in servers:
            if len(set(p["hosts"]) | {server["host"]}) == 1:
                addresses[server["host"]] = bind  # the trainer's own host: the stack's bind address
        endpoints = mooncake_endpoints(
            bind,
            given.get("rpc_port", 50051),
            given.get("metadata_port", 8080),
            given.get("protocol") or "tcp",
        )
        urls = capture_urls(servers, addresses, given.get("capture_port", 30200))
    else:
        endpoints = dict(given.get("mooncake") or {})
        urls = list(given.get("server_urls") or [])
    # Every Mooncake client of the run (capture servers, producer, consumer) on the same named port range.
    transfer = transfer_environment(given.get("transfer_ports"))
    segment = int(given.get("segment_bytes") or 1 << 30)
    runtime, arithmetic = runtime_watermarks(
        segment, max(1, len(urls)), p["max_length"], states["bytes_per_token"], quantum
    )
    gpu_ids = (placement.get("trainer_gpu_ids") or {}).get(p["host"])
    block = {
        "manage": manage,
        "attempt": attempt,
        "attempt_reason": reason,
        "paths": paths,
        "server_urls": urls,
        "mooncake": endpoints,
        # Each managed server's MOONCAKE_* environment: its segment is on its own host's address.
        "capture_servers": (
            [
                dict(
                    server,
                    url=url,
                    # The NCCL decision for its TP/EP ranks (regen_gpu.nccl_decision), then MOONCAKE_*.
                    environment=dict(
                        nccl_decision(nested(p["facts"], "environment", "gpu"),
                                      len(server.get("gpu_ids") or []), "the capture server's ranks")[0],
                        **capture_environment(
                            endpoints,
                            segment,
                            int(given.get("local_buffer_bytes") or 64 << 20),
                            addresses.get(server["host"], bind),
                        ),
                        **transfer,
                    ),
                )
                for server, url in zip(servers, urls, strict=True)
            ]
            if manage
            else [{"host": None, "url": url, "gpu_ids": [], "environment": {}} for url in urls]
        ),
        "layers": layers,
        "context_length": capture_context_length(p["max_length"]),
        "sglang_args": sglang_capture_args(layers, p["max_length"]),
        "runtime": runtime,
        "runtime_arithmetic": arithmetic,
        "trainer_gpu_ids": gpu_ids if gpu_ids else [],
        # The producer's and the consumer's transfer engine: the same port range as the capture servers',
        # as the launcher's --env arguments.
        "transfer_env_args": [
            arg for name, value in transfer.items() for arg in ("--env", f"{name}={value}")
        ],
        # What `regen.training.disagg preflight` (before the launch) and `health` (after a failed run) probe.
        "probe_args": [f"--url={url}" for url in urls] + _mooncake_probe_args(endpoints),
    }
    settings = {
        "server_urls": urls,
        "mooncake": endpoints,
        "control_dir": paths["control_dir"],
        "consumer_state_dir": paths["consumer_state_dir"],
    }
    return block, settings


def _mooncake_probe_args(endpoints):
    if not endpoints.get("master_server_addr"):
        return []
    master, metadata = endpoints["master_server_addr"], endpoints["metadata_server"]
    return ["--mooncake-master", master, "--mooncake-metadata", metadata]


def _held_bytes(path):
    """Bytes the files directly in `path` take on disk (0 when it does not exist)."""
    try:
        with os.scandir(path) as entries:
            return sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in entries if e.is_file())
    except OSError:
        return 0


def _training_topology(p, states, config, world, steps):
    """Offline, online or rolling (regen_training_topology.plan_topology) from the inventory and the facts."""
    requested = p["training_topology"] or p["hidden_states"]
    if requested in ("online", "auto") and (p["online"] or {}).get("server_urls"):
        return {
            "mode": "online",
            "reason": "online: capture servers given in inventory (drafter_training_online_server_urls)",
            "arithmetic": [states["arithmetic"]],
        }
    gpu = nested(p["facts"], "environment", "gpu") or {}
    count = int(gpu.get("count") or 0)
    memory = gpu.get("memory_per_gpu_bytes")
    serving = nested(p["facts"], "plan_values", "serving") or {}
    need = None
    if count:
        need = int(serving.get("tp_size") or 1) * int(serving.get("pp_size") or 1)
    return plan_topology(
        requested,
        states["required_bytes"],
        states["budget_bytes"],
        p["samples"],
        capture_gpus_needed=need,
        capture_hosts=[{"name": h, "gpus": count, "gpu_memory_bytes": memory} for h in p["capture_hosts"]],
        train_hosts=[
            {"name": h, "gpus": p["gpus_per_host"] if count else 0, "gpu_memory_bytes": memory}
            for h in p["hosts"]
        ],
        draft_config=config,
        max_length=p["max_length"],
        batch_size=p["batch_size"],
        samples_per_step=p["batch_size"] * p["accumulation_steps"] * world,
        total_steps=steps,
    )


def _read_target(module, model_path, require):
    config_path = os.path.join(model_path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
        keys = weight_keys(model_path)
    except (OSError, ValueError) as exc:
        if require:
            module.fail_json(
                msg=f"cannot read the target model at {model_path}: {exc}; check drafter_training_model_path"
            )
        module.warn(f"target model {model_path} not readable here ({exc}): planning from the facts alone")
        return None, []
    return config, keys


def main():
    module = AnsibleModule(
        argument_spec=dict(
            facts=dict(type="dict", required=True),
            model_path=dict(type="path", required=True),
            require_model=dict(type="bool", default=True),
            num_draft_layers=dict(type="int"),
            block_size=dict(type="int"),
            target_layer_ids=dict(type="list", elements="int"),
            mask_token_id=dict(type="int"),
            head_dim=dict(type="int"),
            num_key_value_heads=dict(type="int"),
            hidden_states=dict(type="str", default="auto", choices=["auto", "offline", "online"]),
            hidden_states_dir=dict(type="path", required=True),
            max_fill=dict(type="float", default=0.85),
            hidden_states_max_bytes=dict(type="int"),
            samples=dict(type="int", default=0),
            tokens=dict(type="int", default=0),
            data_fingerprint=dict(type="str", default=""),
            batch_size=dict(type="int", default=1),
            accumulation_steps=dict(type="int", default=1),
            epochs=dict(type="int", default=1),
            max_steps=dict(type="int"),
            hosts=dict(type="list", elements="str", required=True),
            host=dict(type="str", required=True),
            gpus_per_host=dict(type="int", default=1),
            master_port=dict(type="int", default=29500),
            recipe=dict(type="dict", default={}),
            run_prefix=dict(type="str", default="dflash"),
            work_dir=dict(type="path", required=True),
            max_length=dict(type="int", default=2048),
            chat_template=dict(type="str"),
            embedding_key=dict(type="str", no_log=False),
            lm_head_key=dict(type="str", no_log=False),
            master_addr=dict(type="str", default="127.0.0.1"),
            report_to=dict(type="str", default="none"),
            dataloader_num_workers=dict(type="int"),
            online=dict(type="dict", default={}),
            extra_config=dict(type="dict", default={}),
            training_topology=dict(type="str", choices=["auto", "offline", "online", "rolling"]),
            capture_hosts=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    p = module.params
    target, keys = _read_target(module, p["model_path"], p["require_model"])
    try:
        config, reasons, warnings = draft_config(
            p["facts"],
            target,
            num_draft_layers=p["num_draft_layers"],
            block_size=p["block_size"],
            target_layer_ids=p["target_layer_ids"],
            mask_token_id=p["mask_token_id"],
            head_dim=p["head_dim"],
            num_key_value_heads=p["num_key_value_heads"],
        )
        ids = config["dflash_config"]["target_layer_ids"]
        # Features are captured once per (model, layers, dtype, length, data) into layers-<capture id>; a
        # rolling run keeps its shard in rolling-<capture id>. What they already hold counts as free: the
        # budget is the disk the features may take, and features on disk are part of it.
        capture_id = config_digest(
            {
                "model": os.path.abspath(p["model_path"]),
                "layers": ids,
                "dtype": "bfloat16",
                "max_length": p["max_length"],
                "data": p["data_fingerprint"],
            }
        )[:12]
        feature_dirs = {
            mode: os.path.join(p["hidden_states_dir"], prefix + capture_id)
            for mode, prefix in (("offline", "layers-"), ("rolling", "rolling-"))
        }
        free = _free_bytes(p["hidden_states_dir"])
        if free is not None:
            free += sum(_held_bytes(path) for path in feature_dirs.values())
        states = plan_hidden_states(
            p["hidden_states"],
            p["tokens"],
            config["hidden_size"],
            len(ids),
            free,
            max_fill=p["max_fill"],
            max_bytes=p["hidden_states_max_bytes"],
        )
        topology = trainer_topology(p["hosts"], p["host"], p["gpus_per_host"], p["master_port"])
        world = topology["nnodes"] * topology["nproc_per_node"]
        steps = None
        if p["samples"]:
            steps = total_steps(
                p["samples"], p["batch_size"], world, p["accumulation_steps"], p["epochs"], p["max_steps"]
            )
        placement = _training_topology(p, states, config, world, steps)
        if placement["mode"] in ("offline", "rolling") and states["mode"] != "offline":
            # The topology keeps the features on disk after all (rolling: a shard at a time); the hidden-state
            # plan's "online streaming chosen" warning no longer applies.
            states = dict(states, mode="offline", reason=placement["reason"], warnings=[])
        elif placement["mode"] == "online":
            states = dict(states, mode="online", reason=placement["reason"])
            trainer_ids = (placement.get("trainer_gpu_ids") or {}).get(p["host"])
            if trainer_ids:
                # A capture server on this host holds its first GPUs: the trainer ranks get the others.
                topology = trainer_topology(p["hosts"], p["host"], len(trainer_ids), p["master_port"])
                world = topology["nnodes"] * topology["nproc_per_node"]
            if p["samples"]:
                # Only whole global optimizer windows are dispatched online.
                steps = online_total_steps(
                    p["samples"], p["epochs"], world, p["batch_size"], p["accumulation_steps"], p["max_steps"]
                )
        if placement["mode"] == "rolling" and topology["nnodes"] > 1:
            raise layout_refusal(
                "rolling offline trains on one host, whose GPUs take turns between the target and the "
                f"trainer; regen_train has {topology['nnodes']} hosts ({', '.join(p['hosts'])})"
            )
        if placement["mode"] == "online" and topology["nnodes"] > 1:
            # SpecForge's supervisor runs the producer and the consumer ranks as one process tree on one
            # host; torchrun across hosts under it is not wired (the train stage refuses it too).
            raise layout_refusal(
                "online training runs SpecForge's producer and every trainer rank on one host; regen_train "
                f"has {topology['nnodes']} hosts ({', '.join(p['hosts'])})"
            )
    except (DrafterPlanError, TopologyError, DisaggPlanError) as exc:
        module.fail_json(msg=str(exc))
    rolling = placement["mode"] == "rolling"
    found_embedding, found_head = embedding_and_head_keys(keys)
    embedding_key = p["embedding_key"] or found_embedding
    lm_head_key = p["lm_head_key"] or found_head
    if keys and not (embedding_key and lm_head_key):
        module.fail_json(
            msg="the target checkpoint at {} has no embed_tokens/lm_head tensors SpecForge could "
            "load; set drafter_training_embedding_key and drafter_training_lm_head_key".format(
                p["model_path"]
            )
        )
    embedding_key = embedding_key or "model.embed_tokens.weight"
    lm_head_key = lm_head_key or "lm_head.weight"
    for warning in warnings + states["warnings"]:
        module.warn(warning)
    recipe = {k: v for k, v in p["recipe"].items() if v is not None}
    identity = {
        "draft_config": config,
        "data": p["data_fingerprint"],
        "samples": p["samples"],
        "tokens": p["tokens"],
        "hidden_states": states["mode"],
        "world_size": world,
        "recipe": recipe,
        "max_length": p["max_length"],
        "extra": p["extra_config"],
        "keys": [embedding_key, lm_head_key],
    }
    if rolling:
        # Another feature directory and a fixed step horizon in the run config: another run. (Only added
        # here, so the ids of offline and online runs stay what they were.)
        identity["topology"] = "rolling"
    run_id = "{}-{}".format(p["run_prefix"], config_digest(identity)[:12])
    run_dir = os.path.join(p["work_dir"], "runs", run_id)
    paths = {
        "run_dir": run_dir,
        "draft_dir": os.path.join(run_dir, "draft"),
        "draft_config": os.path.join(run_dir, "draft", "config.json"),
        "run_config": os.path.join(run_dir, "run.yaml"),
        "plan": os.path.join(run_dir, "plan.json"),
        "output_dir": os.path.join(run_dir, "checkpoints"),
        "hidden_states": feature_dirs["rolling" if rolling else "offline"],
        "rolling_ledger": os.path.join(run_dir, "rolling", "ledger.json"),
        "prompts": os.path.join(run_dir, "prompts.jsonl"),
        "export": os.path.join(run_dir, "export"),
        "status": os.path.join(run_dir, "status.json"),
        "log": os.path.join(run_dir, "train.log"),
        "cache": os.path.join(p["work_dir"], "cache"),
    }
    chat_template = p["chat_template"] or specforge_chat_template(p["facts"].get("architecture"))
    online = dict(p["online"])
    online_block = {}
    extra = p["extra_config"]
    if states["mode"] == "online":
        quantum = world * p["batch_size"] * p["accumulation_steps"]
        try:
            online_block, online = _online_stack(
                module, p, placement, states, config, run_dir, paths["status"], quantum
            )
        except DisaggPlanError as exc:
            module.fail_json(msg=str(exc), training_topology=placement)
        paths["online"] = online_block["paths"]["dir"]
        # SpecForge's flow control, under what the inventory merges in.
        extra = dict(extra, runtime=dict(online_block["runtime"], **(extra.get("runtime") or {})))
    try:
        run_config = specforge_run_config(
            model_path=p["model_path"],
            draft_config_path=paths["draft_config"],
            embedding_key=embedding_key,
            lm_head_key=lm_head_key,
            mask_token_id=config["dflash_config"]["mask_token_id"],
            mode=states["mode"],
            run_id=run_id,
            output_dir=paths["output_dir"],
            cache_dir=paths["cache"],
            topology=topology,
            master_addr=p["master_addr"],
            hidden_states_path=paths["hidden_states"],
            prompts_path=paths["prompts"],
            max_length=p["max_length"],
            chat_template=chat_template,
            training=dict(
                recipe,
                num_epochs=p["epochs"],
                batch_size=p["batch_size"],
                accumulation_steps=p["accumulation_steps"],
                max_steps=p["max_steps"],
                # Rolling: the horizon of the whole run (SpecForge's LR schedule and the step count its
                # resume checks), so each round's `training.max_steps=<its last step>` is only a stop.
                total_steps=steps if rolling else None,
            ),
            report_to=p["report_to"],
            dataloader_num_workers=p["dataloader_num_workers"],
            online=online,
            extra=extra,
        )
    except DrafterPlanError as exc:
        if not module.check_mode:
            module.fail_json(msg=str(exc))
        module.warn(str(exc))
        run_config = {}
    try:
        sglang_args = sglang_dflash_args(
            paths["export"], config["block_size"], nested(p["facts"], "plan_values", "serving")
        )
    except DrafterPlanError as exc:
        module.fail_json(msg=str(exc))
    # The NCCL decision for the trainer's ranks on this host (the same function the serving and capture
    # launches use); the launch passes `nccl.env_args` to the launcher as --env NAME=VALUE.
    trainer_env, trainer_reason, _source = nccl_decision(
        nested(p["facts"], "environment", "gpu"), (topology or {}).get("nproc_per_node") or 1,
        "the FSDP trainer's ranks")
    nccl = {"env": trainer_env, "reason": trainer_reason,
            "env_args": [a for k, v in sorted(trainer_env.items()) for a in ("--env", f"{k}={v}")]}
    module.exit_json(
        changed=False,
        nccl=nccl,
        draft_config=config,
        reasons=reasons,
        hidden_states=states,
        total_steps=steps,
        topology=topology,
        world_size=world,
        embedding_key=embedding_key,
        lm_head_key=lm_head_key,
        chat_template=chat_template,
        run_id=run_id,
        paths=paths,
        run_config=run_config,
        sglang_args=sglang_args,
        training_topology=placement,
        online=online_block,
    )


if __name__ == "__main__":
    main()
