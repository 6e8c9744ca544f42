"""The plan: serving parallelism, generation kwargs and drafter settings, each with a one-line reason.

Pure functions over the facts documents (architecture, tokenizer, GPU); family-specific choices (SGLang
parsers, thinking switches) come from the model-family registry (regen_families). This module also owns
the plan's format: every entry is `{"value": v, "reason": "..."}`, and `plan_value` / `plan_entry` /
`plan_values` are the one way to read it back (a bare value, as an inventory override may give, is
accepted too). The DFlash target-layer choice lives here once (`dflash_target_layer_ids`); the drafter
module reuses it.
"""

from __future__ import annotations

import math

from . import regen_budget, regen_estimate, regen_kernel_tables, regen_simulator, regen_sweep
from .regen_attention_backends import backend_for_facts
from .regen_config import DTYPE_BYTES, kv_cache_bytes_per_token
from .regen_families import THINKING_SWITCHES, family_of
from .regen_gpu import nccl_decision

GIB = 1024**3
DEFAULTS = {
    "mem_fraction_static": 0.85,
    "kv_cache_tokens": 65536,
    "num_draft_layers": 5,
    "block_size": 16,
    # DP attention is planned only when it at least doubles the server's KV capacity (MLA on TP ranks).
    "attn_dp_min_gain": 2.0,
}

PLAN_KEYS = {
    "serving": (
        "device",
        "tp_size",
        "ep_size",
        "dp_size",
        "fits",
        "mem_fraction_static",
        "kv_cache_tokens",
        "kv_cache_dtype",
        "context_length",
        "memory",
        "attention_backend",
        "attn_dp_size",
        "kv_capacity",
        "quantization",
        "moe_runner_backend",
        "cuda_graph_max_bs",
        "ep_risk",
        "sglang_args",
    ),
    "generation": (
        "thinking_switch",
        "chat_template_kwargs",
        "stop_token_ids",
        "stop",
        "reasoning_parser",
        "tool_call_parser",
        "concurrency",
    ),
    "drafter": (
        "method",
        "num_draft_layers",
        "target_layer_ids",
        "block_size",
        "mask_token_id",
        "mask_token",
        "hidden_size",
        "vocab_size",
        "target_num_layers",
    ),
    # The NCCL settings of every multi-GPU process the pipeline starts (regen_gpu.nccl_decision).
    "nccl": ("serving", "capture", "training"),
    # How long generation and capture take and the disk the run needs (module_utils/regen_estimate.py).
    "estimate": ("run",),
    # The run's one length budget (module_utils/regen_budget.py): generation max_tokens, the server's
    # context length, tokenize/capture/training max_length and the evaluation prompt length read it.
    "length": (
        "prompt_set",
        "prompt_tokens",
        "max_tokens",
        "budget",
    ),
}


def nested(doc, *path):
    """The value at `path` in a facts document, None when any step is missing (the document is another
    stage's output, so every lookup tolerates absence)."""
    node = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def plan_value(entry):
    """The value of one plan entry: `{"value": v, "reason": ...}` -> v; a bare value is returned as is."""
    if isinstance(entry, dict) and "value" in entry:
        return entry["value"]
    return entry


def plan_entry(section, key):
    """(present, value, reason) of `section[key]`.

    An entry that is present with a null value is a decision ("no reasoning parser"), not a gap, so
    callers tell it apart from an absent key. A reason may also sit in a sibling `reasons` mapping.
    """
    if not isinstance(section, dict) or key not in section:
        return False, None, None
    entry = section[key]
    reason = entry.get("reason") if isinstance(entry, dict) and "value" in entry else None
    if reason is None:
        reasons = section.get("reasons")
        if isinstance(reasons, dict) and isinstance(reasons.get(key), str):
            reason = reasons[key]
    return True, plan_value(entry), reason


def plan_values(plan):
    """The whole plan with every entry unwrapped: {section: {key: value}} (non-mapping parts as they are)."""
    if not isinstance(plan, dict):
        return {}
    return {
        name: ({key: plan_value(entry) for key, entry in section.items()} if isinstance(section, dict)
               else section)
        for name, section in plan.items()
    }


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def tokenizer_unknown(tokenizer):
    """None when tokenizer facts are at hand, else {reason, remedy}: why the entries that depend on the
    tokenizer (thinking switch, stop ids, reasoning parser, mask token) are unknown and how to fix it."""
    if not isinstance(tokenizer, dict):  # None: not given ({} is a tokenizer with none of the features)
        return {
            "reason": "no tokenizer facts were given",
            "remedy": "run the introspect stage on a model directory that holds the tokenizer files",
        }
    if tokenizer.get("available") is False:
        missing = tokenizer.get("unavailable") or {}
        return {
            "reason": missing.get("reason") or "the tokenizer files could not be read",
            "remedy": missing.get("remedy") or "put the tokenizer files into the model directory and re-run "
            "the introspect stage",
        }
    return None


def unknown_entries(plan):
    """{"section.key": {reason, remedy}} for every plan entry that is unknown (not a decision: a stage that
    needs it must stop and say why, instead of reading its null as "none")."""
    found = {}
    for section, entries in (plan or {}).items():
        if not isinstance(entries, dict):
            continue
        for key, entry in entries.items():
            if isinstance(entry, dict) and entry.get("unknown") is True:
                reason = str(entry.get("reason") or "").removeprefix("unknown: ")
                found[f"{section}.{key}"] = {"reason": reason, "remedy": entry.get("remedy")}
    return found


