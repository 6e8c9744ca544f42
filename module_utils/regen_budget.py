"""The run's one length budget and the serving memory and concurrency arithmetic.

Pure functions, standard library only, used by the plan (regen_plan.make_plan). Every result carries the
arithmetic as a sentence an operator can check by hand:

* `length_budget`: tokens per sequence = the prompt set's longest prompt (tokens counted with the model's
  chat template by the prompts stage, else a stated upper bound) + generated tokens per assistant turn,
  for the conversation that needs most. Generation `max_tokens`, the server's `--context-length`, the
  tokenize/capture/training `max_length` and the evaluation prompt length all come from it.
* `memory_margin` / `mem_fraction_static`: the share of each GPU SGLang may fill with weights and KV
  cache, chosen so that a stated margin stays free for activations, CUDA graphs and NCCL buffers.
* `kv_pool`: how many tokens of KV cache the server holds, from the weight bytes per GPU and the KV
  bytes per token at the checkpoint's declared KV-cache dtype.
* `concurrency`: requests in flight so that every one of them can grow to the length budget inside the
  KV pool.
"""

from __future__ import annotations

import math

MIB = 1024**2
GIB = 1024**3

# Generated tokens per assistant turn when nothing else is asked (the generation job's default before the
# budget existed).
DEFAULT_MAX_TOKENS = 4096
# Prompt tokens assumed when no prompt-set statistics exist yet (a plan from config.json alone, or the
# prompts stage has not run): the prompts stage measures the real value and the plan then uses that.
DEFAULT_PROMPT_TOKENS = 2048
# Template tokens around each generated turn that the prompt count does not see: the assistant role
# header, end-of-turn and think tags the chat template adds when the answer goes back into the
# conversation (Kimi: <|im_assistant|>assistant<|im_middle|> ... <|im_end|> and <think></think>).
TURN_TEMPLATE_TOKENS = 8
# Without a tokenizer the prompt side is bounded by its UTF-8 bytes (every token of a byte-level BPE or
# byte-fallback vocabulary covers at least one byte) plus this allowance for the template's own tokens.
TEMPLATE_ALLOWANCE_TOKENS = 64
# Requests in flight per endpoint are capped here: beyond it the server's scheduler, not the KV pool,
# limits throughput, and the generation client holds one open request each.
MAX_CONCURRENCY = 256
# Requests in flight on the CPU (`transformers serve` or SGLang's CPU backend answer a few at a time).
CPU_CONCURRENCY = 4


class BudgetError(ValueError):
    """A length budget that cannot hold what was asked; the message names the variable to change."""


def _n(value):
    """12,345 (thousands separators: the reasons are read by people)."""
    return f"{int(value):,}"


def _mib(value):
    return f"{value / MIB:,.0f} MiB"


def _gib(value):
    return f"{value / GIB:.1f} GiB"


# --------------------------------------------------------------------------------------------------
# Prompt-set statistics (the `lengths` document of the prompts stage's manifest.json)
# --------------------------------------------------------------------------------------------------


def prompt_groups(prompts):
    """(groups, method, reason) from the prompt set's statistics.

    groups: [(turns, longest prompt side in tokens, rows)], one per number of assistant turns to generate;
    method: `tokens` (counted with the model's chat template), `utf8_bytes` (an upper bound), `assumed`.
    """
    lengths = (prompts or {}).get("lengths") if isinstance(prompts, dict) else None
    if not isinstance(lengths, dict) or not lengths.get("by_turns"):
        return (
            [(1, DEFAULT_PROMPT_TOKENS, None)],
            "assumed",
            f"no prompt-set statistics (the prompts stage measures them): assumed "
            f"{_n(DEFAULT_PROMPT_TOKENS)} prompt tokens and one turn per conversation",
        )
    counted = isinstance(lengths.get("tokens"), dict)
    groups = []
    for row in lengths["by_turns"]:
        turns = int(row.get("turns") or 1)
        if counted and row.get("max_tokens") is not None:
            longest = int(row["max_tokens"])
        else:
            longest = int(row.get("max_utf8_bytes") or 0) + TEMPLATE_ALLOWANCE_TOKENS
        groups.append((max(turns, 1), longest, row.get("rows")))
    groups.sort()
    where = f"prompt set {str(prompts.get('fingerprint') or '')[:12]}, {_n(lengths.get('rows') or 0)} rows"
    if counted:
        tok = lengths["tokens"]
        reason = (
            f"{where}: prompt tokens counted with the model's chat template (p50 {_n(tok['p50'])}, "
            f"p90 {_n(tok['p90'])}, p99 {_n(tok['p99'])}, max {_n(tok['max'])})"
        )
        return groups, "tokens", reason
    why = lengths.get("tokens_reason") or "no tokenizer was given to the prompts stage"
    size = lengths.get("utf8_bytes") or {}
    reason = (
        f"{where}: tokens not counted ({why}); bounded by UTF-8 bytes + {TEMPLATE_ALLOWANCE_TOKENS} "
        f"template tokens (bytes p99 {_n(size.get('p99') or 0)}, max {_n(size.get('max') or 0)})"
    )
    return groups, "utf8_bytes", reason


