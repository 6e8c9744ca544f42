"""Layer layout, parameter counts and checkpoint bytes of a model from its config.json alone.

Standard library only and free of I/O (it ships inside modules that run on target hosts). The config
reader (regen_config) calls it; the plan reads its output through the architecture document.

Three things live here, each a pure function over the parsed config:

* `layer_pattern`: what every decoder layer holds, one character per layer for the token mixer
  (A full attention, S sliding-window attention, L linear attention: gated DeltaNet / Kimi Delta
  Attention, M Mamba-2, - none) and one for the MLP (D dense, E routed experts, - none). Read from the
  keys each hybrid family writes: `layer_types` (Qwen3.5, gpt-oss, Gemma), `full_attention_interval`
  (Qwen3-Next), `linear_attn_config.full_attn_layers` (Kimi Linear / Kimi K3, 1-based),
  `hybrid_override_pattern` (Nemotron-H: M mamba, * attention, - MLP, E MoE) and `layers_block_type`
  (Nemotron-3 Ultra / Lightning, where it is the only layer count). Only A and S layers keep a KV cache
  per token; L and M layers hold a fixed state per request (`recurrent_state_bytes`).
* `count_parameters`: parameters per component (attention, linear mixers, dense MLPs, routed and shared
  experts, latent-MoE projections, embeddings, LM head, the vision tower, MTP layers).
* `weight_bytes`: checkpoint bytes from those components and the quantization scheme, each component
  at its own precision: ignore/exclude lists honoured (glob, `re:` regex and substring entries, as the
  quantizers match them), ModelOpt's `quant_algo` (NVFP4 in `quant_algo`, not in `quant_method`) and its
  per-layer MIXED_PRECISION table, compressed-tensors INT4 and MXFP4 groups, block and per-tensor FP8.
"""

from __future__ import annotations

import fnmatch
import math
import re

# Bits per weight of each scheme: the element plus its share of the scales. NVFP4 keeps an FP8 (E4M3)
# scale per 16 weights (+0.5 bit) and a per-tensor FP32 scale (negligible); MXFP4/MXFP8 an E8M0 scale
# per 32 (+0.25); INT4 group quantization (compressed-tensors pack-quantized, AWQ/GPTQ) a 16-bit scale per
# group (+16/group); block FP8 an FP32 scale per 128x128 block (+32/16384); per-tensor and per-channel
# FP8 a scale per tensor or row (negligible).
NVFP4_BITS = 4 + 8 / 16
MXFP4_BITS = 4 + 8 / 32
MXFP8_BITS = 8 + 8 / 32
FP8_BITS = 8.0
# ModelOpt quant_algo names (hf_quant_config.json, quantized_layers entries) -> bits per weight.
MODELOPT_ALGOS = {
    "NVFP4": NVFP4_BITS,
    "W4A16_NVFP4": NVFP4_BITS,
    "W4A8_NVFP4_FP8": NVFP4_BITS,
    "MXFP4": MXFP4_BITS,
    "W4A16_MXFP4": MXFP4_BITS,
    "MXFP8": MXFP8_BITS,
    "FP8": FP8_BITS,
    "FP8_PER_CHANNEL_PER_TOKEN": FP8_BITS,
    "FP8_PB_WO": FP8_BITS,
    "W4A8_AWQ": 4 + 16 / 128,
    "W4A16_AWQ": 4 + 16 / 128,
    "INT4_AWQ": 4 + 16 / 128,
    "INT8_SQ": 8.0,
    "W8A8_SQ_PER_CHANNEL": 8.0,
}

# Wrapper prefixes stripped from module names and from ignore entries before they are compared, so that
# `language_model.model.layers.0*` (Kimi K2.6), `model.layers.*.self_attn` (gpt-oss) and
# `backbone.layers.0.mixer*` (Nemotron-H) all speak of `layers.N....`.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "backbone.")
# Module names of the vision tower and projector in the wrappers these configs describe.
VISION_NAMES = ("vision_tower", "visual", "vision_model", "mm_projector", "multi_modal_projector",
                "patch_merge_mlp")


def _int(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)
    return None