def dflash_target_layer_ids(num_target_layers, num_draft_layers):
    """Target layers whose hidden states feed a DFlash drafter, exactly as SpecForge chooses them.

    `specforge.modeling.draft.dflash.build_target_layer_ids` (SpecForge 0.2.0): one draft layer reads the
    middle layer; n > 1 spread round(1 + i * (L - 4) / (n - 1)) for i in 0..n-1 (Python's round, which
    rounds halves to even: 29.5 -> 30). A drafter trained on other layers than the server feeds it is
    silently useless, so tests/unit/test_drafter_specforge.py compares this with SpecForge's own.
    """
    if not _positive_int(num_target_layers):
        raise ValueError(f"the target's num_layers must be a positive integer, got {num_target_layers!r}")
    if not _positive_int(num_draft_layers):
        raise ValueError(
            f"the number of draft layers must be a positive integer, got {num_draft_layers!r}; set "
            "drafter_training_num_draft_layers (or model_facts_plan_overrides.drafter.num_draft_layers)"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _gib(value):
    return "%.1f GiB" % (value / GIB)


def override_errors(overrides):
    """Messages for override sections or keys the plan does not have (a typo must not pass silently)."""
    if not isinstance(overrides, dict):
        return ["model_facts_plan_overrides must be a mapping of section to values"]
    errors = []
    for section, values in overrides.items():
        if section not in PLAN_KEYS or not isinstance(values, dict):
            errors.append(
                "model_facts_plan_overrides.{} is not a plan section; known: {}".format(
                    section, ", ".join(PLAN_KEYS)
                )
            )
            continue
        for key in values:
            if key not in PLAN_KEYS[section]:
                errors.append(
                    "model_facts_plan_overrides.{}.{} is not a plan value; known: {}".format(
                        section, key, ", ".join(PLAN_KEYS[section])
                    )
                )
    return errors


class _Planner:
    def __init__(self, overrides):
        self.overrides = overrides if isinstance(overrides, dict) else {}
        self.warnings = override_errors(self.overrides)

    def pick(self, section, key, value, reason):
        values = self.overrides.get(section)
        if isinstance(values, dict) and key in values:
            return {
                "value": values[key],
                "reason": f"set in inventory (model_facts_plan_overrides.{section}.{key})",
                "derived": value,
            }
        return {"value": value, "reason": reason}

    def unknown(self, section, key, why):
        """An entry nobody can derive from these facts: null, marked unknown, with reason and remedy (an
        inventory override still wins, since the user then knows the value)."""
        values = self.overrides.get(section)
        if isinstance(values, dict) and key in values:
            return self.pick(section, key, None, why["reason"])
        reason = f"unknown: {why['reason']}"
        return {"value": None, "reason": reason, "unknown": True, "remedy": why["remedy"]}


def tp_dividing_heads(needed, heads):
    """The smallest TP size of at least `needed` GPUs that divides the attention heads (SGLang shards
    heads evenly over TP ranks: Kimi K3's 96 heads take TP 96 or 48, never 64); powers of two first."""
    if not needed or not heads:
        return None
    for candidate in [2 ** k for k in range(0, 12)] + list(range(1, heads + 1)):
        if candidate >= needed and heads % candidate == 0:
            return candidate
    return None


def _kv_bytes_per_gpu(arch, tokens, tp):
    per_token = arch.get("kv_cache_bytes_per_token")
    if not per_token:
        return 0
    total = per_token * tokens
    att = arch["attention"]
    if att.get("kind") == "mla" or not att.get("kv_heads"):
        # MLA's latent is not split by heads: every TP rank keeps the whole cache.
        return total
    kv_heads = att["kv_heads"]
    return total * max(1, kv_heads // tp) / kv_heads


def _plan_mem_fraction(arch, gpu, planner, graph_bs=None):
    """serving.mem_fraction_static: on GPUs 1 - the stated margin per GPU (regen_budget.memory_margin,
    with the planned decode CUDA-graph batch); on CPU SGLang's usual share (it bounds nothing there)."""
    count = (gpu or {}).get("count") or 0
    per_gpu = (gpu or {}).get("memory_per_gpu_bytes") or 0
    if count and per_gpu:
        mla = (arch.get("attention") or {}).get("kind") == "mla"
        margin, margin_reason = regen_budget.memory_margin(per_gpu, count, mla, graph_bs)
        fraction, fraction_reason = regen_budget.mem_fraction_static(per_gpu, margin)
        return planner.pick("serving", "mem_fraction_static", fraction, f"{margin_reason}; {fraction_reason}")
    return planner.pick(
        "serving",
        "mem_fraction_static",
        DEFAULTS["mem_fraction_static"],
        "SGLang's static memory share for weights plus KV cache; the rest is activations",
    )


_KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1, "bf16": 2, "bfloat16": 2, "nvfp4": 0.5,
                   "fp4_mx_block16": 0.5}


def _plan_kv_cache_dtype(arch, device, backend, planner):
    """serving.kv_cache_dtype: from the (attention backend, KV dtype) table (regen_kernel_tables): the
    checkpoint's declared KV format where the backend reads it natively, bf16 where it does not (FlashInfer
    MLA); null (flag off: the model's dtype) when nothing is declared. Returns (entry, bytes per element)."""
    declared = (arch.get("quantization") or {}).get("kv_cache")
    if device == "cpu":
        entry = planner.pick("serving", "kv_cache_dtype", None,
                             "no GPU: SGLang's CPU backend keeps the model's dtype")
    else:
        kind = (arch.get("attention") or {}).get("kind")
        chosen = regen_kernel_tables.choose_kv_dtype(backend, kind, declared)
        reason = chosen["reason"]
        if chosen["row"]:
            reason += f" (KV dtype table row {chosen['row']}, sources: {'; '.join(chosen['sources'])})"
        if chosen["value"] is None:
            reason = f"{reason} ({_kv_dtype_name(arch)})"
        entry = planner.pick("serving", "kv_cache_dtype", chosen["value"], reason)
        entry["pair"] = [backend, entry["value"] or "auto"]
        if entry["value"] != chosen["value"] and entry["value"] in chosen["avoid"]:
            entry["reason"] += f"; warning: {chosen['avoid'][entry['value']]}"
            planner.warnings.append(f"serving.kv_cache_dtype={entry['value']} with {backend}: "
                                    f"{chosen['avoid'][entry['value']]}")
    value = entry["value"]
    if value is None:
        return entry, None
    return entry, _KV_DTYPE_BYTES.get(value)


def _kv_dtype_name(arch):
    return (arch.get("kv_cache_dtype") or {}).get("dtype") or arch.get("dtype") or "bfloat16"


def plan_serving(arch, gpu, planner, length=None, graph=None):
    """The serving section. `graph`: (decode CUDA-graph batch, reason) planned from the concurrency
    (make_plan's second pass); its memory comes out of the margin, so the static share follows it."""
    section = {}
    count = (gpu or {}).get("count") or 0
    mem_fraction = _plan_mem_fraction(arch, gpu, planner, graph[0] if graph else None)
    kv_tokens = planner.pick(
        "serving",
        "kv_cache_tokens",
        DEFAULTS["kv_cache_tokens"],
        "KV cache sized for this many tokens in flight across all requests",
    )
    section["mem_fraction_static"], section["kv_cache_tokens"] = mem_fraction, kv_tokens
    weights = arch.get("weight_bytes")
    heads = (arch.get("attention") or {}).get("heads") or 1
    moe = arch.get("moe")
    if count == 0:
        section["device"] = planner.pick(
            "serving", "device", "cpu", "no NVIDIA GPU found: serve on CPU (demo scale)"
        )
        section["tp_size"] = planner.pick("serving", "tp_size", 1, "no GPU: a single CPU worker")
        section["ep_size"] = planner.pick("serving", "ep_size", 1, "no GPU: nothing to spread experts over")
        section["dp_size"] = planner.pick("serving", "dp_size", 1, "no GPU: one replica")
        section["fits"] = planner.pick("serving", "fits", None, "no GPU memory to check against")
        section["attn_dp_size"] = planner.pick("serving", "attn_dp_size", 1, "no GPU: attention DP off")
        section["kv_capacity"] = planner.pick("serving", "kv_capacity", None, "no GPU memory to divide")
    else:
        section["device"] = planner.pick("serving", "device", "cuda", f"{count} NVIDIA GPU(s) found")
        # The (attention backend, KV dtype) pair first: the KV bytes per token the memory arithmetic below
        # counts are those of the pool the line asks for, not of the checkpoint's declaration.
        section["attention_backend"] = _plan_attention_backend(arch, gpu, section["device"]["value"], planner)
        section["kv_cache_dtype"], kv_bytes = _plan_kv_cache_dtype(
            arch, section["device"]["value"], section["attention_backend"]["value"], planner)
        if kv_bytes and kv_bytes != (arch.get("kv_cache_dtype") or {}).get("bytes"):
            value = section["kv_cache_dtype"]["value"]
            arch = dict(arch, kv_cache_dtype={"dtype": value, "bytes": kv_bytes,
                                              "source": "the plan's (attention backend, KV dtype) pair"})
            arch["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(arch, kv_bytes)
        per_gpu = gpu.get("memory_per_gpu_bytes") or 0
        usable = per_gpu * mem_fraction["value"]
        chosen = None
        tp = 1
        while tp <= count:
            if heads % tp == 0 and weights:
                need = weights / tp + _kv_bytes_per_gpu(arch, kv_tokens["value"], tp)
                if need <= usable:
                    chosen = (tp, need)
                    break
            tp *= 2
        if weights is None:
            tp_value, fits = 1, None
            reason = "weight size unknown: start with one GPU per replica"
            fit_reason = "weight size unknown"
        elif chosen:
            tp_value, fits = chosen[0], True
            reason = (
                f"weights {_gib(weights)} + KV for {kv_tokens['value']} tokens need {_gib(chosen[1])} "
                f"per GPU at TP{tp_value}, within {_gib(usable)} usable of {_gib(per_gpu)}"
            )
            fit_reason = f"fits at TP{tp_value}"
        else:
            largest = 1
            while largest * 2 <= count and heads % (largest * 2) == 0:
                largest *= 2
            kv = _kv_bytes_per_gpu(arch, kv_tokens["value"], largest)
            spare = usable - kv
            needed = math.ceil(weights / spare) if spare > 0 else None
            needed_tp = tp_dividing_heads(needed, heads) if needed else None
            tp_text = (f"TP{needed_tp}, which divides the {heads} attention heads" if needed_tp
                       else f"more GPUs than TP can use over {heads} heads: add pipeline stages")
            tp_value, fits = largest, False
            reason = f"largest power of two that divides {heads} heads on {count} GPUs"
            fit_reason = (
                f"does not fit: weights {_gib(weights)} need {needed if needed else 'more'} GPUs of "
                f"{_gib(per_gpu)} ({tp_text}) at mem fraction {mem_fraction['value']:.2f} with KV "
                f"for {kv_tokens['value']} tokens; this host has {count} (use more GPUs, a smaller "
                "quantization, or fewer KV tokens)"
            )
        section["tp_size"] = planner.pick("serving", "tp_size", tp_value, reason)
        section["fits"] = planner.pick("serving", "fits", fits, fit_reason)
        tp_value = section["tp_size"]["value"]
        if moe and tp_value > 1 and moe["routed_experts"] % tp_value == 0:
            ep_reason = (
                f"MoE with {moe['routed_experts']} routed experts: --ep-size {tp_value} keeps "
                f"{moe['routed_experts'] // tp_value} whole experts per GPU instead of "
                f"slicing every expert {tp_value} ways"
            )
            ep_value = tp_value
        elif moe and tp_value > 1:
            ep_value, ep_reason = (
                1,
                f"{moe['routed_experts']} experts do not divide over TP{tp_value}: tensor-parallel experts",
            )
        elif moe:
            ep_value, ep_reason = 1, "one GPU per replica: nothing to spread experts over"
        else:
            ep_value, ep_reason = 1, "dense model: no experts to spread"
        section["ep_size"] = planner.pick("serving", "ep_size", ep_value, ep_reason)
        dp_value = max(1, count // tp_value) if fits else 1
        dp_reason = (
            f"{count} GPUs / TP{tp_value}: {dp_value} data-parallel replicas for throughput"
            if dp_value > 1
            else "one replica uses the GPUs"
        )
        section["dp_size"] = planner.pick("serving", "dp_size", dp_value, dp_reason)
        attn_dp, attn_dp_reason, capacity, capacity_reason = _attention_dp(
            arch, per_gpu, mem_fraction["value"], kv_tokens["value"], tp_value, section["dp_size"]["value"],
            section["fits"]["value"],
        )
        section["attn_dp_size"] = planner.pick("serving", "attn_dp_size", attn_dp, attn_dp_reason)
        section["kv_capacity"] = planner.pick("serving", "kv_capacity", capacity, capacity_reason)
        numbers, memory_reason = regen_budget.kv_pool(
            arch, per_gpu, mem_fraction["value"], tp_value, attn_dp=section["attn_dp_size"]["value"] or 1,
            dp=section["dp_size"]["value"] or 1, attention_weight_bytes=_attention_weight_bytes(arch),
        )
        if numbers is not None:
            numbers["margin_bytes"] = int(per_gpu * (1 - mem_fraction["value"]))
        section["memory"] = planner.pick("serving", "memory", numbers, memory_reason)
        _plan_moe_kernels(section, arch, gpu, planner)
        bs, bs_reason = graph or (regen_budget.default_graph_batch(per_gpu, count),
                                  "SGLang's default decode graph batch for this GPU class (no concurrency "
                                  "planned yet)")
        section["cuda_graph_max_bs"] = planner.pick("serving", "cuda_graph_max_bs", bs, bs_reason)
    if count == 0:
        section["memory"] = planner.pick("serving", "memory", None, "no GPU memory to divide")
        section["kv_cache_dtype"], _ = _plan_kv_cache_dtype(arch, "cpu", None, planner)
        section["attention_backend"] = _plan_attention_backend(arch, gpu, "cpu", planner)
        for key in ("quantization", "moe_runner_backend", "ep_risk"):
            section[key] = planner.pick("serving", key, None, "no GPU: SGLang's GPU kernels do not apply")
        section["cuda_graph_max_bs"] = planner.pick("serving", "cuda_graph_max_bs", None,
                                                    "no GPU: no CUDA graphs")
    budget = plan_value((length or {}).get("budget"))
    section["context_length"] = planner.pick(
        "serving", "context_length", budget,
        f"the length budget (length.budget): {budget:,} tokens per request" if budget
        else "no length budget: the model's own maximum",
    )
    args = ["--tp-size", str(section["tp_size"]["value"])]
    if section["ep_size"]["value"] > 1:
        args += ["--ep-size", str(section["ep_size"]["value"])]
    if section["dp_size"]["value"] > 1:
        args += ["--dp-size", str(section["dp_size"]["value"])]
    if (section["attn_dp_size"]["value"] or 1) > 1:
        # SGLang 0.5.23's flag (the old --dp-size N --enable-dp-attention pair is deprecated).
        args += ["--attn-dp-size", str(section["attn_dp_size"]["value"])]
    if section["device"]["value"] == "cpu":
        args += ["--device", "cpu"]
    else:
        args += ["--mem-fraction-static", str(mem_fraction["value"])]
    if section["attention_backend"]["value"]:
        args += ["--attention-backend", str(section["attention_backend"]["value"])]
    if section["kv_cache_dtype"]["value"]:
        args += ["--kv-cache-dtype", str(section["kv_cache_dtype"]["value"])]
    for key, flag in (("quantization", "--quantization"), ("moe_runner_backend", "--moe-runner-backend"),
                      ("cuda_graph_max_bs", "--cuda-graph-max-bs-decode")):
        if section.get(key) and section[key]["value"]:
            args += [flag, str(section[key]["value"])]
    if section["context_length"]["value"]:
        args += ["--context-length", str(section["context_length"]["value"])]
    section["sglang_args"] = planner.pick("serving", "sglang_args", args, "the values above as SGLang flags")
    return section


def _plan_moe_kernels(section, arch, gpu, planner):
    """serving.quantization / moe_runner_backend from the MoE table (regen_kernel_tables), and the known
    risk of the planned expert parallelism on this GPU (serving.ep_risk)."""
    capabilities = sorted({c for c in (gpu or {}).get("compute_capabilities") or [] if c})
    cc = capabilities[0] if len(capabilities) == 1 else None
    chosen = regen_kernel_tables.choose_moe(cc, arch)
    reason = chosen["reason"]
    if chosen["row"]:
        reason += (f" (MoE table row {chosen['row']}, SGLang's own choice: {chosen['sglang_default']}; "
                   f"sources: {'; '.join(chosen['sources'])})")
    section["quantization"] = planner.pick("serving", "quantization", chosen["quantization"], reason)
    section["moe_runner_backend"] = planner.pick("serving", "moe_runner_backend",
                                                 chosen["moe_runner_backend"], reason)
    runner = section["moe_runner_backend"]["value"]
    if runner != chosen["moe_runner_backend"] and runner in chosen["avoid"]:
        section["moe_runner_backend"]["reason"] += f"; warning: {chosen['avoid'][runner]}"
        planner.warnings.append(f"serving.moe_runner_backend={runner}: {chosen['avoid'][runner]}")
    risk = regen_kernel_tables.ep_risk(cc, section["ep_size"]["value"])
    section["ep_risk"] = planner.pick("serving", "ep_risk", risk,
                                      "known public failure of this layout on this GPU" if risk
                                      else "no known public failure of this layout on this GPU")


def _attention_weight_bytes(arch):
    """Bytes of the attention weights (replicated on every attention-DP rank); None when unknown."""
    params = (arch.get("parameters") or {}).get("attention_params")
    if not params:
        return None
    dtype_bytes = DTYPE_BYTES.get((arch.get("dtype") or "bfloat16").lower(), 2)
    quant = arch.get("quantization") or {}
    # Kimi/DeepSeek INT4 checkpoints keep attention in bf16 (it is in the ignore list); FP8 block
    # quantization covers it.
    if quant.get("bits") and "attn" not in " ".join(quant.get("ignores") or []):
        return int(params * quant["bits"] / 8)
    return int(params * dtype_bytes)


def _tokens(count):
    return f"{count:,}"


def _attention_dp(arch, per_gpu, mem_fraction, kv_tokens, tp, dp, fits):
    """(attn_dp_size, reason, kv_capacity, reason): DP attention for MLA, with the KV arithmetic both ways.

    Without it every TP rank keeps the whole MLA latent cache of every request (the latent is not
    split by heads), so the server holds what one GPU's pool holds. With --attn-dp-size = TP each rank
    runs attention for its own requests: the pools add up, but the attention weights are replicated
    on every rank instead of split, which takes from each pool.
    """
    attention = arch.get("attention") or {}
    per_token = arch.get("kv_cache_bytes_per_token")
    weights = arch.get("weight_bytes")
    if attention.get("kind") != "mla":
        return 1, "not an MLA model: its KV cache is already split over the TP ranks by heads", None, (
            "KV split by heads over TP ranks")
    if tp <= 1:
        return 1, "one GPU per replica: no TP group to split attention over", None, "a single rank"
    attn_bytes = _attention_weight_bytes(arch)
    if not (per_token and weights and per_gpu and attn_bytes):
        return 1, "KV bytes per token, weight or attention-weight size unknown: attention DP off", None, (
            "not computable from these facts")
    usable = per_gpu * mem_fraction
    pool = usable - weights / tp
    pool_dp = usable - (weights - attn_bytes) / tp - attn_bytes
    plain = max(0, int(pool // per_token))
    per_rank = max(0, int(pool_dp // per_token))
    capacity = {
        "kv_bytes_per_token": per_token,
        "attention_weight_bytes": attn_bytes,
        "without_attn_dp": {"kv_pool_bytes_per_gpu": int(max(pool, 0)), "tokens": plain},
        "with_attn_dp": {"attn_dp_size": tp, "kv_pool_bytes_per_gpu": int(max(pool_dp, 0)),
                         "tokens_per_rank": per_rank, "tokens": per_rank * tp},
    }
    gain = (per_rank * tp / plain) if plain else None
    weights_dp = (weights - attn_bytes) / tp + attn_bytes
    arithmetic = (
        f"without attention DP every one of the {tp} TP ranks keeps the whole MLA cache: "
        f"({_gib(usable)} usable - {_gib(weights / tp)} weights) / {per_token} B per token = "
        f"{_tokens(plain)} tokens for the server; with --attn-dp-size {tp} the attention weights "
        f"({_gib(attn_bytes)}) sit on every rank: ({_gib(usable)} - {_gib(weights_dp)}) / {per_token} B = "
        f"{_tokens(per_rank)} tokens per rank, {_tokens(per_rank * tp)} in all"
        + (f" ({gain:.1f}x)" if gain else "")
    )
    if dp > 1:
        return 1, (f"{dp} whole replicas already (--dp-size): SGLang 0.5.23 does not combine them with "
                   "--attn-dp-size"), capacity, arithmetic
    if not fits:
        why = "the weights do not fit at this TP size: no room to replicate attention"
        return 1, why, capacity, arithmetic
    if per_rank < kv_tokens:
        return 1, (f"attention DP off: each rank's pool would hold {_tokens(per_rank)} tokens, under the "
                   f"{_tokens(kv_tokens)} tokens in flight the plan sizes for"), capacity, arithmetic
    if gain is None or gain < DEFAULTS["attn_dp_min_gain"]:
        return 1, (f"attention DP off: it would multiply KV capacity by only {gain or 0:.1f}x "
                   f"(planned from {DEFAULTS['attn_dp_min_gain']:.0f}x), not worth replicating attention"), (
            capacity), arithmetic
    return tp, (f"MLA over TP{tp}: attention DP multiplies the KV capacity by {gain:.1f}x for the "
                "throughput-bound generation job"), capacity, arithmetic


def _plan_attention_backend(arch, gpu, device, planner):
    """SGLang's --attention-backend from the backend table (module_utils/regen_attention_backends.py) for
    the GPU's compute capability and the model's attention kind; null, with the reason, on CPU, on mixed
    GPU generations or where no row covers the pair (SGLang then picks its own default at start-up)."""
    capabilities = sorted({c for c in (gpu or {}).get("compute_capabilities") or [] if c})
    if device == "cpu":
        value, reason, derived = None, "no GPU: SGLang's GPU attention backends do not apply", None
    elif len(capabilities) > 1:
        value, derived = None, None
        reason = (
            f"GPUs of several compute capabilities ({', '.join(capabilities)}): no one backend fits all; "
            "set sglang_server_attention_backend or serve on one GPU generation"
        )
    else:
        derived = backend_for_facts(arch, gpu_capability=capabilities[0] if capabilities else None)
        value, reason = derived["value"], derived["reason"]
        if derived["row"]:
            reason = f"{reason} (backend table row {derived['row']}, sources: {'; '.join(derived['source'])})"
    entry = planner.pick("serving", "attention_backend", value, reason)
    chosen = entry["value"]
    avoid = (derived or {}).get("avoid") or {}
    if chosen != value and chosen in avoid:
        warning = (
            f"model_facts_plan_overrides.serving.attention_backend={chosen}: the backend table advises "
            f"against it on compute capability {derived['compute_capability']}: {avoid[chosen]}"
        )
        entry["reason"] += f"; warning: {avoid[chosen]}"
        planner.warnings.append(warning)
    return entry


def plan_generation(arch, tokenizer, planner):
    unknown = tokenizer_unknown(tokenizer)
    if unknown:
        return _plan_generation_without_tokenizer(arch, unknown, planner)
    tokenizer = tokenizer or {}
    template = tokenizer.get("chat_template") or {}
    switch = template.get("thinking_switch")
    section = {}
    if switch in THINKING_SWITCHES:
        kwargs = {switch: THINKING_SWITCHES[switch]}
        if THINKING_SWITCHES[switch] is True:
            reason = "the chat template reads `{}` (source {})".format(switch, template.get("source"))
        else:
            reason = f"the chat template reads `{switch}` (low|medium|high)"
    else:
        kwargs, reason = {}, "the chat template has no thinking switch"
    section["thinking_switch"] = planner.pick("generation", "thinking_switch", switch, reason)
    section["chat_template_kwargs"] = planner.pick("generation", "chat_template_kwargs", kwargs, reason)
    stop_ids = []
    stop_text = []
    for token in tokenizer.get("end_of_turn") or []:
        if token.get("id") is not None and token["id"] not in stop_ids:
            stop_ids.append(token["id"])
            stop_text.append(token["content"])
    eos = (tokenizer.get("named") or {}).get("eos") or {}
    if eos.get("id") is not None and eos["id"] not in stop_ids:
        stop_ids.append(eos["id"])
        stop_text.append(eos["content"])
    for token_id in (arch.get("special_token_ids") or {}).get("eos") or []:
        if token_id not in stop_ids:
            stop_ids.append(token_id)
    section["stop_token_ids"] = planner.pick(
        "generation",
        "stop_token_ids",
        sorted(stop_ids),
        "end-of-turn tokens of the tokenizer plus the config's eos ids",
    )
    section["stop"] = planner.pick("generation", "stop", stop_text, "the same stop tokens as text")
    row = family_of(arch)
    family = row.model_type if row else arch.get("model_type")
    reasoning, tool = (row.reasoning_parser, row.tool_call_parser) if row else (None, None)
    always_reasons = bool(row and row.always_reasons)
    can_think = bool(tokenizer.get("think_tokens")) or switch is not None or always_reasons
    if reasoning and not can_think:
        reasoning_reason = (
            f"{family} family, but the tokenizer has no think tokens and the template no switch"
        )
        reasoning = None
    elif reasoning:
        reasoning_reason = f"SGLang's reasoning parser for the {family} family"
    else:
        reasoning_reason = f"no SGLang reasoning parser for model type {family}"
    section["reasoning_parser"] = planner.pick("generation", "reasoning_parser", reasoning, reasoning_reason)
    section["tool_call_parser"] = planner.pick(
        "generation",
        "tool_call_parser",
        tool,
        f"SGLang's tool-call parser for the {family} family"
        if tool
        else f"no SGLang tool-call parser known for model type {family}",
    )
    return section


def drafter_depth_and_block(arch):
    """Pure: the planned drafter depth and block size, each with its reason.

    A family with a published DFlash drafter (regen_families' drafter_recipe, the config SpecForge ships)
    gets that recipe's depth and block size: it is what has been trained and measured at that scale, and
    the target layers it reads then follow from SpecForge's own formula. Elsewhere SpecForge's defaults
    (5 layers, blocks of 16). A target too shallow for the depth gets fewer layers, so that the target
    layers stay distinct. A measured reason to differ goes into model_facts_plan_overrides.drafter.
    """
    layers = arch.get("num_layers")
    row = family_of(arch)
    recipe = row.drafter_recipe if row is not None else None
    if recipe is not None:
        depth = recipe.num_draft_layers
        depth_reason = f"{depth} draft layers, as the published drafter for this family ({recipe.source})"
        block = recipe.block_size
        block_reason = f"blocks of {block} tokens, as the published drafter for this family ({recipe.source})"
        if layers and layers != recipe.target_num_layers:
            note = f"; that drafter is for a {recipe.target_num_layers}-layer target, this one has {layers}"
            depth_reason += note
            block_reason += note
    else:
        depth = DEFAULTS["num_draft_layers"]
        depth_reason = f"SpecForge's default drafter depth ({depth}); no published drafter for this family"
        block = DEFAULTS["block_size"]
        block_reason = f"SpecForge's default block of {block} tokens; no published drafter for this family"
    if layers and layers - 3 < depth:
        depth = max(1, layers - 3)
        depth_reason = (
            f"the target has only {layers} layers: {depth} draft layer(s) keep the target layers distinct"
        )
    return (depth, depth_reason), (block, block_reason)


def _plan_generation_without_tokenizer(arch, unknown, planner):
    """The generation section without tokenizer facts: what the chat template and the tokenizer's special
    tokens decide is unknown; what the model family alone decides (parsers) is planned as usual."""
    section = {key: planner.unknown("generation", key, unknown)
               for key in ("thinking_switch", "chat_template_kwargs", "stop_token_ids", "stop")}
    row = family_of(arch)
    family = row.model_type if row else arch.get("model_type")
    reasoning, tool = (row.reasoning_parser, row.tool_call_parser) if row else (None, None)
    if reasoning and not row.always_reasons:
        # The family has a parser, but whether this checkpoint thinks depends on its tokenizer and template.
        section["reasoning_parser"] = planner.unknown("generation", "reasoning_parser", unknown)
    else:
        section["reasoning_parser"] = planner.pick(
            "generation", "reasoning_parser", reasoning,
            f"SGLang's reasoning parser for the {family} family (it always reasons)" if reasoning
            else f"no SGLang reasoning parser for model type {family}",
        )
    section["tool_call_parser"] = planner.pick(
        "generation", "tool_call_parser", tool,
        f"SGLang's tool-call parser for the {family} family" if tool
        else f"no SGLang tool-call parser known for model type {family}",
    )
    return section


def mask_outside_table(mask_id, vocab_size):
    """Pure: why a planned DFlash mask id cannot work in an embedding table of `vocab_size` rows, or None."""
    if mask_id is None or not _positive_int(vocab_size):
        return None
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < vocab_size:
        return (
            f"mask token id {mask_id!r} lies outside the embedding table [0, {vocab_size}) of config.json; "
            "pick a reserved id below vocab_size (model_facts_plan_overrides.drafter.mask_token_id)"
        )
    return None


def plan_drafter(arch, tokenizer, planner):
    unknown = tokenizer_unknown(tokenizer)
    tokenizer = tokenizer or {}
    layers = arch.get("num_layers")
    section = {
        "method": planner.pick("drafter", "method", "dflash", "DFlash block-diffusion drafter (SpecForge)")
    }
    (default_n, reason), (default_block, block_reason) = drafter_depth_and_block(arch)
    section["num_draft_layers"] = planner.pick("drafter", "num_draft_layers", default_n, reason)
    n = section["num_draft_layers"]["value"]
    if layers:
        ids = dflash_target_layer_ids(layers, n)
        if n == 1:
            ids_reason = f"one draft layer reads the middle target layer, L//2 of L={layers} (SpecForge)"
        else:
            ids_reason = (
                f"round(1 + i*(L-4)/(n-1)) over L={layers} target layers for n={n} draft layers (SpecForge)"
            )
    else:
        ids, ids_reason = None, "target layer count unknown"
    section["target_layer_ids"] = planner.pick("drafter", "target_layer_ids", ids, ids_reason)
    section["block_size"] = planner.pick("drafter", "block_size", default_block, block_reason)
    mask = tokenizer.get("mask_token") or {}
    if unknown:
        section["mask_token_id"] = planner.unknown("drafter", "mask_token_id", unknown)
        section["mask_token"] = planner.unknown("drafter", "mask_token", unknown)
    else:
        mask_reason = mask.get("reason") or "tokenizer facts unavailable"
        row = family_of(arch)
        recipe = row.drafter_recipe if row is not None else None
        if recipe is not None and mask.get("id") is not None and mask["id"] != recipe.mask_token_id:
            # Either works for a drafter trained here; a published drafter's checkpoint needs its own id.
            mask_reason += f" (the published drafter uses id {recipe.mask_token_id})"
        section["mask_token_id"] = planner.pick("drafter", "mask_token_id", mask.get("id"), mask_reason)
        section["mask_token"] = planner.pick(
            "drafter",
            "mask_token",
            mask.get("token"),
            "needs a new token and resized embeddings"
            if mask.get("needs_new_token")
            else "an existing token id; no resize needed",
        )
    mask_problem = mask_outside_table(section["mask_token_id"]["value"], arch.get("vocab_size"))
    if mask_problem:
        section["mask_token_id"]["reason"] += f"; warning: {mask_problem}"
        planner.warnings.append(f"drafter.mask_token_id: {mask_problem}")
    section["hidden_size"] = planner.pick(
        "drafter", "hidden_size", arch.get("hidden_size"), "the drafter reads the target's hidden states"
    )
    section["vocab_size"] = planner.pick(
        "drafter",
        "vocab_size",
        arch.get("vocab_size"),
        "the drafter shares the target's embedding and LM head size",
    )
    section["target_num_layers"] = planner.pick("drafter", "target_num_layers", layers, "from config.json")
    return section


def plan_length(arch, prompts, planner, length_budget=None):
    """The `length` section: the run's one length budget (regen_budget.length_budget) from the prompt
    set's statistics, the generated tokens per turn and the user's one override (regen_length_budget);
    model_facts_plan_overrides.length.{max_tokens, budget} work too. Raises regen_budget.BudgetError."""
    over = planner.overrides.get("length") if isinstance(planner.overrides.get("length"), dict) else {}
    budget, variable = length_budget, "regen_length_budget"
    if budget is None and over.get("budget") is not None:
        budget, variable = over["budget"], "model_facts_plan_overrides.length.budget"
    max_tokens = over.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise regen_budget.BudgetError(
            "model_facts_plan_overrides.length.max_tokens must be a positive number of tokens, got "
            f"{max_tokens!r}"
        )
    result = regen_budget.length_budget(
        prompts, max_tokens=max_tokens, budget=budget, model_max=arch.get("max_position_embeddings"),
        budget_variable=variable,
    )
    planner.warnings.extend(result["warnings"])
    reasons = result["reasons"]
    lengths = (prompts or {}).get("lengths") if isinstance(prompts, dict) else None
    lengths = lengths if isinstance(lengths, dict) else {}
    prompt_set = {
        "fingerprint": (prompts or {}).get("fingerprint") if isinstance(prompts, dict) else None,
        "rows": lengths.get("rows"),
        "method": result["method"],
        "tokens": lengths.get("tokens"),
        "utf8_bytes": lengths.get("utf8_bytes"),
        "groups": result["groups"],
    }
    section = {
        "prompt_set": {"value": prompt_set, "reason": reasons["prompt_tokens"].split("; ", 1)[-1]},
        "prompt_tokens": {"value": result["prompt_tokens"], "reason": reasons["prompt_tokens"]},
        "max_tokens": {"value": result["max_tokens"], "reason": reasons["max_tokens"]},
        "budget": {"value": result["budget"], "reason": reasons["budget"]},
    }
    if max_tokens is not None:
        section["max_tokens"]["derived"] = regen_budget.DEFAULT_MAX_TOKENS
    if budget is not None:
        section["budget"]["derived"] = regen_budget.length_budget(
            prompts, max_tokens=max_tokens, model_max=arch.get("max_position_embeddings"))["budget"]
    return section


def plan_concurrency(serving, length, planner):
    """generation.concurrency: requests in flight per endpoint so that each can grow to the length budget
    inside the server's KV pool (regen_budget.concurrency)."""
    pool = plan_value(serving.get("memory")) or {}
    value, reason = regen_budget.concurrency(
        pool.get("tokens"), plan_value(length.get("budget")), device=plan_value(serving.get("device"))
    )
    return planner.pick("generation", "concurrency", value, reason)


def plan_nccl(gpu, serving, planner):
    """The `nccl` section: one decision (regen_gpu.nccl_decision) for the server's TP ranks, the capture
    server's (it runs the target with the serving layout) and the FSDP trainer's (one rank per GPU)."""
    count = (gpu or {}).get("count") or 0
    tp = plan_value(serving.get("tp_size")) or 1
    server_ranks = min(count, tp * (plan_value(serving.get("dp_size")) or 1))
    section = {}
    for key, ranks, who in (("serving", server_ranks, "the SGLang server's TP ranks"),
                            ("capture", tp, "the capture server's ranks"),
                            ("training", count, "the FSDP trainer's ranks (one per GPU)")):
        env, reason, source = nccl_decision(gpu, ranks if count else 0, who)
        section[key] = planner.pick("nccl", key, env, f"{reason} [{source}]")
    return section


def plan_estimate(architecture, plan, prompts, planner):
    """estimate.run: generation and capture time and the run's disk (regen_estimate.run_estimate)."""
    from .regen_drafter import hidden_state_bytes_per_token  # regen_drafter imports us

    rows = None
    if isinstance(prompts, dict):
        rows = prompts.get("rows") or ((prompts.get("lengths") or {}).get("rows"))
    drafter = plan.get("drafter") or {}
    layers = plan_value(drafter.get("target_layer_ids"))
    hidden = architecture.get("hidden_size")
    per_token = hidden_state_bytes_per_token(hidden, len(layers)) if hidden and layers else None
    entry = regen_estimate.run_estimate(architecture, plan, rows, per_token,
                                        plan_value(drafter.get("num_draft_layers")))
    return planner.pick("estimate", "run", entry["value"], entry["reason"])


def refresh_estimate(plan, architecture, prompts=None, overrides=None):
    """Recompute estimate.run after the serving section gained a throughput source (the simulator's
    estimate or the sweep's measurement, which model_plan_info attaches after make_plan)."""
    plan["estimate"] = {"run": plan_estimate(architecture, plan, prompts, _Planner(overrides))}
    return plan


# Public settings for Kimi K2.5 on 8x RTX PRO 6000 that the issue tracker quotes (regen issue 24): shown
# beside the plan's own, which follow from its margin arithmetic.
PUBLIC_SM120_SETTINGS = ("public recipes for Kimi K2.5 on 8x RTX PRO 6000 run --mem-fraction-static "
                         "0.93-0.94 with --cuda-graph-max-bs 8-32")


def _plan_graph_batch(architecture, gpu, overrides, length):
    """(batch, reason) of the decode CUDA graphs, planned with the concurrency: a first pass plans the
    concurrency with SGLang's default batch in the margin, the batch becomes that concurrency rounded up,
    the smaller margin raises the static share, and the pass repeats until the batch holds (<= 4 rounds).
    None without GPUs."""
    count = (gpu or {}).get("count") or 0
    per_gpu = (gpu or {}).get("memory_per_gpu_bytes") or 0
    if not (count and per_gpu):
        return None
    over = ((overrides or {}).get("serving") or {}) if isinstance(overrides, dict) else {}
    if over.get("cuda_graph_max_bs"):
        return int(over["cuda_graph_max_bs"]), "set in inventory (model_facts_plan_overrides.serving)"
    graph = None
    for _round in range(4):
        trial = _Planner(overrides)
        serving = plan_serving(architecture, gpu, trial, length, graph)
        pool = plan_value(serving.get("memory")) or {}
        value, _why = regen_budget.concurrency(pool.get("tokens"), plan_value(length.get("budget")),
                                               device=plan_value(serving.get("device")))
        batch, reason = regen_budget.graph_batch_for(value, per_gpu, count)
        if graph and graph[0] == batch:
            break
        graph = (batch, reason)
    capabilities = {c for c in (gpu or {}).get("compute_capabilities") or [] if c}
    if any(str(c).startswith("12.") for c in capabilities):
        graph = (graph[0], f"{graph[1]}; {PUBLIC_SM120_SETTINGS}, beside the plan's")
    return graph


def make_plan(architecture, tokenizer=None, gpu=None, overrides=None, prompts=None, length_budget=None):
    """The whole plan document: {serving, generation, drafter, length, warnings}.

    prompts: the prompt set's statistics ({fingerprint, rows, lengths} of the prompts stage's manifest);
    length_budget: the user's one length override (regen_length_budget), None to plan it.
    """
    planner = _Planner(overrides)
    length = plan_length(architecture, prompts, planner, length_budget)
    graph = _plan_graph_batch(architecture, gpu, overrides, length)
    serving = plan_serving(architecture, gpu, planner, length, graph)
    generation = plan_generation(architecture, tokenizer, planner)
    generation["concurrency"] = plan_concurrency(serving, length, planner)
    plan = {
        "serving": serving,
        "generation": generation,
        "drafter": plan_drafter(architecture, tokenizer, planner),
        "length": length,
    }
    plan["nccl"] = plan_nccl(gpu, serving, planner)
    plan["estimate"] = {"run": plan_estimate(architecture, plan, prompts, planner)}
    unknown = unknown_entries(plan)
    if unknown and isinstance(tokenizer, dict) and tokenizer.get("available") is False:
        # Only tokenizer facts that say they could not be read are a warning; a caller that passes none
        # (a planning test, a what-if) still gets the unknown entries, each with its reason.
        why = tokenizer_unknown(tokenizer) or {}
        planner.warnings.append(
            "tokenizer facts unknown ({}): {} unknown; the stages that need them (serve, generate, "
            "tokenize, train) stop until then; {}".format(
                why.get("reason"), ", ".join(sorted(unknown)), why.get("remedy")
            )
        )
    plan["warnings"] = planner.warnings
    return plan


class PlanInputError(ValueError):
    """The plan's inputs are wrong: an unknown override (each named), or a length budget that cannot hold
    the longest prompt (regen_budget.BudgetError's message)."""


def build_plan(architecture, tokenizer=None, gpu=None, overrides=None, prompts=None, length_budget=None,
               sweep_report=None, backend=None, simulation=None):
    """The plan document and its two readings, built one way for every caller: {plan, plan_values,
    plan_unknown}. The model_plan_info module (the introspect stage) and `regen facts --model-path` both
    call this; what a caller does not have (no sweep report, no simulator run) is passed as None and left
    out, exactly as the stage leaves it out.

    The overrides are checked first (every unknown key named); then make_plan, then the layout sweep's
    measured layout when `sweep_report` is given (regen_sweep.apply_report: applied only when it was
    measured for this model, GPU count and backend), then the simulator's estimate beside the final
    choice when `simulation` is given, and the run estimate again with either. Raises PlanInputError.
    """
    overrides = dict(overrides or {})
    errors = override_errors(overrides)
    if errors:
        raise PlanInputError("; ".join(errors))
    try:
        plan = make_plan(
            architecture, tokenizer, gpu, overrides, prompts=prompts, length_budget=length_budget
        )
    except regen_budget.BudgetError as exc:
        raise PlanInputError(str(exc)) from None
    if sweep_report is not None:
        plan = regen_sweep.apply_report(plan, sweep_report, overrides, architecture, gpu, backend)
    if simulation is not None:
        plan["serving"]["simulator_estimate"] = regen_simulator.plan_entry(
            simulation, plan_values(plan)["serving"]
        )
    if sweep_report is not None or simulation is not None:
        # The run estimate again, now with the measured layout or the simulator's throughput.
        refresh_estimate(plan, architecture, prompts, overrides)
    return {"plan": plan, "plan_values": plan_values(plan), "plan_unknown": unknown_entries(plan)}
