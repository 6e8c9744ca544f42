"""Where the drafter's hidden states come from and where it trains: offline, online, rolling, or a refusal.

Standard library only, pure functions (the drafter planning module runs them on the host; the unit tests
call them directly). Every choice carries its arithmetic, so an operator can check it by hand:

- **offline**: capture every sample's hidden states to disk once, then train on them (SpecForge's
  `local_colocated`). Chosen when the features fit the disk budget.
- **online** (SpecForge 0.2.0's `deployment.mode: disaggregated`): a capture server runs the target in
  SGLang with SpecForge's spec-capture patch and the trainer ranks consume its hidden states over Mooncake,
  so nothing is written to disk. Needs GPUs for both at once: a capture server's GPUs (the serving plan's
  layout for the target) and trainer GPUs that are not those. On a shared host the capture server takes
  the first GPUs and the trainer the rest (SpecForge's one-server + DP7 layout on 8 GPUs). On hosts without
  GPUs (the CPU demo) the capture server is regen's transformers one on the first training host, beside
  the trainer.
- **rolling** offline: one host whose GPUs cannot hold the target and the trainer at the same time (CT200:
  the target needs all eight). Serve the target, capture one shard that fits the disk budget, stop it,
  train on the shard (resuming the same run), delete the shard, repeat until the data is used. A shard
  holds whole optimizer steps; the plan's `rounds` is an estimate from the mean sample size, and the
  role's executor (`regen.training.rolling`) partitions the steps by each sample's own size.
- a **refusal** that states the numbers when not even that fits.

The trainer's memory per GPU follows SpecForge's FSDP ``SHARD_GRAD_OP`` on GPUs: bf16 parameters on every
rank, gradients and AdamW state (fp32 master copy, two moments) sharded over the ranks; the target's
embedding and LM head (frozen, bf16) on every rank; activations from the length budget.
"""

from __future__ import annotations

import math

from .regen_drafter import FEATURE_FILE_OVERHEAD_BYTES

TOPOLOGY_MODES = ("auto", "offline", "online", "rolling")
GIB = 1024**3
# Bytes per trainable parameter: bf16 weights (2) on every rank; bf16 gradients (2) and AdamW's fp32
# master copy and two moments (12) sharded over the ranks.
PARAM_BYTES_REPLICATED = 2
PARAM_BYTES_SHARDED = 14
# Activations of one transformer layer per token, in bytes (bf16, no recomputation, fused attention):
# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 34·s·b·h.
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
# Loss over the vocabulary in fp32, logits and their gradient.
LOGIT_BYTES_PER_TOKEN_VOCAB = 8
# Room the CUDA context, NCCL buffers and the allocator's fragmentation need on a trainer GPU.
TRAINER_GPU_HEADROOM = 0.1


class TopologyError(ValueError):
    """Inputs that cannot be planned; the message says which and how to fix it."""


# The layouts across hosts the train stage runs (docs/multi-host.md); every refusal of another names them.
SUPPORTED_MULTI_HOST_LAYOUTS = (
    "every group on one host (offline, online or rolling)",
    "serving and generation on different hosts (the completions job sends regen_api_key)",
    "offline across the hosts of regen_train (torchrun, node ranks in inventory order, the rendezvous "
    "store on the first; node rank 0 captures the features into a drafter_training_hidden_states_dir "
    "every training host shares)",
    "online with SpecForge's producer and every trainer rank on one host of regen_train, the capture "
    "server on that host, or on other hosts started by you (role capture_server, playbooks/mooncake.yml) "
    "and named in drafter_training_online_server_urls and drafter_training_online_mooncake",
    "rolling on one host (limit the play to it)",
)


def layout_refusal(what):
    """A TopologyError for a layout the train stage does not run, naming the ones it does."""
    layouts = "; ".join(f"({n}) {layout}" for n, layout in enumerate(SUPPORTED_MULTI_HOST_LAYOUTS, 1))
    return TopologyError(f"{what}. Supported layouts across hosts: {layouts} (docs/multi-host.md)")