def _first(scopes, *keys):
    for scope in scopes:
        if not isinstance(scope, dict):
            continue
        for key in keys:
            value = _int(scope.get(key))
            if value is not None and value > 0:
                return value
    return None


# --------------------------------------------------------------------------------------------------
# Layer layout
# --------------------------------------------------------------------------------------------------

_NEMOTRON_PATTERN = {"M": ("M", "-"), "*": ("A", "-"), "-": ("-", "D"), "E": ("-", "E")}
_BLOCK_TYPES = {"mamba": ("M", "-"), "attention": ("A", "-"), "mlp": ("-", "D"), "moe": ("-", "E")}
_LAYER_TYPES = {"full_attention": "A", "attention": "A", "sliding_attention": "S", "sliding_window": "S",
                "linear_attention": "L", "mamba": "M"}


def layer_pattern(text, num_layers, moe_layer_ids=None):
    """{"mixer": str, "mlp": str, "source": str}: one character per decoder layer, or None.

    `moe_layer_ids`: the layers whose MLP is routed experts, for families that say so through dense
    prefixes and sparse steps (regen_config._moe); ignored where the pattern itself names them.
    """
    text = text if isinstance(text, dict) else {}
    pattern = text.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern and set(pattern) <= set(_NEMOTRON_PATTERN):
        pairs = [_NEMOTRON_PATTERN[c] for c in pattern]
        return _pattern(pairs, "hybrid_override_pattern (Nemotron-H: M mamba, * attention, - MLP, E MoE)")
    blocks = text.get("layers_block_type")
    if isinstance(blocks, list) and blocks and all(b in _BLOCK_TYPES for b in blocks):
        return _pattern([_BLOCK_TYPES[b] for b in blocks], "layers_block_type (Nemotron-H)")
    if not num_layers:
        return None
    moe_ids = set(moe_layer_ids or ())
    mlp = ["E" if i in moe_ids else "D" for i in range(num_layers)]
    linear = text.get("linear_attn_config")
    full = linear.get("full_attn_layers") if isinstance(linear, dict) else None
    if isinstance(full, list) and full and all(_int(v) is not None for v in full):
        # Kimi Linear / Kimi K3 number the full-attention (MLA) layers from 1; the rest are KDA layers.
        full_ids = {int(v) - 1 for v in full}
        mixers = ["A" if i in full_ids else "L" for i in range(num_layers)]
        return _pattern(list(zip(mixers, mlp, strict=True)), "linear_attn_config.full_attn_layers "
                        "(1-based: MLA there, Kimi Delta Attention elsewhere)")
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers and all(isinstance(t, str) for t in types):
        mixers = [_LAYER_TYPES.get(t, "A") for t in types]
        return _pattern(list(zip(mixers, mlp, strict=True)), "layer_types")
    interval = _int(text.get("full_attention_interval"))
    if interval and (text.get("linear_num_value_heads") is not None
                     or text.get("linear_num_key_heads") is not None):
        mixers = ["A" if (i + 1) % interval == 0 else "L" for i in range(num_layers)]
        return _pattern(list(zip(mixers, mlp, strict=True)),
                        f"full_attention_interval {interval} (gated DeltaNet between)")
    return _pattern([("A", m) for m in mlp], "every layer full attention")


def _pattern(pairs, source):
    return {"mixer": "".join(p[0] for p in pairs), "mlp": "".join(p[1] for p in pairs), "source": source}


# --------------------------------------------------------------------------------------------------
# Parameters per component
# --------------------------------------------------------------------------------------------------


def _mlp_matrices(text):
    """3 for gated MLPs (SwiGLU: gate, up, down), 2 for plain ones (Nemotron-H's relu2: up, down)."""
    act = text.get("mlp_hidden_act") or text.get("hidden_act") or text.get("hidden_activation")
    return 2 if act in ("relu2", "gelu_new_plain") else 3


