"""DFlash drafter planning for SpecForge: the draft config, the hidden-state budget, the step horizon.

Standard library only, pure functions: the drafter planning module runs this on the training host, and
the unit tests call it directly.

What follows SpecForge 0.2.0 (the PyPI release regen pins) exactly, because a drafter trained on
different layers than the server feeds it is silently useless:
- the target layers are regen_plan's `dflash_target_layer_ids` (the one copy, which the plan uses too):
  `specforge.modeling.draft.dflash.build_target_layer_ids`;
- the draft config has the shape of SpecForge's `configs/*-dflash.json` (a Qwen3-architecture
  `DFlashDraftModel` with `dflash_config.{target_layer_ids, mask_token_id}`, `block_size`,
  `num_target_layers`, `layer_types`), and copies from the target only the architecture fields that
  SpecForge's own generator whitelists (`_TARGET_ARCHITECTURE_FIELDS` in training/model_loading.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from .regen_config import DTYPE_BYTES
from .regen_estimate import human_bytes
from .regen_families import family_of, text_config
from .regen_plan import (
    dflash_target_layer_ids,
    drafter_depth_and_block,
    nested,
    plan_value,
)

DRAFT_ARCHITECTURE = "DFlashDraftModel"
# The DFlash draft model is itself a Qwen3-architecture model, whatever the target's family.
DRAFT_MODEL_TYPE = "qwen3"
# SpecForge's DFlash loss needs a block of at least two tokens (model_providers._validate_dflash_block_size).
MIN_BLOCK_SIZE = 2
# Real DFlash drafters for 7168-wide MLA targets (SpecForge configs/kimi-k2.7-code-dflash.json) use GQA
# with 8 KV heads; never more than the target has.
DEFAULT_MAX_KV_HEADS = 8
# dtypes hidden states may be captured in (bytes per element from the config reader's table).
HIDDEN_STATE_DTYPES = ("bfloat16", "float16", "float32")
# Every offline feature file also stores input_ids and loss_mask as int64 tensors.
FEATURE_INDEX_BYTES_PER_TOKEN = 16
# What torch.save's container adds to one feature file (measured 2.0-2.2 KiB): the allowance the rolling
# executor counts per file (regen.training.rolling.FILE_OVERHEAD_BYTES; a unit test keeps them equal).
FEATURE_FILE_OVERHEAD_BYTES = 4096
HIDDEN_STATE_MODES = ("auto", "offline", "online")

# SpecForge's template when the family has none registered (the model family's name comes from the
# registry). regen feeds SpecForge pre-tokenized data rendered with the model's own template, so the name
# only matters if a user switches the run to SpecForge's raw-conversation path (data.train_data_path).
DEFAULT_SPECFORGE_CHAT_TEMPLATE = "llama3"

# Target architecture fields SpecForge copies into a generated draft config (its whitelist).
_TARGET_FIELDS = (
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
)


class DrafterPlanError(Exception):
    """Input that cannot make a drafter: the message says what was wrong and how to fix it."""


# --------------------------------------------------------------------------------------------------
# Small readers
# --------------------------------------------------------------------------------------------------


def _int(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _first(*values):
    for value in values:
        if value is not None:
            return value
    return None


# --------------------------------------------------------------------------------------------------
# Target layers
# --------------------------------------------------------------------------------------------------


def check_target_layer_ids(layer_ids, num_target_layers):
    """Layer ids must be distinct, increasing and inside the target; say how to fix them if not."""
    if not isinstance(layer_ids, list) or not layer_ids or any(_int(i) is None for i in layer_ids):
        raise DrafterPlanError(
            f"target_layer_ids must be a non-empty list of integers, got {layer_ids!r}; "
            "set drafter_training_target_layer_ids or leave it null to derive them"
        )
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if i < 0 or i >= num_target_layers]
    if bad:
        raise DrafterPlanError(
            f"target_layer_ids {bad} lie outside the target's {num_target_layers} layers "
            f"(0..{num_target_layers - 1})"
        )
    if ids != sorted(set(ids)):
        raise DrafterPlanError(
            f"target_layer_ids {ids} repeat or go backwards: a {num_target_layers}-layer target cannot feed "
            "that many distinct layers; use fewer draft layers (drafter_training_num_draft_layers) or list "
            "the ids yourself"
        )
    return ids


# --------------------------------------------------------------------------------------------------
# The draft config
# --------------------------------------------------------------------------------------------------


def _rope_fields(text):
    """rope_theta and rope_scaling from either the classic keys or transformers 5's rope_parameters."""
    theta, scaling = text.get("rope_theta"), text.get("rope_scaling")
    params = text.get("rope_parameters")
    if isinstance(params, dict):
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, scaling