def _gib(value):
    return "%.1f GiB" % (float(value) / GIB)


def draft_parameters(config):
    """Trainable parameters of a DFlash draft model from its config.json (SpecForge's Qwen3 layers, the
    `fc` that mixes the target layers' hidden states, three RMSNorms); the target's embedding and LM head
    are frozen and counted apart (`frozen`)."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        targets = len((config.get("dflash_config") or {}).get("target_layer_ids") or []) or layers
    except (KeyError, TypeError, ValueError) as exc:
        raise TopologyError(
            f"the draft config lacks {exc}; plan the drafter first (drafter_plan_info)"
        ) from None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    trainable = layers * per_layer + targets * hidden * hidden + 2 * hidden
    return {"trainable": trainable, "frozen": 2 * vocab * hidden, "per_layer": per_layer, "layers": layers}


def trainer_gpu_bytes(config, max_length, batch_size=1, world_size=1):
    """Bytes one trainer GPU needs, and the arithmetic."""
    params = draft_parameters(config)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    world = max(1, int(world_size))
    tokens = int(max_length) * max(1, int(batch_size))
    weights = params["trainable"] * PARAM_BYTES_REPLICATED
    sharded = params["trainable"] * PARAM_BYTES_SHARDED / world
    frozen = params["frozen"] * 2
    activations = tokens * hidden * params["layers"] * ACTIVATION_BYTES_PER_TOKEN_HIDDEN
    logits = tokens * vocab * LOGIT_BYTES_PER_TOKEN_VOCAB
    total = int(weights + sharded + frozen + activations + logits)
    arithmetic = (
        f"{params['trainable'] / 1e9:.2f}B trainable params x (2 B + 14 B / {world} ranks) = "
        f"{_gib(weights + sharded)}; frozen embedding + LM head {_gib(frozen)}; activations "
        f"{tokens} tokens x {hidden} x {params['layers']} layers x 34 B = {_gib(activations)}; logits "
        f"{tokens} x {vocab} x 8 B = {_gib(logits)}: {_gib(total)} per trainer GPU"
    )
    return total, arithmetic


def _fits_trainer(need, gpu_bytes):
    return gpu_bytes is not None and need <= gpu_bytes * (1 - TRAINER_GPU_HEADROOM)


def plan_topology(
    requested,
    offline_bytes,
    disk_budget_bytes,
    samples,
    capture_gpus_needed,
    capture_hosts,
    train_hosts,
    draft_config,
    max_length,
    batch_size=1,
    samples_per_step=1,
    total_steps=None,
):
    """The training topology: {mode, reason, arithmetic, disk_budget_bytes, ...} (see the module's docstring).

    `offline_bytes`: the whole data set's hidden states on disk; `disk_budget_bytes`: what they may take
    (free space x the fill limit, or a cap); `capture_gpus_needed`: GPUs one target instance needs (the
    serving plan's tp x pp); hosts: [{"name", "gpus", "gpu_memory_bytes"}] of the capture group and of
    regen_train (a host may be in both). `samples_per_step` (batch x accumulation x trainer ranks) and
    `total_steps` size the rolling shards in whole optimizer steps over the run's epochs.
    """
    if requested not in TOPOLOGY_MODES:
        raise TopologyError(
            f"drafter_training_topology={requested!r}; choose one of {', '.join(TOPOLOGY_MODES)}"
        )
    samples = max(0, int(samples or 0))
    offline_bytes = max(0, int(offline_bytes or 0))
    budget = None if disk_budget_bytes is None else max(0, int(disk_budget_bytes))
    per_sample = offline_bytes / samples if samples else 0
    lines = [
        f"offline hidden states: {_gib(offline_bytes)} for {samples} samples "
        f"({_gib(per_sample)} each); disk budget {'unknown' if budget is None else _gib(budget)}"
    ]
    fits_disk = budget is None or offline_bytes <= budget
    train_names = [h["name"] for h in train_hosts]
    trainer_gpus = sum(int(h.get("gpus") or 0) for h in train_hosts) or 1
    gpu_memory = min(
        (h.get("gpu_memory_bytes") for h in train_hosts if h.get("gpu_memory_bytes")), default=None
    )

    # Online: a capture server on GPUs the trainer ranks do not use.
    need = capture_gpus_needed
    capture_free = []
    for host in capture_hosts:
        gpus = int(host.get("gpus") or 0)
        if host["name"] in train_names:
            # Shared host: the trainer keeps what the capture server leaves.
            if need and gpus > need:
                capture_free.append((host["name"], need, gpus - need))
        elif need and gpus >= need:
            capture_free.append((host["name"], need, 0))
    online_trainer_gpus = sum(
        int(h.get("gpus") or 0) for h in train_hosts if h["name"] not in [c[0] for c in capture_free]
    ) + sum(left for _, _, left in capture_free)
    online_need, online_math = (None, None)
    if capture_free and online_trainer_gpus:
        online_need, online_math = trainer_gpu_bytes(
            draft_config, max_length, batch_size, online_trainer_gpus
        )
    online_ok = bool(capture_free) and online_trainer_gpus > 0 and _fits_trainer(online_need, gpu_memory)

    single_need, single_math = trainer_gpu_bytes(draft_config, max_length, batch_size, trainer_gpus)
    target_fits_a_host = bool(need) and any(
        int(h.get("gpus") or 0) >= need for h in capture_hosts + train_hosts
    )

    def offline_plan(reason):
        return {
            "mode": "offline",
            "reason": reason,
            "arithmetic": [*lines, single_math],
            "rounds": 1,
            "shard_samples": samples,
            "trainer_gpu_bytes": single_need,
            "disk_budget_bytes": budget,
        }

    def online_plan(reason):
        # The capture server takes a host's first GPUs; a training host it shares keeps the rest.
        servers = [
            {"host": name, "gpus": gpus, "gpu_ids": list(range(gpus))} for name, gpus, _ in capture_free
        ]
        taken = {name: gpus for name, gpus, _ in capture_free}
        trainer_ids = {
            h["name"]: list(range(taken.get(h["name"], 0), int(h.get("gpus") or 0))) for h in train_hosts
        }
        return {
            "mode": "online",
            "reason": reason,
            "arithmetic": [*lines, online_math],
            "capture_servers": servers,
            "trainer_gpus": online_trainer_gpus,
            "trainer_gpu_ids": trainer_ids,
            "trainer_gpu_bytes": online_need,
            "disk_budget_bytes": budget,
        }

    def cpu_online_plan(reason):
        # No GPUs anywhere: one capture server (regen's transformers backend) on the first training host
        # that may capture, else the first capture host; the trainer runs one CPU process per host.
        names = [h["name"] for h in capture_hosts]
        host = next((n for n in train_names if n in names), names[0] if names else train_names[0])
        return {
            "mode": "online",
            "reason": reason,
            "arithmetic": [
                *lines,
                f"no GPUs: the capture server runs the target on {host}'s CPU beside the trainer "
                "(transformers forward), one trainer process per host",
            ],
            "capture_servers": [{"host": host, "gpus": 0, "gpu_ids": []}],
            "trainer_gpus": 0,
            "trainer_gpu_ids": {name: [] for name in train_names},
            "trainer_gpu_bytes": None,
        }

    def rolling_plan(reason):
        per_step = max(1, int(samples_per_step or 1))
        # A feature file: the sample's tensors plus torch.save's container.
        per_file = per_sample + FEATURE_FILE_OVERHEAD_BYTES
        # The samples the run reads in order, over every epoch: total_steps x samples per step.
        stream = int(total_steps) * per_step if total_steps else samples
        fit = int(budget // per_file) if budget is not None else stream
        # A shard holds whole optimizer steps, so each round ends where a checkpoint can.
        shard = max(0, min(stream, fit // per_step * per_step))
        if shard < 1 and stream:
            raise TopologyError(
                f"rolling capture cannot hold even one optimizer step: its {per_step} sample(s) take "
                f"{_gib(per_step * per_file)} against a disk budget of {_gib(budget or 0)}; point "
                "drafter_training_hidden_states_dir at a larger disk, raise "
                "drafter_training_hidden_states_max_bytes, use a smaller batch or shorten the length budget"
            )
        rounds = math.ceil(stream / shard) if stream else 0
        return {
            "mode": "rolling",
            "reason": reason,
            "arithmetic": [
                *lines,
                f"{stream} samples read over the run ({per_step} per optimizer step) in shards of up to "
                f"{shard} ({_gib(shard * per_file)} each): about {rounds} rounds (the executor partitions "
                "the steps by each sample's own size)",
                single_math,
            ],
            "rounds": rounds,
            "shard_samples": shard,
            "trainer_gpu_bytes": single_need,
            "disk_budget_bytes": budget,
        }

    if requested == "offline":
        if not fits_disk:
            raise TopologyError(
                f"offline hidden states need {_gib(offline_bytes)} but the disk budget is {_gib(budget)}: "
                "set drafter_training_topology to auto (online or rolling), free disk, or train on fewer "
                "samples"
            )
        return offline_plan("offline requested in inventory (drafter_training_topology)")
    if requested == "online":
        if not need:
            return cpu_online_plan(
                "online requested in inventory (drafter_training_topology) on hosts without GPUs"
            )
        if not capture_free:
            raise TopologyError(
                f"online capture needs a capture server of {need} GPU(s) on GPUs the trainer does not use; "
                f"the capture hosts {[h['name'] for h in capture_hosts]} have "
                f"{[int(h.get('gpus') or 0) for h in capture_hosts]} GPU(s) and share them with regen_train "
                f"{train_names}: add a capture host (group regen_capture) or set drafter_training_topology: "
                "rolling"
            )
        return online_plan("online requested in inventory (drafter_training_topology)")
    if requested == "rolling":
        return rolling_plan("rolling offline requested in inventory (drafter_training_topology)")

    if fits_disk:
        return offline_plan(
            f"offline: the hidden states ({_gib(offline_bytes)}) fit the disk budget "
            f"({'unknown' if budget is None else _gib(budget)}), so the target runs once and the trainer "
            "reads disk"
        )
    if online_ok:
        where = ", ".join(f"{name} ({gpus} GPUs)" for name, gpus, _ in capture_free)
        return online_plan(
            f"online: the hidden states ({_gib(offline_bytes)}) exceed the disk budget, and a capture server "
            f"fits beside the trainer: {where} serve the target, {online_trainer_gpus} trainer GPU(s) "
            f"need {_gib(online_need)} each"
        )
    if target_fits_a_host and _fits_trainer(single_need, gpu_memory):
        blocked = (
            f"the target needs {need} GPU(s) and the trainer {_gib(single_need)} per GPU, and no host has "
            "GPUs for both at once"
        )
        return rolling_plan(
            f"rolling offline: the hidden states ({_gib(offline_bytes)}) exceed the disk budget "
            f"({_gib(budget)}) and {blocked}: capture a shard, stop the target, train on it, repeat"
        )
    raise TopologyError(
        "no topology fits: the hidden states "
        f"({_gib(offline_bytes)}) exceed the disk budget ({_gib(budget)}); "
        + (
            "the facts show no GPUs, so neither a capture server nor GPUs taking turns are planned (set "
            "drafter_training_topology: rolling to capture and train in shards on this host, or online to "
            "stream them from a capture server on its CPU)"
            if not need
            else f"no capture host has the {need} GPU(s) the target needs"
            if not target_fits_a_host
            else f"a trainer GPU needs {_gib(single_need)} and has {_gib(gpu_memory or 0)}"
        )
        + "; add GPUs or disk, shorten the length budget, or train on fewer samples"
    )