def full_attention_params(attention, hidden):
    """Parameters of one full-attention layer's projections (MLA or MHA/GQA)."""
    heads = attention.get("heads") or 0
    if attention.get("kind") == "mla":
        nope, rope = attention.get("qk_nope_head_dim") or 0, attention.get("qk_rope_head_dim") or 0
        v_dim = attention.get("v_head_dim") or 0
        kv_rank, q_rank = attention.get("kv_lora_rank") or 0, attention.get("q_lora_rank")
        q_proj = (hidden * q_rank + q_rank * heads * (nope + rope) if q_rank
                  else hidden * heads * (nope + rope))
        return q_proj + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    head_dim = attention.get("head_dim") or 0
    kv_heads = attention.get("kv_heads") or heads
    return hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def _linear_mixer_params(text, attention, hidden):
    """One linear-attention layer: gated DeltaNet (Qwen3-Next/3.5: q, k, v, z in, out) or Kimi Delta
    Attention (q, k, v, gate, out over linear_attn_config's heads); small gates and convolutions left out."""
    linear = attention.get("linear") or {}
    nk, nv = linear.get("key_heads") or 0, linear.get("value_heads") or 0
    dk, dv = linear.get("key_head_dim") or 0, linear.get("value_head_dim") or 0
    if nk and nv and dk and dv:
        return hidden * (2 * nk * dk + 2 * nv * dv) + nv * dv * hidden
    kda = text.get("linear_attn_config") if isinstance(text.get("linear_attn_config"), dict) else {}
    heads = _int(kda.get("num_heads")) or attention.get("heads") or 0
    head_dim = _int(kda.get("head_dim")) or attention.get("head_dim") or 0
    return 5 * hidden * heads * head_dim


def mamba_dims(text, hidden):
    """(inner width, heads, head dim, groups, state size, conv kernel) of a Mamba-2 mixer, or None."""
    heads = _int(text.get("mamba_num_heads"))
    head_dim = _int(text.get("mamba_head_dim"))
    if not (heads and head_dim):
        expand = _int(text.get("expand")) or 2
        inner = expand * hidden if hidden else None
        if not inner:
            return None
        head_dim = head_dim or 64
        heads = inner // head_dim
    groups = _int(text.get("n_groups")) or 1
    state = _int(text.get("ssm_state_size")) or 128
    conv = _int(text.get("conv_kernel")) or 4
    return heads * head_dim, heads, head_dim, groups, state, conv


def _mamba_params(text, hidden):
    dims = mamba_dims(text, hidden)
    if not dims:
        return 0
    inner, heads, _hd, groups, state, _conv = dims
    return hidden * (2 * inner + 2 * groups * state + heads) + inner * hidden


def vision_params(config):
    """Parameters of the vision tower and its projector from `vision_config` (an estimate: L blocks of
    4h^2 attention + 2hi MLP, the patch embedding, and a merger from h x merge to the text width)."""
    vision = config.get("vision_config") if isinstance(config, dict) else None
    if not isinstance(vision, dict):
        return 0
    layers = _first([vision], "vt_num_hidden_layers", "depth", "num_hidden_layers", "num_layers")
    width = _first([vision], "vt_hidden_size", "hidden_size", "embed_dim", "width")
    if not (layers and width):
        return 0
    inner = _first([vision], "vt_intermediate_size", "intermediate_size") or 4 * width
    patch = _first([vision], "patch_size") or 14
    temporal = _first([vision], "temporal_patch_size") or 1
    channels = _first([vision], "in_channels", "num_channels") or 3
    merge = vision.get("merge_kernel_size")
    if isinstance(merge, list) and merge and all(_int(m) for m in merge):
        factor = math.prod(int(m) for m in merge)
    else:
        factor = (_first([vision], "spatial_merge_size") or 1) ** 2
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out = _first([vision], "out_hidden_size", "text_hidden_size", "projector_output_dim") or _first(
        [text], "hidden_size") or width
    merged = width * factor
    mergers = 1 + (len(vision.get("deepstack_visual_indexes") or [])
                   if isinstance(vision.get("deepstack_visual_indexes"), list) else 0)
    blocks = layers * (4 * width * width + 2 * width * inner)
    return blocks + channels * temporal * patch * patch * width + mergers * (merged * merged + merged * out)


