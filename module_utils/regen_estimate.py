"""The run estimate: how long generation and capture take and how much disk the run needs, with arithmetic.

Pure functions over the plan (length budget, serving layout, drafter layers), the prompt set's size and
the throughput a source gives: the simulator's estimate for the plan's layout (`serving.simulator_estimate`,
aiconfigurator) or the layout sweep's measurement. Every number says where it came from; what no source
gives is `null` with the reason and how to get it (never a guessed rate). Upper bounds are named as such:
a completion may stop before `max_tokens`, so generation time and disk are at most these figures.
"""

from __future__ import annotations

GIB = 1024**3


def _value(entry):
    return entry.get("value") if isinstance(entry, dict) and "value" in entry else entry


def _human_seconds(seconds):
    if seconds is None:
        return "unknown"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {int(seconds) % 60} s"


def human_bytes(value):
    """`512 B`, `1.5 GiB`: a size as an operator reads it (binary units; regen_drafter re-exports it)."""
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    return f"{int(value)} B"


def throughput(serving):
    """(output tokens/s, prefill tokens/s or None, source) for the plan's layout, or (None, None, why)."""
    sweep = _value((serving or {}).get("sweep"))
    if isinstance(sweep, dict) and isinstance(sweep.get("measured_output_tokens_per_s"), (int, float)):
        return sweep["measured_output_tokens_per_s"], None, "the layout sweep's measurement"
    sim = _value((serving or {}).get("simulator_estimate"))
    if isinstance(sim, dict):
        row = sim.get("plan_layout_estimate") or sim.get("top")
        if row and row.get("output_tokens_per_s"):
            prefill = None
            if row.get("ttft_ms") and row.get("isl") and row.get("concurrency"):
                # A request's prompt is processed within its time to first token; with `concurrency`
                # requests in flight the server prefills isl x concurrency tokens per TTFT (rough).
                prefill = row["isl"] * row["concurrency"] / (row["ttft_ms"] / 1000.0)
            which = ("the plan's layout" if sim.get("plan_layout_estimate")
                     else f"its best layout {row['name']}")
            return row["output_tokens_per_s"], prefill, f"{sim.get('tool')} estimate for {which}"
    return None, None, ("no throughput source: the simulator (role serving_simulator, GPUs it covers) or the "
                        "layout sweep (playbooks/sweep.yml) gives one; the generate job's status reports its "
                        "measured rate and ETA once it runs")


