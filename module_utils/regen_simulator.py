"""The field's own serving simulator, aiconfigurator: which systems it covers, its command line, its answer.

NVIDIA's aiconfigurator (PyPI `aiconfigurator` 0.12.0 with `aiconfigurator-core`, pure Python + a Rust
estimator, no torch, no GPU) ships measured SGLang kernel data for a set of GPU systems and the configs
of the models it knows (Kimi K2.5 among them), and ranks parallel layouts by simulated throughput:
`aiconfigurator cli default --model-path M --system S --backend sglang --total-gpus N --serving-mode agg
--isl I --osl O --save-dir D` answers in ~12 s on a CPU and writes `D/<run>/agg/best_config_topn.csv`.
Its successor `aisimulate` keeps the command but its PyPI release is a stub that downloads the real wheel
from NVIDIA's own index at install time, which a host that reaches only PyPI cannot do; the pin is
therefore aiconfigurator 0.12.0 (envs/aiconfigurator.lock).

Pure functions: the GPU -> system table, the command line, the CSV parser, the mapping of its parallel
notation to SGLang's flags and the coverage decision; the module `layout_simulation_info` runs it.
"""

from __future__ import annotations

import csv
import io
import re

TOOL = "aiconfigurator"
VERSION = "0.12.0"

# nvidia-smi's GPU name -> aiconfigurator's system (aiconfigurator_core/systems/*.yaml of 0.12.0). First
# match wins, so the longer names come first. Systems it lists but this table lacks fall back to the
# plan's own rules with the reason.
SYSTEMS = (
    (re.compile(r"RTX PRO 6000 Blackwell", re.I), "rtx_pro_6000_server"),
    (re.compile(r"\bGB300\b", re.I), "gb300"),
    (re.compile(r"\bGB200\b", re.I), "gb200"),
    (re.compile(r"\bB300\b", re.I), "b300_sxm"),
    (re.compile(r"\bB200\b", re.I), "b200_sxm"),
    (re.compile(r"\bH200\b", re.I), "h200_sxm"),
    (re.compile(r"\bH100\b.*\bPCIe\b", re.I), "h100_pcie"),
    (re.compile(r"\bH100\b", re.I), "h100_sxm"),
    (re.compile(r"\bA100\b.*\bPCIe\b", re.I), "a100_pcie"),
    (re.compile(r"\bA100\b", re.I), "a100_sxm"),
    (re.compile(r"\bL40S\b", re.I), "l40s"),
    (re.compile(r"\bL4\b", re.I), "l4"),
    (re.compile(r"\bA30\b", re.I), "a30"),
)
# Architectures aiconfigurator 0.12.0 parses (its error message lists them); anything else is not covered.
ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "MiMoForCausalLM",
        "DeepSeekForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "DeepseekV4ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "KimiK3ForConditionalGeneration",
        "NemotronForCausalLM",
        "DeciLMForCausalLM",
        "NemotronHForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "MiniMaxM2ForCausalLM",
        "MiniMaxM3ForCausalLM",
        "MiniMaxM3SparseForConditionalGeneration",
        "Step3p7ForConditionalGeneration",
        "Step3p5ForCausalLM",
        "Step3p7FlashForCausalLM",
        "Step3p5FlashForCausalLM",
        "MiMoV2FlashForCausalLM",
        "Llama4ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
    }
)
_PARALLEL = re.compile(r"^tp(\d+)pp(\d+)dp(\d+)etp(\d+)ep(\d+)$")


def system_for_gpu(gpu):
    """(aiconfigurator system or None, reason) for the GPU facts (gpu_info's document)."""
    gpu = gpu or {}
    if not gpu.get("count"):
        return None, "no NVIDIA GPU: aiconfigurator simulates NVIDIA GPU systems only"
    names = gpu.get("names") or []
    if len(set(names)) > 1:
        return None, f"GPUs of several kinds ({', '.join(sorted(set(names)))}): no single system to simulate"
    name = names[0] if names else ""
    for pattern, system in SYSTEMS:
        if pattern.search(name):
            return system, f"{name} is aiconfigurator's system {system}"
    return None, f"{name or 'this GPU'} has no aiconfigurator {VERSION} system (see regen_simulator.SYSTEMS)"