def layer_components(pattern, units):
    """[{component: params}] for every decoder layer, from the layer pattern and the per-kind sizes."""
    layers = []
    for mixer, mlp in zip(pattern["mixer"], pattern["mlp"], strict=True):
        parts = {}
        if mixer in "AS":
            parts["attention"] = units.get("attention", 0)
        elif mixer == "L":
            parts["linear_attention"] = units.get("linear_attention", 0)
        elif mixer == "M":
            parts["mamba"] = units.get("mamba", 0)
        if mlp == "D":
            parts["dense_mlp"] = units.get("dense_mlp", 0)
        elif mlp == "E":
            for name in ("routed_experts", "shared_experts", "router", "latent_projection"):
                if units.get(name):
                    parts[name] = units[name]
        layers.append({k: v for k, v in parts.items() if v})
    return layers


def count_parameters(arch, text, config, pattern):
    """{components: {name: params}, per_layer: [...], total, active, ...}: the parameter count by
    component. `total` is the language model without MTP layers and vision tower (what the layers of the
    served text model hold); `vision_params` and `mtp_params` are counted apart."""
    hidden, layers, vocab = arch.get("hidden_size"), arch.get("num_layers"), arch.get("vocab_size")
    attention, moe = arch.get("attention") or {}, arch.get("moe")
    if not hidden or not layers or not pattern:
        return None
    mats = _mlp_matrices(text)
    full_attn = full_attention_params(attention, hidden)
    linear = _linear_mixer_params(text, attention, hidden)
    mamba = _mamba_params(text, hidden)
    dense_width = arch.get("intermediate_size") or 0
    dense = mats * hidden * dense_width
    routed = shared = router = latent = per_expert = 0
    experts = top_k = 0
    if moe:
        experts, top_k = moe["routed_experts"], moe.get("experts_per_token") or 0
        # Latent MoE (Kimi K3 routed_expert_hidden_size, Nemotron-3 moe_latent_size): the routed experts
        # work in a narrower space, with one projection down and one up around them per layer.
        expert_width = moe.get("routed_expert_hidden_size") or hidden
        per_expert = mats * expert_width * (moe.get("expert_intermediate_size") or 0)
        routed = experts * per_expert
        latent = 2 * hidden * expert_width if expert_width != hidden else 0
        shared = mats * hidden * (moe.get("shared_expert_intermediate_size") or 0)
        router = hidden * experts
    units = {"attention": full_attn, "linear_attention": linear, "mamba": mamba, "dense_mlp": dense,
             "routed_experts": routed, "shared_experts": shared, "router": router,
             "latent_projection": latent}
    components = {}
    for parts in layer_components(pattern, units):
        for name, value in parts.items():
            components[name] = components.get(name, 0) + value
    components["embedding"] = (vocab or 0) * hidden
    components["lm_head"] = 0 if arch.get("tie_word_embeddings") else (vocab or 0) * hidden
    total = sum(components.values())
    moe_layer_count = pattern["mlp"].count("E")
    active = total - moe_layer_count * (experts - top_k) * per_expert if moe else total
    mtp = (arch.get("mtp_layers") or 0) * (full_attn + (routed + shared + router + latent if moe else dense))
    return {
        "total": total,
        "active": active,
        "components": {k: v for k, v in components.items() if v},
        # Parameters of one layer's component, by kind: with the layer pattern they give every layer.
        "per_layer_unit": {k: v for k, v in units.items() if v},
        "routed_expert_params": components.get("routed_experts", 0) if moe else None,
        "attention_params": components.get("attention", 0) + components.get("linear_attention", 0),
        "vision_params": vision_params(config),
        "mtp_params": mtp,
        "note": ("estimate from shapes; norms, biases and convolutions not counted; MTP layers and the "
                 "vision tower counted apart"),
    }


# --------------------------------------------------------------------------------------------------
# Quantization scheme and bytes
# --------------------------------------------------------------------------------------------------


