"""Normalized architecture facts from a Hugging Face model directory.

Standard library only: this file runs on the target host inside whatever interpreter the inspected venv
has, which may lack everything but Python itself. `normalize_config` is a pure function over the parsed
`config.json`; `read_model_dir` does the file I/O (config, generation config, quantization config,
safetensors index or headers) and raises `ModelDirError` with a message naming the file and the fix.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
import sys

from . import regen_model_size
from .regen_families import FAMILIES, TEXT_CONFIG_KEYS

CONFIG_FILE = "config.json"
# Released decoders have at most a few hundred layers; the facts hold one character per layer (the layer
# pattern), so a damaged count (2**40) would take that much memory: beyond this it is ignored, with a warning.
MAX_LAYERS = 10_000
GENERATION_CONFIG_FILE = "generation_config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# The model-family registry says which model_type values we know how to read (anything else still yields
# facts, with a warning) and under which keys wrappers nest the language model's config.
KNOWN_MODEL_TYPES = frozenset(FAMILIES)

# Bytes per element by config dtype name (torch_dtype / dtype, and the short names people write).
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# A safetensors header larger than this is not a header (protects against reading garbage as JSON).
MAX_SAFETENSORS_HEADER = 512 * 1024 * 1024


class ModelDirError(Exception):
    """A problem that stops us producing facts: the message names the file and what to do."""


# --------------------------------------------------------------------------------------------------
# Small typed readers: configs are user data, so every value is checked before it is trusted.
# --------------------------------------------------------------------------------------------------


def _is_int(value):
    # bool is an int subclass in Python, but `true` is never a layer count.
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value):
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)
    return None


class _Reader:
    """Reads typed values from the text config first, then the top level, collecting warnings."""

    def __init__(self, text, top, warnings):
        self.text = text
        self.top = top
        self.warnings = warnings

    def _lookup(self, keys, scopes):
        for scope in scopes:
            for key in keys:
                if key in scope and scope[key] is not None:
                    return key, scope[key]
        return None, None

    def int(self, *keys, top_first=False, positive=True, maximum=None):
        scopes = (self.top, self.text) if top_first else (self.text, self.top)
        key, value = self._lookup(keys, scopes)
        if key is None:
            return None
        number = _as_int(value)
        if number is None or (positive and number <= 0) or number < 0:
            self.warnings.append(
                "config.json: {} is {!r}, expected a {} integer; ignored".format(
                    key, value, "positive" if positive else "non-negative"
                )
            )
            return None
        if maximum is not None and number > maximum:
            self.warnings.append(
                f"config.json: {key} is {number}, more than {maximum:,} (no decoder has that many); ignored"
            )
            return None
        return number

    def float(self, *keys):
        key, value = self._lookup(keys, (self.text, self.top))
        if key is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.warnings.append(f"config.json: {key} is {value!r}, expected a number; ignored")
            return None
        return value

    def str(self, *keys):
        key, value = self._lookup(keys, (self.text, self.top))
        if key is None:
            return None
        if not isinstance(value, str):
            self.warnings.append(f"config.json: {key} is {value!r}, expected a string; ignored")
            return None
        return value

    def bool(self, *keys, default=None):
        key, value = self._lookup(keys, (self.text, self.top))
        if key is None:
            return default
        if not isinstance(value, bool):
            self.warnings.append(f"config.json: {key} is {value!r}, expected true/false; ignored")
            return default
        return value

    def raw(self, *keys):
        return self._lookup(keys, (self.text, self.top))[1]


def _token_ids(value):
    """A token id field may be an int, a list of ints or null; always return a list of ints."""
    if _is_int(value) and value >= 0:
        return [value]
    if isinstance(value, list):
        return [v for v in value if _is_int(v) and v >= 0]
    return []


def _string_list(value):
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


# --------------------------------------------------------------------------------------------------
# Pieces of the normalized document
# --------------------------------------------------------------------------------------------------


def _text_config(config, warnings):
    for key in TEXT_CONFIG_KEYS:
        if key in config:
            nested = config[key]
            if isinstance(nested, dict):
                return key, nested
            if nested is not None:
                raise ModelDirError(
                    f"config.json: {key} must be a JSON object (the language model's config), "
                    f"got {type(nested).__name__}; re-download config.json or fix the {key} entry"
                )
    if "vision_config" in config:
        warnings.append(
            "config.json has vision_config but no text_config: "
            "reading language-model fields from the top level"
        )
    return None, config


def _attention(r, hidden_size, num_layers=None):
    heads = r.int("num_attention_heads", "n_heads", "n_head")
    kv_heads = r.int("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num") or heads
    head_dim = r.int("head_dim", "attention_head_dim")
    if head_dim is None and heads and hidden_size and hidden_size % heads == 0:
        head_dim = hidden_size // heads
    kv_lora_rank = r.int("kv_lora_rank")
    attention = {
        "kind": None,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": r.int("q_lora_rank"),
        "qk_nope_head_dim": None,
        "qk_rope_head_dim": None,
        "v_head_dim": None,
        "sliding_window": r.int("sliding_window"),
        "layer_types": None,
    }
    if kv_lora_rank is not None:
        # Multi-head latent attention (DeepSeek-V3, Kimi K2): the KV cache holds one latent per token.
        attention["kind"] = "mla"
        attention["qk_nope_head_dim"] = r.int("qk_nope_head_dim")
        attention["qk_rope_head_dim"] = r.int("qk_rope_head_dim")
        attention["v_head_dim"] = r.int("v_head_dim")
        attention["kv_heads"] = heads
        rope, nope = attention["qk_rope_head_dim"], attention["qk_nope_head_dim"]
        if rope is not None and nope is not None:
            attention["head_dim"] = rope + nope
    elif heads is not None:
        attention["kind"] = "gqa" if kv_heads is not None and kv_heads < heads else "mha"
    layer_types = r.raw("layer_types")
    interval = r.int("full_attention_interval")
    has_linear = r.raw("linear_num_value_heads") is not None or r.raw("linear_num_key_heads") is not None
    if layer_types is None and interval and num_layers and has_linear:
        # Qwen3-Next's published config.json has no layer_types, only full_attention_interval (4): every
        # 4th layer is full attention, the rest gated DeltaNet. transformers derives the list the same way;
        # without it all 48 layers would count as KV-cache layers (4x the real cache).
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    if isinstance(layer_types, list) and layer_types and all(isinstance(t, str) for t in layer_types):
        counts = {}
        for kind in layer_types:
            counts[kind] = counts.get(kind, 0) + 1
        attention["layer_types"] = counts
        if "linear_attention" in counts:
            # Qwen3-Next / Qwen3.5: gated DeltaNet layers interleaved with full attention.
            attention["linear"] = {
                "key_heads": r.int("linear_num_key_heads"),
                "value_heads": r.int("linear_num_value_heads"),
                "key_head_dim": r.int("linear_key_head_dim"),
                "value_head_dim": r.int("linear_value_head_dim"),
            }
    return attention


def _moe(r, num_layers):
    routed = r.int("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
    if routed is None or routed <= 1:
        return None
    per_token = r.int(
        "num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_top_k", "top_k"
    )
    expert_size = r.int("moe_intermediate_size", "expert_intermediate_size")
    if expert_size is None:
        # Mixtral and gpt-oss experts are full-size MLPs: intermediate_size is the expert's width.
        expert_size = r.int("intermediate_size", "ffn_hidden_size")
    shared = r.int("n_shared_experts", "num_shared_experts", positive=False)
    shared_size = r.int("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                        positive=False)
    if shared is None:
        shared = 1 if shared_size else 0
    if shared_size is None and shared and expert_size:
        shared_size = shared * expert_size
    dense_prefix = r.int("first_k_dense_replace", positive=False)
    mlp_only = r.raw("mlp_only_layers")
    dense_layers = []
    if isinstance(mlp_only, list):
        dense_layers = sorted({v for v in mlp_only if _is_int(v) and v >= 0})
    if dense_prefix is None:
        dense_prefix = 0
        while dense_prefix in dense_layers:
            dense_prefix += 1
    sparse_step = r.int("decoder_sparse_step", "moe_layer_freq")
    moe_layers = None
    moe_layer_ids = []
    if num_layers is not None:
        candidates = range(min(dense_prefix, num_layers), num_layers)
        step = sparse_step if sparse_step else 1
        moe_layer_ids = [i for i in candidates if i not in dense_layers and (i + 1) % step == 0]
        moe_layers = len(moe_layer_ids)
    return {
        "routed_experts": routed,
        "shared_experts": shared,
        "experts_per_token": per_token,
        "expert_intermediate_size": expert_size,
        "shared_expert_intermediate_size": shared_size or None,
        "dense_prefix_layers": dense_prefix,
        "moe_layers": moe_layers,
        "n_group": r.int("n_group", "num_expert_group"),
        "topk_group": r.int("topk_group", "topk_group_num"),
        "scoring_func": r.str("scoring_func"),
        "topk_method": r.str("topk_method"),
        "routed_scaling_factor": r.float("routed_scaling_factor"),
        # Latent MoE (Kimi K3 routed_expert_hidden_size, Nemotron-3 moe_latent_size): the routed experts'
        # input width, narrower than hidden_size; null when they read the hidden state itself.
        "routed_expert_hidden_size": r.int("routed_expert_hidden_size", "moe_latent_size"),
        "_layer_ids": moe_layer_ids,
    }


def normalize_quantization(config, text, hf_quant_config=None):
    """Quantization facts from quantization_config (top or text) and/or a ModelOpt hf_quant_config.json.

    ModelOpt checkpoints write `quant_method: modelopt` and name the scheme in `quant_algo` (NVFP4, FP8,
    MIXED_PRECISION); their hf_quant_config.json may add the per-layer table of a MIXED_PRECISION
    checkpoint (`quantized_layers`) and the KV-cache algorithm, so both files are read when both exist.
    """
    source = None
    q = None
    for scope, name in ((config, "config.json"), (text, "config.json text_config")):
        if isinstance(scope.get("quantization_config"), dict):
            q, source = scope["quantization_config"], name
            break
    hf_inner = None
    if isinstance(hf_quant_config, dict):
        inner = hf_quant_config.get("quantization")
        hf_inner = inner if isinstance(inner, dict) else hf_quant_config
    if q is None and hf_inner is not None:
        q, source = hf_inner, HF_QUANT_CONFIG_FILE
    if q is None:
        return None
    algo = q.get("quant_algo") if isinstance(q.get("quant_algo"), str) else None
    if algo is None and hf_inner is not None and isinstance(hf_inner.get("quant_algo"), str):
        algo = hf_inner["quant_algo"]
    method = q.get("quant_method") or algo
    method = method.lower() if isinstance(method, str) else None
    bits = _as_int(q.get("bits")) or _as_int(q.get("num_bits"))
    group_size = _as_int(q.get("group_size"))
    fmt = q.get("format") if isinstance(q.get("format"), str) else None
    weight_type = None
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict):
                bits = bits or _as_int(weights.get("num_bits"))
                group_size = group_size or _as_int(weights.get("group_size"))
                weight_type = weights.get("type") if isinstance(weights.get("type"), str) else None
                if fmt is None and isinstance(group.get("format"), str):
                    fmt = group["format"]
                break
    if fmt is None and isinstance(q.get("fmt"), str):
        fmt = q["fmt"]
    if bits is None and method:
        bits = {"fp8": 8, "mxfp4": 4, "nvfp4": 4, "fp4": 4, "w4a16_awq": 4, "int4_awq": 4}.get(method)
        if bits is None and "fp8" in method:
            bits = 8
    if bits is None and algo:
        bits = {"NVFP4": 4, "FP8": 8, "MXFP8": 8, "W4A16_NVFP4": 4}.get(algo.upper())
    if group_size is None and hf_inner is not None:
        group_size = _as_int(hf_inner.get("group_size"))
    block = q.get("weight_block_size")
    ignores = []
    for scope in (q, hf_inner or {}):
        for key in ("ignore", "modules_to_not_convert", "exclude_modules", "ignored_layers"):
            for entry in _string_list(scope.get(key)):
                if entry not in ignores:
                    ignores.append(entry)
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) and hf_inner is not None:
        layers = hf_inner.get("quantized_layers")
    kv = declared_kv_cache(q, source)
    if kv is None and hf_inner is not None and hf_inner is not q:
        kv = declared_kv_cache(hf_inner, HF_QUANT_CONFIG_FILE)
    return {
        "method": method,
        "algo": algo,
        "bits": bits,
        "format": fmt,
        "weight_type": weight_type,
        "group_size": group_size,
        "weight_block_size": [v for v in block if _is_int(v)] if isinstance(block, list) else None,
        "ignores": ignores,
        # ModelOpt MIXED_PRECISION: bits per weight by "component.layer" (regen_model_size.mixed_table), the
        # per-module table folded to what the size arithmetic needs.
        "mixed_precision": (
            regen_model_size.mixed_table(layers) if isinstance(layers, dict) and layers else None
        ),
        "source": source,
        "kv_cache": kv,
    }


# KV-cache element formats a checkpoint can declare, as SGLang 0.5.23 names them (--kv-cache-dtype), with
# bytes per element: (scheme type, bits) of a compressed-tensors / ModelOpt `kv_cache_scheme`, and
# ModelOpt's `kv_cache_quant_algo` names. An INT8 scheme is left out: SGLang has no INT8 KV cache, so
# such a checkpoint is served with a cache of the model's dtype.
_KV_SCHEMES = {("float", 8): ("fp8_e4m3", 1), ("float", 4): ("nvfp4", 0.5)}
_KV_ALGOS = {"FP8": ("fp8_e4m3", 1), "NVFP4": ("nvfp4", 0.5)}


def declared_kv_cache(q, source):
    """The KV-cache format a quantization config declares: {dtype, bytes, declared}, or None (the cache
    then has the model's dtype). Compressed-tensors and flat ModelOpt configs write `kv_cache_scheme`
    ({"type": "float", "num_bits": 8} is FP8; null means none); ModelOpt's hf_quant_config.json writes
    `kv_cache_quant_algo: "FP8"`, which SGLang 0.5.23 turns into an FP8 pool by itself."""
    scheme = q.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        kind, bits = scheme.get("type"), _as_int(scheme.get("num_bits"))
        found = _KV_SCHEMES.get((kind, bits))
        if found:
            return {"dtype": found[0], "bytes": found[1],
                    "declared": f"{source} kv_cache_scheme {{type: {kind}, num_bits: {bits}}}"}
    algo = q.get("kv_cache_quant_algo")
    if isinstance(scheme, str) and scheme.upper() in _KV_ALGOS and not isinstance(algo, str):
        algo = scheme  # ModelOpt configs written into config.json: `kv_cache_scheme: "FP8"`
    if isinstance(algo, str) and algo.upper() in _KV_ALGOS:
        found = _KV_ALGOS[algo.upper()]
        return {"dtype": found[0], "bytes": found[1], "declared": f"{source} kv_cache_quant_algo {algo}"}
    return None


def kv_cache_dtype(arch):
    """{dtype, bytes, source}: the KV cache's element format, the declared one, else the model's dtype
    (what SGLang's `--kv-cache-dtype auto` stores)."""
    declared = (arch.get("quantization") or {}).get("kv_cache")
    if declared:
        return {"dtype": declared["dtype"], "bytes": declared["bytes"], "source": declared["declared"]}
    name = (arch.get("dtype") or "bfloat16").lower()
    return {"dtype": name, "bytes": DTYPE_BYTES.get(name, 2),
            "source": "no KV-cache quantization declared: the model's dtype"}


def estimate_parameters(arch, text=None, config=None):
    """Total and active-per-token parameter estimate from shapes, by component (regen_model_size); MTP
    layers and the vision tower are counted apart (`mtp_params`, `vision_params`)."""
    hidden, layers = arch["hidden_size"], arch["num_layers"]
    if not hidden or not layers:
        return {"total": None, "active": None, "note": "hidden_size or num_layers unknown"}
    pattern = arch.get("layer_pattern") or regen_model_size.layer_pattern(
        text or {}, layers, range((arch["moe"] or {}).get("dense_prefix_layers") or 0, layers)
        if arch.get("moe") else ())
    counted = regen_model_size.count_parameters(arch, text or {}, config or {}, pattern)
    if arch.get("moe") is None:
        counted["note"] = "dense: every parameter is active"
    return counted


def estimate_weight_bytes(arch):
    """Checkpoint size estimate from config.json alone (regen_model_size.weight_bytes), when no safetensors
    metadata is readable."""
    detail = weight_estimate(arch)
    return detail["bytes"] if detail else None


def weight_estimate(arch):
    """{bytes, scheme, reason, components}: the config-only weight size with its arithmetic, or None."""
    params = arch.get("parameters") or {}
    if not params.get("total"):
        return None
    dtype_bytes = DTYPE_BYTES.get((arch.get("dtype") or "bfloat16").lower(), 2)
    total, breakdown = regen_model_size.weight_bytes(arch, params, dtype_bytes)
    if total is None:
        return None
    return {"bytes": total, **breakdown}


def kv_cache_bytes_per_token(arch, dtype_bytes=None):
    """Bytes of KV cache one token needs across all layers (MLA: one latent; GQA: K and V per KV head), at
    the KV cache's element size (`kv_cache_dtype`: the declared format, else the model's dtype)."""
    if dtype_bytes is None:
        dtype_bytes = kv_cache_dtype(arch)["bytes"]
    att, layers = arch["attention"], arch["num_layers"]
    if not layers:
        return None
    full_layers = layers
    if att.get("kv_layers") is not None:
        # Hybrid layouts: only full and sliding-window attention layers keep a KV cache per token.
        full_layers = att["kv_layers"]
    elif att.get("layer_types") and "linear_attention" in att["layer_types"]:
        full_layers = layers - att["layer_types"]["linear_attention"]
    if att["kind"] == "mla":
        if att["kv_lora_rank"] is None:
            return None
        return int(full_layers * (att["kv_lora_rank"] + (att["qk_rope_head_dim"] or 0)) * dtype_bytes)
    if att["kv_heads"] and att["head_dim"]:
        return int(full_layers * 2 * att["kv_heads"] * att["head_dim"] * dtype_bytes)
    return None


def normalize_config(config, generation_config=None, hf_quant_config=None):
    """Pure: the normalized architecture document for one parsed config.json.

    Raises ModelDirError only for shapes no reader could use (config not an object, text_config not an
    object); anything else unknown or missing becomes null plus a `warnings` entry.
    """
    if not isinstance(config, dict):
        raise ModelDirError(
            f"config.json: top level must be a JSON object, got {type(config).__name__}; "
            "re-download config.json"
        )
    warnings = []
    text_key, text = _text_config(config, warnings)
    r = _Reader(text, config, warnings)
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    text_model_type = text.get("model_type") if isinstance(text.get("model_type"), str) else None
    if text_model_type is None:
        text_model_type = model_type
    if model_type is None:
        warnings.append("config.json has no model_type string; architecture family unknown")
    elif model_type not in KNOWN_MODEL_TYPES and (text_model_type or "") not in KNOWN_MODEL_TYPES:
        warnings.append(
            f"model_type {model_type!r} is not one regen knows; "
            "facts below are read from the usual Hugging Face keys"
        )
    architectures = _string_list(config.get("architectures")) or _string_list(text.get("architectures"))
    hidden_size = r.int("hidden_size", "d_model", "n_embd", "dim")
    num_layers = r.int("num_hidden_layers", "n_layers", "num_layers", "n_layer", maximum=MAX_LAYERS)
    for name, value in (("hidden_size", hidden_size), ("num_hidden_layers", num_layers)):
        if value is None:
            warnings.append(f"config.json: {name} not found; size estimates are unavailable")
    vocab_size = r.int("vocab_size", "padded_vocab_size")
    if vocab_size is None:
        warnings.append("config.json: vocab_size not found")
    arch = {
        "model_type": model_type,
        "text_model_type": text_model_type,
        "text_config_key": text_key,
        "architectures": architectures,
        "hidden_size": hidden_size,
        "intermediate_size": r.int("intermediate_size", "ffn_hidden_size"),
        "num_layers": num_layers,
        # DeepSeek/GLM/Kimi name the MTP depth num_nextn_predict_layers; Qwen3.5 MoE mtp_num_hidden_layers.
        "mtp_layers": r.int(
            "num_nextn_predict_layers", "mtp_num_hidden_layers", positive=False, maximum=MAX_LAYERS
        ) or 0,
        "vocab_size": vocab_size,
        "max_position_embeddings": r.int(
            "max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"
        ),
        "tie_word_embeddings": r.bool("tie_word_embeddings", default=False),
        "dtype": r.str("torch_dtype", "dtype"),
        "attention": None,
        "moe": None,
        "quantization": None,
        "special_token_ids": None,
        "parameters": None,
        "weight_bytes": None,
        "weight_bytes_source": None,
        "kv_cache_bytes_per_token": None,
        "kv_cache_dtype": None,
        "generation_defaults": {},
        "warnings": warnings,
    }
    arch["attention"] = _attention(r, hidden_size, num_layers)
    if arch["attention"]["kind"] is None:
        warnings.append("config.json: num_attention_heads not found; attention kind unknown")
    arch["moe"] = _moe(r, num_layers)
    moe_ids = arch["moe"].pop("_layer_ids") if arch["moe"] else []
    pattern = regen_model_size.layer_pattern(text, num_layers, moe_ids)
    arch["layer_pattern"] = pattern
    if pattern and num_layers is None:
        # Nemotron-3 Ultra writes its depth only as layers_block_type.
        num_layers = arch["num_layers"] = len(pattern["mixer"])
        warnings[:] = [w for w in warnings if "num_hidden_layers not found" not in w]
    if pattern:
        _apply_pattern(arch, pattern, r)
    arch["quantization"] = normalize_quantization(config, text, hf_quant_config)
    gen = generation_config if isinstance(generation_config, dict) else {}
    eos = []
    for value in (config.get("eos_token_id"), text.get("eos_token_id"), gen.get("eos_token_id")):
        for token_id in _token_ids(value):
            if token_id not in eos:
                eos.append(token_id)

    def _first_id(key):
        for scope in (gen, config, text):
            ids = _token_ids(scope.get(key))
            if ids:
                return ids[0]
        return None

    arch["special_token_ids"] = {
        "bos": _first_id("bos_token_id"),
        "eos": eos,
        "pad": _first_id("pad_token_id"),
    }
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "do_sample"):
        if key in gen and isinstance(gen[key], (int, float, bool)):
            arch["generation_defaults"][key] = gen[key]
    arch["parameters"] = estimate_parameters(arch, text, config)
    arch["weight_estimate"] = weight_estimate(arch)
    arch["kv_cache_dtype"] = kv_cache_dtype(arch)
    arch["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(arch)
    state, state_reason = regen_model_size.recurrent_state_bytes(arch, text, pattern)
    arch["recurrent_state_bytes_per_request"] = state or None
    if state_reason:
        arch["recurrent_state_reason"] = state_reason
    return arch


_PATTERN_NAMES = {"A": "full_attention", "S": "sliding_attention", "L": "linear_attention", "M": "mamba",
                  "-": "mlp_only"}


def _apply_pattern(arch, pattern, r):
    """Layer counts from the layer pattern: which layers keep a KV cache, how many hold experts."""
    att = arch["attention"]
    if pattern["source"] != "layer_types" and (set(pattern["mixer"]) - {"A"}):
        counts = {}
        for char in pattern["mixer"]:
            counts[_PATTERN_NAMES[char]] = counts.get(_PATTERN_NAMES[char], 0) + 1
        att["layer_types"] = counts
        if "L" in pattern["mixer"] and "linear" not in att:
            kda = r.raw("linear_attn_config") if isinstance(r.raw("linear_attn_config"), dict) else {}
            att["linear"] = {
                "key_heads": r.int("linear_num_key_heads") or _as_int(kda.get("num_heads")),
                "value_heads": r.int("linear_num_value_heads") or _as_int(kda.get("num_heads")),
                "key_head_dim": r.int("linear_key_head_dim") or _as_int(kda.get("head_dim")),
                "value_head_dim": r.int("linear_value_head_dim") or _as_int(kda.get("head_dim")),
            }
    att["kv_layers"] = pattern["mixer"].count("A") + pattern["mixer"].count("S")
    if arch["moe"] and "E" in pattern["mlp"]:
        arch["moe"]["moe_layers"] = pattern["mlp"].count("E")
        arch["moe"]["dense_prefix_layers"] = pattern["mlp"].index("E")


# --------------------------------------------------------------------------------------------------
# File I/O
# --------------------------------------------------------------------------------------------------


def _link_chain(path, limit=40):
    """The paths a symlink leads through, up to the first one seen twice (a loop) or not a link."""
    chain = [path]
    while os.path.islink(chain[-1]) and len(chain) <= limit:
        target = os.path.join(os.path.dirname(chain[-1]), os.readlink(chain[-1]))
        target = os.path.normpath(target)
        chain.append(target)
        if target in chain[:-1]:
            break
    return chain


def broken_link_problem(path):
    """Why the symlink ``path`` leads nowhere (a loop, or a missing target), or None if it is not one.

    ``os.path.exists`` is False for both, which would read as "not found" although the file is there."""
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
    except OSError as exc:
        chain = " -> ".join(_link_chain(path))
        if exc.errno == errno.ELOOP:
            return (
                f"{path} is a symlink loop ({chain}); point the link at the real file "
                "(e.g. the blob in the Hugging Face cache) or copy the file in its place"
            )
        return (
            f"{path} is a broken symlink ({chain}, which does not exist); "
            "fetch the model again or fix the link"
        )
    return None


def read_json(path, required=True):
    """Parse a JSON file; a clear ModelDirError (file, line, fix) instead of a traceback."""
    name = os.path.basename(path)
    problem = broken_link_problem(path)
    if problem:  # a link that leads nowhere is a broken file, not a missing one
        raise ModelDirError(problem)
    if not os.path.exists(path):
        if required:
            raise ModelDirError(
                f"{name} not found in {os.path.dirname(path)}; is this a Hugging Face model directory?"
            )
        return None
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ModelDirError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if not raw.strip():
        raise ModelDirError(f"{path} is empty; the download was probably interrupted: fetch it again")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{path} is not UTF-8 text (byte {exc.start}); fetch it again") from None
    except RecursionError:
        raise ModelDirError(_too_deep(path)) from None
    except ValueError as exc:
        line = getattr(exc, "lineno", None)
        col = getattr(exc, "colno", None)
        pos = getattr(exc, "pos", None)
        truncated = pos is not None and pos >= len(raw.rstrip()) - 1
        hint = (
            "the file ends early, so it was probably truncated: fetch it again"
            if truncated
            else "fix the JSON or fetch the file again"
        )
        where = f" at line {line} column {col}" if line else ""
        raise ModelDirError(
            "{} is not valid JSON{} ({}); {}".format(path, where, getattr(exc, "msg", exc), hint)
        ) from None


def _too_deep(path):
    return (
        f"{path} nests arrays or objects too deeply to parse (more than about {sys.getrecursionlimit()} "
        "levels); no model file looks like that: fetch it again"
    )


def safetensors_header(path):
    """The JSON header of one .safetensors file: {tensor: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ModelDirError(f"{path} is shorter than a safetensors header; fetch it again")
        (length,) = struct.unpack("<Q", prefix)
        if length <= 0 or length > MAX_SAFETENSORS_HEADER:
            raise ModelDirError(
                f"{path} has an impossible safetensors header length {length}; fetch it again"
            )
        data = handle.read(length)
    try:
        header = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ModelDirError(f"{path} has a corrupt safetensors header; fetch it again") from None
    except RecursionError:
        raise ModelDirError(_too_deep(path)) from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path} has a corrupt safetensors header; fetch it again")
    return header


def _header_bytes(header):
    total = 0
    dtypes = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        offsets = info.get("data_offsets")
        if isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(v) for v in offsets):
            size = offsets[1] - offsets[0]
        else:
            count = 1
            for dim in info.get("shape") or []:
                count *= dim if _is_int(dim) else 0
            size = count * SAFETENSORS_DTYPE_BYTES.get(info.get("dtype"), 0)
        total += size
        dtype = info.get("dtype") if isinstance(info.get("dtype"), str) else "unknown"
        dtypes[dtype] = dtypes.get(dtype, 0) + size
    return total, dtypes


def weight_bytes_from_dir(model_dir, warnings, read_headers=True):
    """(bytes, source, dtype breakdown) from the index's total_size or the shards' headers."""
    index = None
    try:
        index = read_json(os.path.join(model_dir, SAFETENSORS_INDEX_FILE), required=False)
    except ModelDirError as exc:
        warnings.append(str(exc))
    if isinstance(index, dict):
        meta = index.get("metadata")
        declared = meta.get("total_size") if isinstance(meta, dict) else None
        total = _as_int(declared)
        if total is not None and total > 0:
            return total, "safetensors_index", None
        # A size that cannot be one (negative, not a whole number) is never the weight size; 0 is what a
        # converter that did not count writes, and falls back to the headers quietly.
        if declared is not None and total != 0:
            warnings.append(
                f"{SAFETENSORS_INDEX_FILE}: metadata.total_size is {declared!r}, not a size in bytes; "
                "the index is corrupt (fetch it again), so the value is ignored"
            )
    if not read_headers:
        return None, None, None
    shards = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not shards:
        return None, None, None
    total = 0
    dtypes = {}
    for shard in shards:
        try:
            size, per_dtype = _header_bytes(safetensors_header(os.path.join(model_dir, shard)))
        except (ModelDirError, OSError) as exc:
            warnings.append(f"weight size from headers skipped: {exc}")
            return None, None, None
        total += size
        for dtype, count in per_dtype.items():
            dtypes[dtype] = dtypes.get(dtype, 0) + count
    return total, "safetensors_headers", dtypes


def read_model_dir(model_dir, read_headers=True):
    """The architecture document for a model directory (raises ModelDirError for fatal problems)."""
    problem = broken_link_problem(model_dir)
    if problem:
        raise ModelDirError(problem)
    if not os.path.exists(model_dir):
        raise ModelDirError(
            f"model directory {model_dir} does not exist; check the model path variable "
            "(regen_model_path) or download the model first"
        )
    if not os.path.isdir(model_dir):
        raise ModelDirError(
            f"{model_dir} is not a directory; point the model path at the directory holding config.json"
        )
    config = read_json(os.path.join(model_dir, CONFIG_FILE))
    extra_warnings = []
    generation = None
    quant = None
    for name in (GENERATION_CONFIG_FILE, HF_QUANT_CONFIG_FILE):
        try:
            loaded = read_json(os.path.join(model_dir, name), required=False)
        except ModelDirError as exc:
            extra_warnings.append(f"{exc} (ignored)")
            continue
        if name == GENERATION_CONFIG_FILE:
            generation = loaded
        else:
            quant = loaded
    arch = normalize_config(config, generation, quant)
    arch["warnings"] = extra_warnings + arch["warnings"]
    size, source, dtypes = weight_bytes_from_dir(model_dir, arch["warnings"], read_headers)
    if size is None:
        size, source = estimate_weight_bytes(arch), "estimate"
        if size is None:
            source = None
    arch["weight_bytes"] = size
    arch["weight_bytes_source"] = source
    if dtypes:
        arch["weight_bytes_by_dtype"] = dtypes
    arch["files"] = sorted(n for n in os.listdir(model_dir) if re.match(r".+\.(json|jinja|model|py|txt)$", n))
    return arch