def _kv_heads(heads, target_kv_heads, cap):
    """The largest divisor of `heads` that is at most min(target KV heads, cap): GQA must divide evenly."""
    limit = max(1, min(target_kv_heads or heads, cap))
    for candidate in range(limit, 0, -1):
        if heads % candidate == 0:
            return candidate
    return 1


def draft_config(
    facts,
    target_config=None,
    num_draft_layers=None,
    block_size=None,
    target_layer_ids=None,
    mask_token_id=None,
    head_dim=None,
    num_key_value_heads=None,
    intermediate_size=None,
    max_kv_heads=DEFAULT_MAX_KV_HEADS,
    dtype="bfloat16",
):
    """The DFlash drafter's config.json from the model facts (and the target's raw config.json).

    Precedence for every choice: an explicit argument (an inventory variable), then the facts' plan
    (`plan.drafter`), then what the architecture implies, then SpecForge's default. Returns
    `(config, reasons, warnings)`: `reasons` says in one line where each derived value came from.
    """
    if not isinstance(facts, dict) or not isinstance(facts.get("architecture"), dict):
        raise DrafterPlanError(
            "the model facts have no `architecture` object; run the introspect stage first "
            "(ansible-playbook regen.yml --tags introspect) or pass regen_model_facts"
        )
    arch = facts["architecture"]
    plan = {key: plan_value(value) for key, value in (nested(facts, "plan", "drafter") or {}).items()}
    attention = arch.get("attention") if isinstance(arch.get("attention"), dict) else {}
    text = text_config(target_config) if target_config else {}
    reasons, warnings = {}, []

    hidden = _int(_first(arch.get("hidden_size"), text.get("hidden_size")))
    layers = _int(_first(arch.get("num_layers"), text.get("num_hidden_layers")))
    vocab = _int(_first(arch.get("vocab_size"), text.get("vocab_size")))
    missing = [
        name
        for name, value in (("hidden_size", hidden), ("num_layers", layers), ("vocab_size", vocab))
        if value is None or value < 1
    ]
    if missing:
        raise DrafterPlanError(
            "the model facts lack {}; the drafter's shape comes from them (re-run introspect on a model "
            "directory whose config.json has them)".format(", ".join(missing))
        )

    # Layers: explicit ids > explicit count > the plan > SpecForge's default count.
    plan_ids = plan.get("target_layer_ids") if isinstance(plan.get("target_layer_ids"), list) else None
    if target_layer_ids:
        ids = check_target_layer_ids(list(target_layer_ids), layers)
        reasons["target_layer_ids"] = "set in inventory (drafter_training_target_layer_ids)"
        count = _int(num_draft_layers) or len(ids)
        reasons["num_hidden_layers"] = f"{count} draft layers (inventory)"
    else:
        count = _int(num_draft_layers)
        count_source = "inventory (drafter_training_num_draft_layers)"
        if count is None:
            count = _int(
                _first(
                    plan.get("num_draft_layers"), plan.get("num_layers"), len(plan_ids) if plan_ids else None
                )
            )
            count_source = "the facts' plan"
        if count is None:
            # No plan in the facts: the plan's own rule (a published recipe, else SpecForge's default).
            (count, depth_reason), _ = drafter_depth_and_block(arch)
            count_source = f"the plan's rule: {depth_reason}"
        if count < 1:
            raise DrafterPlanError(f"drafter_training_num_draft_layers must be at least 1, got {count!r}")
        if plan_ids and len(plan_ids) == count:
            ids = check_target_layer_ids(list(plan_ids), layers)
            reasons["target_layer_ids"] = "from the facts' plan (plan.drafter.target_layer_ids)"
        else:
            ids = check_target_layer_ids(dflash_target_layer_ids(layers, count), layers)
            reasons["target_layer_ids"] = (
                f"spread over the target's {layers} layers for {count} draft layers as SpecForge does: "
                "round(1 + i*(L-4)/(n-1))"
            )
        reasons["num_hidden_layers"] = f"{count} draft layers from {count_source}"
    if count < 1:
        raise DrafterPlanError(f"drafter_training_num_draft_layers must be at least 1, got {count!r}")

    _, (default_block, default_block_reason) = drafter_depth_and_block(arch)
    block = _int(_first(block_size, plan.get("block_size"), default_block))
    if block is None or block < MIN_BLOCK_SIZE:
        raise DrafterPlanError(
            f"block_size must be an integer >= {MIN_BLOCK_SIZE} (SpecForge's DFlash loss needs two tokens "
            "per "
            f"block), got {_first(block_size, plan.get('block_size'))!r}"
        )
    block_source = (
        "inventory"
        if block_size
        else ("the facts' plan" if plan.get("block_size") else f"the plan's rule: {default_block_reason}")
    )
    reasons["block_size"] = f"{block} from {block_source}"

    mask = _int(
        _first(
            mask_token_id,
            plan.get("mask_token_id"),
            nested(facts, "tokenizer", "mask_token", "id"),
            nested(facts, "tokenizer", "mask_token_id"),
        )
    )
    if mask is None:
        planned = nested(facts, "plan", "drafter", "mask_token_id")
        if isinstance(planned, dict) and planned.get("unknown") is True:
            # Introspection could not read the tokenizer: say that, not "the tokenizer has no candidate".
            why = str(planned.get("reason")).removeprefix("unknown: ")
            raise DrafterPlanError(
                f"the plan's mask_token_id is unknown ({why}): {planned.get('remedy')}; or set "
                f"drafter_training_mask_token_id to a reserved id below the vocabulary size {vocab}"
            )
        raise DrafterPlanError(
            "no mask token id: the facts' tokenizer has no mask-token candidate; set "
            f"drafter_training_mask_token_id to a reserved id below the vocabulary size {vocab}"
        )
    if not 0 <= mask < vocab:
        raise DrafterPlanError(
            f"mask token id {mask} lies outside the target vocabulary [0, {vocab}); pick a reserved "
            "special-token id"
        )
    reasons["mask_token_id"] = f"{mask} from {'inventory' if mask_token_id is not None else 'the facts'}"

    heads = _int(_first(attention.get("heads"), text.get("num_attention_heads")))
    if heads is None or heads < 1:
        raise DrafterPlanError("the facts lack attention.heads (num_attention_heads); re-run introspect")
    mla = attention.get("kind") == "mla" or text.get("kv_lora_rank") is not None
    if head_dim:
        dim, why = _int(head_dim), "inventory"
    elif mla:
        # MLA heads are (nope + rope) wide and cache a latent; a Qwen3 draft layer wants plain heads of
        # the non-rotary width (128 on Kimi K2.x and DeepSeek-V3, as SpecForge's Kimi DFlash config has).
        dim = _int(_first(attention.get("qk_nope_head_dim"), text.get("qk_nope_head_dim")))
        why = "the target's MLA qk_nope_head_dim"
    else:
        dim = _int(_first(attention.get("head_dim"), text.get("head_dim")))
        why = "the target's head_dim"
    if dim is None:
        dim, why = hidden // heads, "hidden_size / heads"
    reasons["head_dim"] = f"{dim} from {why}"
    target_kv = _int(_first(attention.get("kv_heads"), text.get("num_key_value_heads"))) or heads
    if num_key_value_heads:
        kv = _int(num_key_value_heads)
        if heads % kv:
            raise DrafterPlanError(
                f"drafter_training_num_key_value_heads={kv} does not divide the {heads} attention heads"
            )
        reasons["num_key_value_heads"] = f"{kv} from inventory"
    else:
        kv = _kv_heads(heads, target_kv, max_kv_heads)
        reasons["num_key_value_heads"] = (
            f"{kv}: the target's {target_kv} KV heads capped at {max_kv_heads}, dividing {heads} heads"
        )
    inter = _int(_first(intermediate_size, arch.get("intermediate_size"), text.get("intermediate_size")))
    if inter is None:
        inter = 4 * hidden
        warnings.append(
            f"the target has no intermediate_size; the drafter MLP uses 4 * hidden_size = {inter}"
        )
    source = "inventory" if intermediate_size else "the target's dense MLP"
    reasons["intermediate_size"] = f"{inter} from {source}"

    config = {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": DRAFT_MODEL_TYPE,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_hidden_layers": count,
        "num_target_layers": layers,
        "block_size": block,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask},
        "layer_types": ["full_attention"] * count,
        "max_window_layers": count,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": dim,
        "intermediate_size": inter,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": dtype,
    }
    copied = []
    rope_theta, rope_scaling = _rope_fields(text)
    for field in _TARGET_FIELDS:
        if field == "rope_theta":
            value = rope_theta
        elif field == "rope_scaling":
            value = rope_scaling
        else:
            value = text.get(field)
        if value is not None:
            config[field] = value
            copied.append(field)
    if copied:
        reasons["copied_from_target"] = ", ".join(copied)
    else:
        warnings.append(
            "no target config.json was read: rope, norm epsilon and activation use Qwen3 defaults; "
            "train only after the introspected model directory is readable on this host"
        )
    if config.get("max_position_embeddings") is None:
        config["max_position_embeddings"] = _int(arch.get("max_position_embeddings")) or 4096
    if hidden % heads and not head_dim and not mla:
        warnings.append(f"hidden_size {hidden} is not divisible by {heads} heads")
    return config, reasons, warnings