def _need(groups, max_tokens):
    """(tokens, binding group): the longest conversation when every turn generates max_tokens."""
    per_turn = max_tokens + TURN_TEMPLATE_TOKENS
    needs = [(prompt + turns * per_turn, (turns, prompt, rows)) for turns, prompt, rows in groups]
    return max(needs)


def _need_text(group, max_tokens):
    turns, prompt, _rows = group
    return (
        f"{_n(prompt)} prompt tokens + {turns} turn{'s' if turns > 1 else ''} x ({_n(max_tokens)} "
        f"max_tokens + {TURN_TEMPLATE_TOKENS} template tokens) = "
        f"{_n(prompt + turns * (max_tokens + TURN_TEMPLATE_TOKENS))}"
    )


def _max_tokens_within(groups, budget):
    """The largest per-turn max_tokens with which every conversation fits `budget` tokens."""
    return min((budget - prompt) // turns - TURN_TEMPLATE_TOKENS for turns, prompt, _rows in groups)


def length_budget(prompts, max_tokens=None, budget=None, model_max=None,
                  budget_variable="regen_length_budget"):
    """The length budget: {prompt_tokens, max_tokens, budget, method, groups, reasons, warnings}.

    max_tokens: generated tokens per turn (None: DEFAULT_MAX_TOKENS); budget: the user's one value (None:
    computed); model_max: the model's max_position_embeddings (the budget never exceeds it).
    Raises BudgetError when a given budget cannot hold the longest prompt.
    """
    groups, method, source = prompt_groups(prompts)
    warnings = []
    prompt_tokens = max(prompt for _turns, prompt, _rows in groups)
    multi = [g for g in groups if g[0] > 1]
    turns_note = ""
    if multi:
        rows = sum(g[2] or 0 for g in multi)
        turns_note = (
            f"; {_n(rows)} conversation(s) regenerate up to {max(g[0] for g in multi)} assistant turns, and "
            "each later turn reads the earlier answers, so the budget covers every turn"
        )
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BudgetError(f"{budget_variable} must be a positive number of tokens, got {budget!r}")
        fitted = _max_tokens_within(groups, budget)
        if max_tokens is None:
            if fitted < 1:
                tokens_needed = _need(groups, 1)[0]
                raise BudgetError(
                    f"{budget_variable}={_n(budget)} leaves no room to generate: the longest prompt needs "
                    f"{_n(prompt_tokens)} tokens ({source}); raise it to at least {_n(tokens_needed)} plus "
                    "the tokens to generate, or leave it unset to plan prompt + max_tokens"
                )
            max_tokens = fitted
            tokens_reason = (
                f"what {budget_variable}={_n(budget)} leaves per turn for the conversation that needs "
                f"most: ({_n(budget)} - prompt) / turns - {TURN_TEMPLATE_TOKENS} template tokens"
            )
        else:
            tokens_reason = "set in inventory (model_facts_plan_overrides.length.max_tokens)"
            need, _group = _need(groups, max_tokens)
            if need > budget:
                warnings.append(
                    f"{budget_variable}={_n(budget)} is below what the longest conversation needs at "
                    f"max_tokens {_n(max_tokens)} ({_n(need)}): the server refuses such requests and the "
                    "tokenize stage truncates such samples"
                )
        value = budget
        budget_reason = f"set in inventory ({budget_variable}); {source}{turns_note}"
    else:
        explicit = max_tokens is not None
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        tokens_reason = (
            "set in inventory (model_facts_plan_overrides.length.max_tokens)" if explicit
            else f"{_n(DEFAULT_MAX_TOKENS)} generated tokens per assistant turn (regen's default)"
        )
        value, group = _need(groups, max_tokens)
        budget_reason = f"longest conversation: {_need_text(group, max_tokens)} tokens; {source}{turns_note}"
        if model_max and value > model_max:
            fitted = _max_tokens_within(groups, model_max)
            warnings.append(
                f"the length budget {_n(value)} exceeds the model's context of {_n(model_max)} tokens "
                f"(max_position_embeddings): capped there, max_tokens {_n(max_tokens)} -> "
                f"{_n(max(fitted, 1))}"
            )
            budget_reason += (
                f"; capped at the model's {_n(model_max)} tokens (max_position_embeddings), so max_tokens is "
                f"{_n(max(fitted, 1))}"
            )
            value, max_tokens = model_max, max(fitted, 1)
            tokens_reason += f", lowered to fit the model's context of {_n(model_max)} tokens"
    if model_max and value > model_max:
        warnings.append(
            f"{budget_variable}={_n(value)} exceeds the model's context of {_n(model_max)} tokens "
            "(max_position_embeddings): SGLang refuses a longer --context-length"
        )
    return {
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "budget": value,
        "method": method,
        "groups": [{"turns": t, "prompt_tokens": p, "rows": r} for t, p, r in groups],
        "reasons": {
            "prompt_tokens": f"the longest prompt side of a conversation; {source}",
            "max_tokens": tokens_reason,
            "budget": budget_reason,
        },
        "warnings": warnings,
    }


# --------------------------------------------------------------------------------------------------
# GPU memory: the margin SGLang keeps free, the static share, the KV pool and the concurrency
# --------------------------------------------------------------------------------------------------


def _sglang_gpu_class(per_gpu_bytes, gpus):
    """(chunked-prefill tokens, decode CUDA-graph batch) SGLang 0.5.23 defaults to for a GPU of this
    size (arg_groups/memory_hook.py, _handle_gpu_memory_settings: by GPU memory, 8k/512 for 90-160 GiB
    with TP >= 4)."""
    mib = per_gpu_bytes / MIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 48 if gpus < 4 else 160
    if mib < 60 * 1024:
        return 4096, 32 if gpus < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if gpus < 4 else 512
    return 16384, 512


def default_graph_batch(per_gpu_bytes, gpus):
    """SGLang 0.5.23's default decode CUDA-graph batch for this GPU class (what an unplanned line gets)."""
    return _sglang_gpu_class(per_gpu_bytes, gpus)[1]


def graph_batch_for(concurrency, per_gpu_bytes, gpus):
    """(batch, reason): the decode CUDA-graph batch for the planned concurrency: the concurrency rounded up
    to a multiple of 8 (SGLang captures batch sizes in steps of 8 from 8 on), never above SGLang's own
    default for the GPU class. Graphs beyond the requests in flight only take memory from the KV pool."""
    default = default_graph_batch(per_gpu_bytes, gpus)
    if not concurrency:
        return default, f"no planned concurrency: SGLang's default decode graph batch {default}"
    batch = min(default, max(8, -(-int(concurrency) // 8) * 8))
    return batch, (f"the planned concurrency {concurrency} rounded up to a multiple of 8 = {batch} (SGLang's "
                   f"default for this GPU class is {default}); the graphs' 2 MiB per entry come out of the "
                   "margin, so the static share follows")


def memory_margin(per_gpu_bytes, gpus, mla, graph_bs=None):
    """(bytes, reason): GPU memory kept out of --mem-fraction-static, per GPU.

    SGLang 0.5.23 documents its own estimate of what activations and CUDA graphs take beside weights and
    KV cache (arg_groups/memory_hook.py): 512 MiB + 1.5 MiB per chunked-prefill token + 2 MiB per
    decode-graph batch entry + 1 GiB x TP/8 (NCCL buffers) + 1.5 GiB of prefill graphs on MLA backends,
    and never under 10 GiB on GPUs above 60 GiB. regen keeps the same margin, sized for the largest TP
    this host allows (the one that reserves most), so the fraction is safe for every layout it plans.
    """
    chunk, default_bs = _sglang_gpu_class(per_gpu_bytes, gpus)
    graph_bs = graph_bs or default_bs
    parts = [
        (512 * MIB, "512 MiB"),
        (int(1.5 * MIB * chunk), f"1.5 MiB x {_n(chunk)} chunked-prefill tokens"),
        (2 * MIB * graph_bs, f"2 MiB x {graph_bs} decode-graph batch"),
        (GIB * gpus // 8, f"1,024 MiB x TP{gpus}/8"),
    ]
    if mla:
        parts.append((int(1.5 * GIB), "1,536 MiB MLA prefill graphs"))
    margin = sum(b for b, _ in parts)
    text = " + ".join(t for _, t in parts) + f" = {_mib(margin)}"
    floor = 10 * GIB if per_gpu_bytes > 60 * GIB else 0
    if margin < floor:
        margin = floor
        text += ", raised to SGLang's 10,240 MiB floor for GPUs above 60 GiB"
    return margin, (f"margin per GPU for activations, CUDA graphs and NCCL: {text} (SGLang 0.5.23's estimate "
                    f"for this GPU at TP{gpus}, the largest layout this host allows)")


def mem_fraction_static(per_gpu_bytes, margin_bytes):
    """(fraction, reason): 1 - margin / GPU memory, rounded down to two decimals (never above 0.95)."""
    exact = 1 - margin_bytes / per_gpu_bytes
    fraction = min(math.floor(exact * 100) / 100, 0.95)
    if fraction <= 0:
        raise BudgetError(
            f"a GPU of {_mib(per_gpu_bytes)} cannot keep the {_mib(margin_bytes)} margin SGLang needs; set "
            "model_facts_plan_overrides.serving.mem_fraction_static or use larger GPUs"
        )
    return fraction, (
        f"1 - {_mib(margin_bytes)} margin / {_mib(per_gpu_bytes)} per GPU = {exact:.4f}, rounded down to "
        f"{fraction:.2f}"
    )


def kv_bytes_reason(arch):
    """How the KV bytes per token were found: the formula with the config's numbers."""
    att = arch.get("attention") or {}
    layers = arch.get("num_layers") or 0
    types = att.get("layer_types") or {}
    full = layers - types.get("linear_attention", 0) if types else layers
    if att.get("kv_layers") is not None:
        full = att["kv_layers"]
    dtype = arch.get("kv_cache_dtype") or {"dtype": "bfloat16", "bytes": 2, "source": "assumed"}
    size = dtype["bytes"]
    if att.get("kind") == "mla":
        formula = (f"{full} layers x ({att.get('kv_lora_rank')} latent + {att.get('qk_rope_head_dim') or 0} "
                   f"rope) x {size:g} B")
    else:
        formula = (f"{full} layers x 2 (K, V) x {att.get('kv_heads')} KV heads x {att.get('head_dim')} "
                   f"x {size:g} B")
    total = _n(arch.get("kv_cache_bytes_per_token") or 0)
    return f"{formula} ({dtype['dtype']}: {dtype['source']}) = {total} B"


def kv_pool(arch, per_gpu_bytes, fraction, tp, attn_dp=1, dp=1, attention_weight_bytes=None):
    """{...numbers..., "tokens"} and the reason: KV-cache tokens the server holds.

    Per GPU the pool is what the static share leaves after the weights: GPU memory x fraction - weights/TP
    (attention weights whole on every rank with attention DP). An MLA latent is not split by heads, so
    without attention DP every TP rank holds the same tokens; with it each rank holds its own requests.
    GQA caches split by KV heads over the TP ranks (whole heads, replicated when TP exceeds them). `dp`
    whole replicas each hold their own pool.
    """
    per_token = arch.get("kv_cache_bytes_per_token")
    weights = arch.get("weight_bytes")
    if not (per_token and weights and per_gpu_bytes):
        return None, "weight size or KV bytes per token unknown: the KV pool cannot be computed"
    att = arch.get("attention") or {}
    usable = per_gpu_bytes * fraction
    source = {
        "safetensors_index": "the safetensors index's total_size",
        "safetensors_headers": "the safetensors headers",
        "estimate": "estimated from config.json (no weight index)",
    }.get(arch.get("weight_bytes_source"), "of unknown source")
    attn_bytes = attention_weight_bytes or 0
    if att.get("kind") == "mla" and attn_dp > 1 and attn_bytes:
        weights_per_gpu = (weights - attn_bytes) / tp + attn_bytes
    else:
        weights_per_gpu = weights / tp
    pool = max(0, usable - weights_per_gpu)
    if att.get("kind") == "mla" or not att.get("kv_heads"):
        per_token_gpu = per_token
        ranks = attn_dp if att.get("kind") == "mla" and attn_dp > 1 else 1
        split = ("an MLA latent is whole on every rank" if ranks == 1
                 else f"attention DP: {ranks} ranks hold their own requests")
    else:
        kv_heads = att["kv_heads"]
        per_token_gpu = per_token * max(1, kv_heads // tp) / kv_heads
        ranks = 1
        split = f"{kv_heads} KV heads over TP{tp}: {per_token_gpu:,.0f} B per token per GPU"
    per_rank = int(pool // per_token_gpu)
    tokens = per_rank * ranks * max(dp, 1)
    numbers = {
        "gpu_memory_bytes": int(per_gpu_bytes),
        "mem_fraction_static": fraction,
        "usable_bytes_per_gpu": int(usable),
        "weight_bytes": int(weights),
        "weight_bytes_source": arch.get("weight_bytes_source"),
        "weight_bytes_per_gpu": int(weights_per_gpu),
        "kv_pool_bytes_per_gpu": int(pool),
        "kv_bytes_per_token": per_token,
        "kv_cache_dtype": (arch.get("kv_cache_dtype") or {}).get("dtype"),
        "tokens_per_rank": per_rank,
        "tokens": tokens,
    }
    times = (f" x {ranks} ranks" if ranks > 1 else "") + (f" x {dp} replicas" if dp > 1 else "")
    reason = (
        f"per GPU {_mib(per_gpu_bytes)} x {fraction:.2f} = {_mib(usable)} - {_mib(weights_per_gpu)} weights "
        f"({_gib(weights)} {source}, over TP{tp}) = {_mib(pool)} KV pool; / {_n(per_token_gpu)} B per token "
        f"= {_n(per_rank)} tokens ({split}){times + ' = ' + _n(tokens) + ' tokens' if times else ''}; KV "
        f"bytes per token: {kv_bytes_reason(arch)}"
    )
    return numbers, reason


def concurrency(pool_tokens, budget, device="cuda"):
    """(requests in flight per endpoint, reason): floor(KV pool tokens / length budget), capped to
    1..MAX_CONCURRENCY."""
    if device == "cpu":
        return CPU_CONCURRENCY, f"no GPU: the CPU server answers a few requests at a time ({CPU_CONCURRENCY})"
    if not pool_tokens or not budget:
        return 64, "KV pool unknown: 64 requests in flight (the generation job's default)"
    fits = pool_tokens // budget
    value = max(1, min(fits, MAX_CONCURRENCY))
    reason = (
        f"floor({_n(pool_tokens)} KV pool tokens / {_n(budget)} tokens per request (the length budget)) = "
        f"{_n(fits)}"
    )
    if fits > MAX_CONCURRENCY:
        reason += f", capped at {MAX_CONCURRENCY} in flight per endpoint"
    elif fits < 1:
        reason += ": not even one request of the full budget fits the pool; 1 in flight (lower the budget)"
    else:
        reason += " requests in flight, each able to grow to the budget"
    return value, reason