def _strip(name):
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def ignored(name, patterns):
    """True when module `name` is matched by one of the quantizer's ignore/exclude entries.

    compressed-tensors writes `re:<regex>` (re.match on the full module name) and plain names; ModelOpt
    writes fnmatch globs (`language_model.model.layers.0*`); transformers' `modules_to_not_convert` is
    matched as a substring. A module whose parent is excluded is excluded too.
    """
    bare = _strip(name)
    candidates = (name, bare, "model." + bare, "language_model.model." + bare, "backbone." + bare)
    for pattern in patterns or ():
        if not isinstance(pattern, str) or not pattern:
            continue
        if pattern.startswith("re:"):
            try:
                regex = re.compile(pattern[3:])
            except re.error:
                continue
            if any(regex.match(c) for c in candidates):
                return True
            continue
        glob = _strip(pattern)
        if any(ch in glob for ch in "*?["):
            if fnmatch.fnmatchcase(bare, glob) or fnmatch.fnmatchcase(bare, glob + ".*"):
                return True
            continue
        if glob == bare or bare.startswith(glob + ".") or pattern in name or glob in bare:
            return True
    return False


# Representative module names per component (one Linear of each) in each naming convention the field's
# checkpoints use; the quantizer's ignore list is matched against these.
_DEFAULT_NAMES = {
    "attention": "layers.{i}.self_attn.o_proj",
    "linear_attention": "layers.{i}.linear_attn.out_proj",
    "mamba": "layers.{i}.mixer.out_proj",
    "dense_mlp": "layers.{i}.mlp.down_proj",
    "routed_experts": "layers.{i}.mlp.experts.0.down_proj",
    "shared_experts": "layers.{i}.mlp.shared_experts.down_proj",
    "latent_projection": "layers.{i}.mlp.latent_proj",
    "lm_head": "lm_head",
}
_CONVENTIONS = {
    # Kimi Linear / K3 keep their KDA layers under self_attn too.
    "kimi": {"linear_attention": "layers.{i}.self_attn.o_proj"},
    "qwen": {"shared_experts": "layers.{i}.mlp.shared_expert.down_proj"},
    "nemotron": {"attention": "layers.{i}.mixer.o_proj", "dense_mlp": "layers.{i}.mixer.down_proj",
                 "routed_experts": "layers.{i}.mixer.experts.0.down_proj",
                 "shared_experts": "layers.{i}.mixer.shared_experts.down_proj",
                 "latent_projection": "layers.{i}.mixer.fc1_latent_proj"},
    "minimax": {"routed_experts": "layers.{i}.block_sparse_moe.experts.0.w2"},
    "deepseek_v4": {"attention": "layers.{i}.attn.wo", "dense_mlp": "layers.{i}.ffn.w2",
                    "routed_experts": "layers.{i}.ffn.experts.0.w2",
                    "shared_experts": "layers.{i}.ffn.shared_experts.w2"},
    # Gemma 4's MoE layers keep a dense MLP and the experts side by side.
    "gemma4": {"routed_experts": "layers.{i}.experts.0.down_proj"},
}


def naming_convention(model_types):
    """The module-naming convention of a family (by its model types), for matching ignore lists."""
    joined = " ".join(t for t in model_types if isinstance(t, str))
    for key, needle in (("nemotron", "nemotron_h"), ("minimax", "minimax"), ("deepseek_v4", "deepseek_v4"),
                        ("deepseek_v4", "deepseek_ref"), ("gemma4", "gemma4"), ("kimi", "kimi_lin"),
                        ("qwen", "qwen")):
        if needle in joined:
            return key
    return "default"


def component_name(component, layer, convention="default"):
    template = _CONVENTIONS.get(convention, {}).get(component) or _DEFAULT_NAMES.get(component)
    return template.format(i=layer) if template else None


# Never quantized by any scheme in these checkpoints: embeddings (not Linear), routers (kept in full
# precision by every recipe seen), the vision tower (left in the model's dtype by ModelOpt and
# llm-compressor recipes; the Kimi and Qwen NVFP4 exclude lists name it).
_NEVER_QUANTIZED = ("embedding", "router", "vision")