def config_digest(value):
    """A short stable hash of a JSON-able value: a run's identity for resume and idempotence."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Hidden states: bytes per token, disk budget, offline vs online
# --------------------------------------------------------------------------------------------------


def hidden_state_bytes_per_token(hidden_size, num_layers, dtype="bfloat16"):
    """Bytes of captured hidden state per token: layers x hidden x dtype (Kimi K2.6, 5: 5*7168*2 = 71680)."""
    if dtype not in HIDDEN_STATE_DTYPES:
        raise DrafterPlanError(
            f"unknown hidden-state dtype {dtype!r}; use one of {sorted(HIDDEN_STATE_DTYPES)}"
        )
    return int(num_layers) * int(hidden_size) * DTYPE_BYTES[dtype]


def disk_budget(free_bytes, max_fill=0.85, max_bytes=None):
    """Bytes the hidden states may take: `max_fill` of the free space, at most `max_bytes` when set (None:
    unknown free space and no cap)."""
    budget = None if free_bytes is None else int(max(0, int(free_bytes)) * float(max_fill))
    if max_bytes is not None:
        budget = int(max_bytes) if budget is None else min(budget, int(max_bytes))
    return budget


def plan_hidden_states(
    requested,
    tokens,
    hidden_size,
    num_layers,
    free_bytes,
    dtype="bfloat16",
    max_fill=0.85,
    warn_fill=0.5,
    max_bytes=None,
):
    """Offline capture or online streaming, from the disk the captured features would take.

    `requested` is auto|offline|online. `auto` captures offline when the features fit the budget
    (`max_fill` of the free space, and at most `max_bytes` when set), else streams online. An explicit
    `offline` that would not fit is refused before anything is written; one that uses more than
    `warn_fill` of the free space warns. Returns a dict with the arithmetic spelled out, the chosen mode,
    the reason, the budget and any warnings.
    """
    if requested not in HIDDEN_STATE_MODES:
        raise DrafterPlanError(
            "drafter_training_hidden_states={!r}; choose one of {}".format(
                requested, ", ".join(HIDDEN_STATE_MODES)
            )
        )
    per_token = hidden_state_bytes_per_token(hidden_size, num_layers, dtype)
    file_per_token = per_token + FEATURE_INDEX_BYTES_PER_TOKEN
    tokens = max(0, int(tokens or 0))
    required = tokens * file_per_token
    free = None if free_bytes is None else max(0, int(free_bytes))
    budget = disk_budget(free, max_fill, max_bytes)
    fits = budget is None or required <= budget
    capped = max_bytes is not None and (free is None or int(max_bytes) < free * max_fill)
    arithmetic = (
        f"{num_layers} layers x {hidden_size} hidden x {DTYPE_BYTES[dtype]} B ({dtype}) = {per_token} "
        "B/token "
        f"({human_bytes(per_token)}); x {tokens} tokens = {human_bytes(required)} on disk"
    )
    warnings = []
    if requested == "online":
        mode, reason = "online", "online streaming requested in inventory: nothing is written to disk"
    elif requested == "offline" or fits:
        if not fits:
            limit = (
                f"drafter_training_hidden_states_max_bytes allows {human_bytes(budget)}"
                if capped
                else f"the disk holding the hidden states has {human_bytes(free)} free (at most "
                f"{int(max_fill * 100)}% may be filled)"
            )
            raise DrafterPlanError(
                f"offline capture needs {human_bytes(required)} but {limit}: {arithmetic}. Free "
                "space, point drafter_training_hidden_states_dir at a larger disk, train on "
                "fewer tokens, set drafter_training_hidden_states: online, or "
                "drafter_training_topology: rolling"
            )
        mode = "offline"
        reason = "offline capture {}: {} fits in {} free".format(
            "requested" if requested == "offline" else "chosen (fits the disk)",
            human_bytes(required),
            "unknown" if free is None else human_bytes(free),
        )
        if free is not None and free and required > free * warn_fill:
            warnings.append(
                f"offline hidden states will take {human_bytes(required)}, "
                f"{int(100.0 * required / free)}% of "
                f"the {human_bytes(free)} free on that disk"
            )
    else:
        mode = "online"
        reason = f"online streaming chosen: offline features would need {human_bytes(required)} but " + (
            f"drafter_training_hidden_states_max_bytes allows {human_bytes(budget)}"
            if capped
            else f"only {human_bytes(free)} is free"
        )
        warnings.append(reason + "; online needs a capture server on GPUs the trainer does not use")
    return {
        "mode": mode,
        "requested": requested,
        "reason": reason,
        "dtype": dtype,
        "bytes_per_token": per_token,
        "file_bytes_per_token": file_per_token,
        "tokens": tokens,
        "required_bytes": required,
        "free_bytes": free,
        "budget_bytes": budget,
        "fits": fits,
        "arithmetic": arithmetic,
        "warnings": warnings,
    }


# --------------------------------------------------------------------------------------------------
# Training horizon and launch
# --------------------------------------------------------------------------------------------------


def total_steps(num_samples, batch_size, world_size=1, accumulation_steps=1, num_epochs=1, max_steps=None):
    """Optimizer steps SpecForge will run for an offline dataset (its schedule.resolve_total_steps over
    the samples one rank gets: `launch._shard_offline_refs` pads the data, as DistributedSampler does, to a
    multiple of the ranks, so each rank has ceil(samples / ranks))."""
    if max_steps:
        return int(max_steps)
    per_rank = -(-int(num_samples) // max(1, int(world_size)))
    steps = (per_rank // max(1, int(batch_size))) * int(num_epochs) // max(1, int(accumulation_steps))
    if steps < 1:
        raise DrafterPlanError(
            f"the data makes no optimizer step: {num_samples} samples over {world_size} ranks with batch "
            f"{batch_size} x accumulation {accumulation_steps}; "
            "use more samples, a smaller batch, or drafter_training_max_steps"
        )
    return steps


def trainer_topology(hosts, host, gpus_per_host, master_port=29500):
    """nnodes / node_rank / master_addr for `specforge train --node-rank`, ranks in inventory order."""
    if host not in hosts:
        raise DrafterPlanError(f"{host} is not in the regen_train group {hosts}")
    return {
        "nnodes": len(hosts),
        "node_rank": hosts.index(host),
        "nproc_per_node": max(1, int(gpus_per_host)),
        "master_host": hosts[0],
        "master_port": int(master_port),
    }


def _compact(mapping):
    return {key: value for key, value in mapping.items() if value is not None}


def _merge(base, extra):
    """Deep-merge `extra` (drafter_training_extra_config) into `base`, section by section."""
    merged = dict(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def specforge_run_config(
    model_path,
    draft_config_path,
    embedding_key,
    lm_head_key,
    mask_token_id,
    mode,
    run_id,
    output_dir,
    cache_dir,
    topology,
    master_addr,
    hidden_states_path=None,
    prompts_path=None,
    max_length=2048,
    chat_template="llama3",
    training=None,
    report_to="none",
    dataloader_num_workers=None,
    online=None,
    trust_remote_code=True,
    extra=None,
):
    """The `specforge train --config` document (SpecForge 0.2.0's `specforge.config.Config` schema).

    Offline: `data.hidden_states_path` + `deployment.mode: local_colocated`. Online: pre-tokenized
    `data.prompts_path` + `deployment.mode: disaggregated` with an external SGLang capture server and
    Mooncake (the only online topology SpecForge 0.2.0 accepts). `deployment.trainer` carries the torchrun
    topology SpecForge launches itself; each host passes its `--node-rank`.
    """
    if mode not in ("offline", "online"):
        raise DrafterPlanError(f"hidden-state mode must be offline or online, got {mode!r}")
    data = {
        "max_length": int(max_length),
        "chat_template": chat_template,
        "cache_dir": cache_dir,
        "dataloader_num_workers": dataloader_num_workers,
    }
    if mode == "offline":
        data["hidden_states_path"] = hidden_states_path
    else:
        data["prompts_path"] = prompts_path
    trainer = {
        "nnodes": int(topology["nnodes"]),
        "nproc_per_node": int(topology["nproc_per_node"]),
        "master_port": int(topology.get("master_port", 29500)),
    }
    if trainer["nnodes"] > 1:
        trainer["master_addr"] = master_addr
    deployment = {"mode": "local_colocated", "trainer": trainer}
    if mode == "online":
        online = online or {}
        if not online.get("server_urls"):
            raise DrafterPlanError(
                "online hidden states stream from capture servers, and none is planned: let the train stage "
                "start them (drafter_training_online_manage: true), or name running ones in "
                "drafter_training_online_server_urls (and drafter_training_online_mooncake), or train offline"
            )
        deployment = {
            "mode": "disaggregated",
            "trainer": trainer,
            "disaggregated": _compact(
                {
                    "control_dir": online.get("control_dir") or output_dir + "/control",
                    "backend": "mooncake",
                    "server_urls": list(online["server_urls"]),
                    # The consumer's SQLite ledger and rank inboxes: node-local, one per attempt.
                    "consumer_state_dir": online.get("consumer_state_dir"),
                    "mooncake_master_server_addr": (online.get("mooncake") or {}).get("master_server_addr"),
                    "mooncake_metadata_server": (online.get("mooncake") or {}).get("metadata_server"),
                    "mooncake_local_hostname": (online.get("mooncake") or {}).get("local_hostname"),
                    "mooncake_protocol": (online.get("mooncake") or {}).get("protocol"),
                }
            ),
        }
    recipe = {"strategy": "dflash"}
    recipe.update(training or {})
    config = {
        "model": {
            "target_model_path": model_path,
            "draft_model_config": draft_config_path,
            "trust_remote_code": bool(trust_remote_code),
            "embedding_key": embedding_key,
            "lm_head_key": lm_head_key,
            "mask_token_id": int(mask_token_id),
            "torch_dtype": "bfloat16",
        },
        "data": _compact(data),
        "training": _compact(recipe),
        "tracking": {"report_to": report_to},
        "deployment": deployment,
        "run_id": run_id,
        "output_dir": output_dir,
    }
    return _merge(config, extra)


def specforge_chat_template(arch):
    """SpecForge's template name for the model family (the registry's row: the top-level type first, Kimi
    K2.6 is `kimi_k25`), else SpecForge's llama3 default."""
    row = family_of(arch)
    return (row.specforge_chat_template if row else None) or DEFAULT_SPECFORGE_CHAT_TEMPLATE