def run_estimate(arch, plan, rows=None, hidden_state_bytes=None, draft_layers=None):
    """The plan's `estimate` entry ({value, reason}).

    rows: prompts in the set (the prompts stage's manifest), None when unknown. hidden_state_bytes: bytes of
    captured features per token (regen_drafter.hidden_state_bytes_per_token for the target layers)."""
    length = (plan or {}).get("length") or {}
    serving = (plan or {}).get("serving") or {}
    prompt_tokens = _value(length.get("prompt_tokens"))
    max_tokens = _value(length.get("max_tokens"))
    budget = _value(length.get("budget"))
    prompt_set = _value(length.get("prompt_set")) or {}
    out_rate, prefill_rate, rate_source = throughput(serving)
    value = {"prompts": rows, "throughput": {"output_tokens_per_s": out_rate,
                                             "prefill_tokens_per_s": prefill_rate, "source": rate_source}}
    lines = []
    per_prompt_out = max_tokens or 0
    per_prompt_all = budget or ((prompt_tokens or 0) + per_prompt_out)
    if rows is None:
        why = "the prompt set's size is unknown (the prompts stage records it in its manifest)"
        value["generation"] = {"output_tokens": None, "seconds": None, "reason": why}
        lines.append(f"generation: {why}; per prompt at most {per_prompt_out:,} generated tokens")
    else:
        out_tokens = rows * per_prompt_out
        seconds = out_tokens / out_rate if out_rate else None
        arithmetic = (f"{rows:,} prompts x {per_prompt_out:,} max_tokens = {out_tokens:,} output tokens "
                      "(upper bound: a completion may stop earlier)")
        if out_rate:
            arithmetic += f" / {out_rate:,.0f} tokens/s ({rate_source}) = {_human_seconds(seconds)}"
        else:
            arithmetic += f"; time unknown: {rate_source}"
        value["generation"] = {"output_tokens": out_tokens, "seconds": seconds, "arithmetic": arithmetic}
        lines.append("generation: " + arithmetic)
    # Capture: one prefill over prompt + completion of every sample, through the target.
    if rows is not None:
        capture_tokens = rows * per_prompt_all
        seconds = capture_tokens / prefill_rate if prefill_rate else None
        arithmetic = (f"{rows:,} samples x {per_prompt_all:,} tokens (the length budget) = "
                      f"{capture_tokens:,} tokens through the target's prefill")
        arithmetic += (f" / {prefill_rate:,.0f} tokens/s (rough: prompt length x concurrency / TTFT of the "
                       f"same estimate) = {_human_seconds(seconds)}" if prefill_rate
                       else "; time unknown: no prefill rate (the simulator's TTFT gives a rough one)")
        value["capture"] = {"tokens": capture_tokens, "seconds": seconds, "arithmetic": arithmetic}
        lines.append("capture: " + arithmetic)
    disk = {}
    lengths = prompt_set.get("utf8_bytes") or {}
    tokens_stats = prompt_set.get("tokens") or {}
    if rows is not None and lengths.get("p50") and isinstance(tokens_stats, dict) and tokens_stats.get("p50"):
        per_token = lengths["p50"] / tokens_stats["p50"]
        size = int(rows * per_prompt_all * per_token)
        disk["completions_bytes"] = size
        disk["completions"] = (f"{rows:,} x {per_prompt_all:,} tokens x {per_token:.2f} B/token (the prompt "
                               f"set's median UTF-8 bytes per token) = {human_bytes(size)} of text (upper "
                               "bound)")
    else:
        disk["completions_bytes"] = None
        disk["completions"] = ("unknown: needs the prompt set's size and its bytes per token (the prompts "
                               "stage's manifest with --tokenizer)")
    if rows is not None and hidden_state_bytes:
        size = rows * per_prompt_all * hidden_state_bytes
        disk["features_bytes"] = size
        disk["features"] = (f"{rows:,} x {per_prompt_all:,} tokens x {hidden_state_bytes:,} B/token (target "
                            f"layers x hidden x 2 B) = {human_bytes(size)} if captured offline (online and "
                            "rolling runs keep a fraction of it)")
    else:
        disk["features_bytes"] = None
        disk["features"] = (f"{hidden_state_bytes:,} B per token; total unknown without the prompt set's size"
                            if hidden_state_bytes else "unknown: hidden size or target layers unknown")
    hidden = arch.get("hidden_size")
    if hidden and draft_layers:
        inter = arch.get("intermediate_size") or 0
        layer = 4 * hidden * hidden + 3 * hidden * inter
        params = draft_layers * layer
        # Weights in bf16 plus FP32 Adam moments and master weights in a resumable checkpoint.
        size = params * (2 + 12)
        disk["checkpoint_bytes"] = size
        disk["checkpoint"] = (f"{draft_layers} draft layers x (4 x {hidden}^2 attention + 3 x {hidden} x "
                              f"{inter} MLP) = {params:,} parameters x (2 B weights + 12 B FP32 optimizer "
                              f"state) = {human_bytes(size)} per resumable checkpoint (embeddings and LM "
                              "head are the target's, not saved)")
    value["disk"] = disk
    lines += [f"disk, {k}: {v}" for k, v in disk.items() if not k.endswith("_bytes")]
    value["training"] = {"seconds": None, "reason": (
        "training time is measured, not estimated: the train stage's status shows steps/s and its ETA after "
        "the first logged steps")}
    return {"value": value, "reason": "; ".join(lines)}