def quant_scheme(quant):
    """{name, bits, why} of the checkpoint's uniform scheme, or None when it has none we can size (then
    every component counts at the model's dtype). MIXED_PRECISION schemes are sized per layer instead."""
    if not quant:
        return None
    method = (quant.get("method") or "").lower()
    algo = (quant.get("algo") or "").upper()
    fmt = (quant.get("format") or "").lower()
    wtype = (quant.get("weight_type") or "").lower()
    bits, group = quant.get("bits"), quant.get("group_size")
    if algo in MODELOPT_ALGOS:
        return {"name": f"modelopt {algo}", "bits": MODELOPT_ALGOS[algo],
                "why": f"ModelOpt quant_algo {algo}: {MODELOPT_ALGOS[algo]:g} bits per weight with scales"}
    if "mxfp4" in method or "mxfp4" in fmt or (wtype == "float" and bits == 4 and group == 32):
        return {"name": "mxfp4", "bits": MXFP4_BITS,
                "why": "MXFP4: 4-bit weights + an E8M0 scale per 32 = 4.25 bits"}
    if "nvfp4" in method or "nvfp4" in fmt or (wtype == "float" and bits == 4 and group == 16):
        return {"name": "nvfp4", "bits": NVFP4_BITS,
                "why": "NVFP4: 4-bit weights + an FP8 scale per 16 = 4.5 bits"}
    block = quant.get("weight_block_size")
    if bits == 8 and block and len(block) == 2 and all(block):
        extra = 32 / (block[0] * block[1])
        return {"name": "fp8 block", "bits": 8 + extra,
                "why": f"block FP8: 8-bit weights + an FP32 scale per {block[0]}x{block[1]} block"}
    if bits == 8:
        return {"name": "fp8", "bits": FP8_BITS, "why": "FP8 weights with per-tensor/per-channel scales"}
    if bits and bits < 8 and group:
        total = bits + 16 / group
        return {"name": f"int{bits} group {group}", "bits": total,
                "why": f"INT{bits} groups of {group}: {bits} bits + a 16-bit scale per group = {total:g} "
                       "bits"}
    if bits:
        return {"name": f"{bits}-bit", "bits": float(bits), "why": f"{bits}-bit weights"}
    return None


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _classify(name):
    """The component a module name of a ModelOpt quantized_layers table belongs to."""
    bare = _strip(name)
    if bare.startswith("lm_head"):
        return "lm_head"
    if bare.startswith("mtp"):
        return None
    if "shared_expert" in bare:
        return "shared_experts"
    if ".experts" in bare:
        return "routed_experts"
    if "linear_attn" in bare:
        return "linear_attention"
    if "attn" in bare or bare.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return "attention"
    if ".mixer.in_proj" in bare or ".mixer.out_proj" in bare:
        return "mamba"
    if ".mlp." in bare or ".ffn." in bare or ".mixer." in bare:
        return "dense_mlp"
    return None


def mixed_table(layers):
    """{"component.layer": bits} ("component.*" without a layer) from ModelOpt's `quantized_layers`
    {module: {quant_algo}}; modules of no known component (MTP, gates) are left out."""
    table = {}
    for name, spec in (layers or {}).items():
        algo = (spec.get("quant_algo") if isinstance(spec, dict) else None) or ""
        bits = MODELOPT_ALGOS.get(str(algo).upper())
        component = _classify(str(name))
        if bits is None or component is None:
            continue
        match = _LAYER_NUMBER.search("." + _strip(str(name)))
        key = f"{component}.{match.group(1) if match else '*'}"
        table[key] = max(bits, table.get(key, 0))
    return table