def sglang_dflash_args(draft_path, block_size, serving=None):
    """The flags that add the trained drafter to an SGLang launch of the target.

    `serving` (the plan's serving values) lets the flags follow SGLang 0.5.23's DFLASH constraints
    (`speculative_hook._handle_dflash`): no pipeline parallelism (a plan with pp > 1 is refused with what to
    change), DP attention only with `--enable-dp-lm-head`; one draft step and top-k 1 SGLang sets itself.
    """
    serving = serving or {}
    pp = _int(serving.get("pp_size")) or 1
    if pp > 1:
        raise DrafterPlanError(
            f"SGLang serves DFLASH only with pp_size 1 and the serving plan uses pp {pp}: serve target + "
            "drafter with tensor/expert parallelism (model_facts_plan_overrides.serving.pp_size: 1)"
        )
    args = [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(draft_path),
        "--speculative-num-draft-tokens",
        str(int(block_size)),
    ]
    if (_int(serving.get("attn_dp_size")) or 1) > 1:
        # The drafter's greedy projection borrows the target's LM head, which DP attention shards.
        args.append("--enable-dp-lm-head")
    return args


# --------------------------------------------------------------------------------------------------
# Reading the target directory (the only I/O here; small and bounded)
# --------------------------------------------------------------------------------------------------