def coverage(architecture, gpu):
    """(system or None, reason): whether aiconfigurator can estimate this model on these GPUs."""
    system, reason = system_for_gpu(gpu)
    if system is None:
        return None, reason
    archs = (architecture or {}).get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        return None, f"aiconfigurator {VERSION} does not model architecture {', '.join(archs)}"
    return system, reason


def command(python_bin_dir, model_path, system, total_gpus, isl, osl, save_dir, top_n=10):
    """aiconfigurator's argv for the aggregated (one server) layouts of this run's length budget."""
    for name, value in (("total_gpus", total_gpus), ("isl", isl), ("osl", osl), ("top_n", top_n)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return [
        f"{python_bin_dir.rstrip('/')}/aiconfigurator",
        "cli",
        "default",
        "--model-path",
        model_path,
        "--system",
        system,
        "--backend",
        "sglang",
        "--total-gpus",
        str(total_gpus),
        "--serving-mode",
        "agg",
        "--isl",
        str(isl),
        "--osl",
        str(osl),
        "--top-n",
        str(top_n),
        "--save-dir",
        save_dir,
        "--no-color",
    ]


def sglang_layout(parallel):
    """aiconfigurator's `tpXppYdpZetpAepB` as SGLang 0.5.23 settings.

    aiconfigurator counts attention TP (tp) and attention DP (dp) apart, its GPUs per worker being
    tp*pp*dp; SGLang's --tp-size is that whole group, --attn-dp-size its attention-DP share, --ep-size the
    expert-parallel degree (the MoE TP degree etp is what remains of tp*dp: SGLang derives it).
    """
    match = _PARALLEL.match(parallel or "")
    if not match:
        raise ValueError(f"not an aiconfigurator parallel layout: {parallel!r}")
    tp, pp, dp, _etp, ep = (int(g) for g in match.groups())
    layout = {"tp_size": tp * dp, "ep_size": ep, "attn_dp_size": dp}
    if pp > 1:
        layout["pp_size"] = pp
    return layout


def layout_name(settings):
    name = f"tp{settings['tp_size']}-ep{settings.get('ep_size', 1)}"
    if (settings.get("attn_dp_size") or 1) > 1:
        name += f"-adp{settings['attn_dp_size']}"
    if (settings.get("pp_size") or 1) > 1:
        name += f"-pp{settings['pp_size']}"
    return name


def _number(value):
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() and "." not in str(value) else number


def parse_best_configs(text):
    """The rows of aiconfigurator's `best_config_topn.csv`, ranked, each with its SGLang layout.

    Keeps what the sweep and the plan record: tokens/s (whole deployment), per GPU, per user, concurrency,
    TTFT/TPOT (ms), the parallel notation, the perf-data version and the system.
    """
    reader = csv.DictReader(io.StringIO(text))
    required = {"tokens/s", "tokens/s/gpu", "parallel", "concurrency"}
    if not reader.fieldnames or not required <= set(reader.fieldnames):
        raise ValueError(
            "not aiconfigurator's best_config_topn.csv: it needs the columns " + ", ".join(sorted(required))
        )
    rows = []
    for rank, row in enumerate(reader, 1):
        settings = sglang_layout(row["parallel"])
        rows.append(
            {
                "rank": rank,
                "name": layout_name(settings),
                "settings": settings,
                "parallel": row["parallel"],
                "output_tokens_per_s": _number(row["tokens/s"]),
                "tokens_per_s_per_gpu": _number(row["tokens/s/gpu"]),
                "tokens_per_s_per_user": _number(row.get("tokens/s/user")),
                "concurrency": _number(row["concurrency"]),
                "ttft_ms": _number(row.get("ttft")),
                "tpot_ms": _number(row.get("tpot")),
                "isl": _number(row.get("isl")),
                "osl": _number(row.get("osl")),
                "total_gpus": _number(row.get("num_total_gpus")),
                "perf_db_version": row.get("version"),
                "system": row.get("system"),
            }
        )
    return rows


def simulation_from_csv(text):
    """What layout_simulation_info returns, from a `best_config_topn.csv` aiconfigurator already wrote (an
    operator's own run, given to `regen facts --simulation-csv`)."""
    rows = parse_best_configs(text)
    first = rows[0] if rows else {}
    return {"covered": True, "system": first.get("system"), "isl": first.get("isl"), "osl": first.get("osl"),
            "candidates": rows, "tool": f"{TOOL} {first.get('perf_db_version') or VERSION} (given CSV)"}


def failure_reason(output):
    """The line of aiconfigurator's output that says why it gave no answer (its last error)."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|\[E\])", line) and not line.startswith("File "):
            return re.sub(r"^\S+ \[aiconfigurator\] \[E\] \[[^\]]+\] ", "", line)[:400]
    return lines[-1][:400] if lines else "no output"


def match_estimate(candidates, settings):
    """The candidate whose SGLang layout equals `settings` (tp/ep/attn-dp/pp), or None."""

    def key(s):
        return (
            int(s.get("tp_size") or 1),
            int(s.get("ep_size") or 1),
            int(s.get("attn_dp_size") or 1),
            int(s.get("pp_size") or 1),
        )

    wanted = key(settings)
    for candidate in candidates or []:
        if key(candidate["settings"]) == wanted:
            return candidate
    return None


def plan_entry(simulation, serving_values):
    """The plan's `serving.simulator_estimate` entry: the estimate beside the plan's own choice.

    `simulation`: what layout_simulation_info returned ({covered, reason, candidates, ...}) or None;
    `serving_values`: the plan's serving values (tp_size, ep_size, attn_dp_size).
    """
    if not simulation:
        return {"value": None, "reason": "the simulator did not run: the plan's own rules decide"}
    if not simulation.get("covered"):
        return {
            "value": None,
            "reason": f"not covered by {TOOL} {VERSION}: {simulation.get('reason')}; "
            "the plan's own rules decide",
        }
    candidates = simulation.get("candidates") or []
    chosen = match_estimate(candidates, serving_values)
    top = candidates[0] if candidates else None
    value = {
        "tool": f"{TOOL} {VERSION}",
        "system": simulation.get("system"),
        "isl": simulation.get("isl"),
        "osl": simulation.get("osl"),
        "plan_layout_estimate": chosen,
        "top": top,
        "candidates": candidates,
    }
    if chosen and top:
        reason = (
            f"{TOOL} estimates {chosen['output_tokens_per_s']:g} output tokens/s for the plan's "
            f"{chosen['name']} (rank {chosen['rank']}); its best is {top['name']} at "
            f"{top['output_tokens_per_s']:g} (concurrency {top['concurrency']}); the plan keeps its "
            "own rules, the layout sweep measures both"
        )
    elif top:
        reason = (
            f"{TOOL}'s best is {top['name']} at {top['output_tokens_per_s']:g} output tokens/s; the plan's "
            "layout is not among its top candidates (or breaks its latency limits); the sweep measures both"
        )
    else:
        reason = f"{TOOL} found no layout within its default latency limits for this budget"
    risk = (serving_values or {}).get("ep_risk")
    if risk:
        # The simulator ranks speed, not correctness: a layout public reports saw answer garbage on this GPU
        # is shown beside the ranking (the quality gate and the sweep decide it on the host).
        value["ep_risk"] = risk
        reason += f"; risk of the plan's layout: {risk}"
    return {"value": value, "reason": reason}