def weight_bytes(arch, params, dtype_bytes):
    """(bytes, breakdown): the checkpoint's weight bytes from the parameter components and the scheme.

    breakdown: {scheme, components: {name: {params, quantized_params, bytes}}, reason}. The MTP layers are
    left out (SGLang loads them only for MTP speculative decoding); the vision tower is counted."""
    if not params or not params.get("total"):
        return None, None
    quant = arch.get("quantization") or {}
    scheme = quant_scheme(quant)
    mixed = quant.get("mixed_precision") or None
    patterns = quant.get("ignores") or []
    convention = naming_convention((arch.get("model_type"), arch.get("text_model_type")))
    breakdown = {}

    def add(component, count, bits_per_weight):
        entry = breakdown.setdefault(component, {"params": 0, "quantized_params": 0, "bytes": 0.0})
        entry["params"] += count
        if bits_per_weight is not None:
            entry["quantized_params"] += count
            entry["bytes"] += count * bits_per_weight / 8
        else:
            entry["bytes"] += count * dtype_bytes

    def bits_for(component, layer):
        if component in _NEVER_QUANTIZED:
            return None
        name = component_name(component, layer, convention)
        if name and ignored(name, patterns):
            return None
        if mixed is not None:
            return mixed.get(f"{component}.{layer}") or mixed.get(f"{component}.*")
        if scheme is None:
            return None
        if component == "lm_head" and not patterns:
            # No scheme here quantizes the LM head unless its table says so; with an ignore list, the list
            # decides (every list in the field names it).
            return None
        return scheme["bits"]

    pattern = arch.get("layer_pattern")
    per_layer = layer_components(pattern, params.get("per_layer_unit") or {}) if pattern else []
    for index, parts in enumerate(per_layer):
        for component, count in parts.items():
            add(component, count, bits_for(component, index))
    comps = params.get("components") or {}
    add("embedding", comps.get("embedding", 0), None)
    if comps.get("lm_head"):
        add("lm_head", comps["lm_head"], bits_for("lm_head", None))
    if params.get("vision_params"):
        add("vision", params["vision_params"], None)
    total = int(sum(e["bytes"] for e in breakdown.values()))
    for entry in breakdown.values():
        entry["bytes"] = int(entry["bytes"])
    quantized = sum(e["quantized_params"] for e in breakdown.values())
    if mixed is not None:
        scheme_text = f"ModelOpt MIXED_PRECISION (per-layer table: {len(mixed)} component/layer entries)"
    elif scheme:
        scheme_text = scheme["why"]
    else:
        scheme_text = "no quantization"
    reason = (f"{quantized:,} of {sum(e['params'] for e in breakdown.values()):,} parameters quantized "
              f"({scheme_text}), the rest at {dtype_bytes:g} B"
              + (f"; ignore list of {len(patterns)} entries honoured" if patterns else ""))
    return total, {"scheme": scheme["name"] if scheme and mixed is None else ("mixed" if mixed else None),
                   "components": breakdown, "reason": reason}


def recurrent_state_bytes(arch, text, pattern):
    """(bytes per request, reason) of the fixed state linear-attention and Mamba layers keep instead of a
    KV cache (FP32 recurrent states, the model dtype's convolution windows), or (0, None)."""
    if not pattern:
        return 0, None
    hidden = arch.get("hidden_size") or 0
    linear_layers, mamba_layers = pattern["mixer"].count("L"), pattern["mixer"].count("M")
    parts, total = [], 0
    if linear_layers:
        linear = (arch.get("attention") or {}).get("linear") or {}
        kda = text.get("linear_attn_config") if isinstance(text.get("linear_attn_config"), dict) else {}
        heads = linear.get("value_heads") or _int(kda.get("num_heads")) or 0
        dk = linear.get("key_head_dim") or _int(kda.get("head_dim")) or 0
        dv = linear.get("value_head_dim") or _int(kda.get("head_dim")) or 0
        per_layer = heads * dk * dv * 4
        total += linear_layers * per_layer
        parts.append(f"{linear_layers} linear-attention layers x {heads} heads x {dk}x{dv} x 4 B")
    if mamba_layers:
        dims = mamba_dims(text, hidden)
        if dims:
            inner, heads, head_dim, groups, state, conv = dims
            per_layer = heads * head_dim * state * 4 + (inner + 2 * groups * state) * (conv - 1) * 2
            total += mamba_layers * per_layer
            parts.append(f"{mamba_layers} Mamba layers x ({heads} heads x {head_dim} x {state} state x 4 B "
                         f"+ conv window {conv - 1} x {inner + 2 * groups * state} x 2 B)")
    if not total:
        return 0, None
    return int(total), " + ".join(parts) + f" = {total:,} B per request"