def _safetensors_keys(path, limit=256 * 1024 * 1024):
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            return []
        (length,) = struct.unpack("<Q", raw)
        if length > limit:
            return []
        header = json.loads(handle.read(length).decode("utf-8"))
    return [key for key in header if key != "__metadata__"]


def weight_keys(model_dir):
    """Tensor names of a safetensors checkpoint (from the index, else the file headers)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return sorted((json.load(handle).get("weight_map") or {}).keys())
    keys = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            keys.extend(_safetensors_keys(os.path.join(model_dir, name)))
    return sorted(keys)


def embedding_and_head_keys(keys):
    """The target's input-embedding and LM-head tensor names SpecForge must load (Kimi nests them).

    The language model's embedding is the shortest `*embed_tokens.weight` outside a vision/audio tower;
    its LM head is the `lm_head.weight` under the same language-model prefix (`language_model.` on Kimi).
    """
    towers = ("vision", "visual", "audio", "mm_projector", "multi_modal")

    def shortest(found):
        preferred = [k for k in found if not any(t in k for t in towers)] or found
        return min(preferred, key=len) if preferred else None

    embed = shortest([k for k in keys if k.endswith("embed_tokens.weight")])
    heads = [k for k in keys if k.endswith("lm_head.weight")]
    head = None
    if embed is not None:
        prefix = embed[: -len("embed_tokens.weight")]
        # `<lm>model.embed_tokens.weight` pairs with `<lm>lm_head.weight` (HF's *ForCausalLM layout).
        outer = prefix[: -len("model.")] if prefix.endswith("model.") else prefix
        for candidate in (outer + "lm_head.weight", prefix + "lm_head.weight"):
            if candidate in heads:
                head = candidate
                break
    return embed, head or shortest(heads)
