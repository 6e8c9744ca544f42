"""The plan's one length budget and its memory and concurrency arithmetic, checked against numbers
worked by hand (the derivation is in the comment beside each).

Inputs are real: model configs from tests/fixtures/configs, GPU facts parsed by gpu_info's own parser from
the recorded nvidia-smi tables in tests/fixtures/nvidia-smi, and prompt statistics the prompts job writes
for the demo prompt set with the demo model's tokenizer (tests/unit/test_prompts.py checks the job's side).
The `lengths` documents spelled out below are inputs of the plan in the manifest's format, not outputs
of any tool.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"

from ansible.module_utils import regen_budget
from ansible.module_utils.regen_budget import BudgetError, length_budget
from ansible.module_utils.regen_config import estimate_weight_bytes, read_model_dir
from ansible.module_utils.regen_gpu import summarize
from ansible.module_utils.regen_plan import make_plan

from tests.helpers.modules import run_module
from tests.helpers.nvidia_smi import parse_table

MIB = 1024**2


def _gpus(table: str, count: int) -> dict:
    gpus, driver, cuda = parse_table((SMI / table).read_text(encoding="utf-8"))
    return summarize([dict(gpus[i % len(gpus)], index=i) for i in range(count)], driver=driver, cuda=cuda)


def rtx_pro_6000(count: int = 8) -> dict:
    return _gpus("rtx-pro-6000-maxq-2gpu-table.txt", count)  # 97,887 MiB each, sm_120


def b200(count: int = 8) -> dict:
    return _gpus("b200-table-driver580.txt", count)  # 183,359 MiB each, sm_100


def _prompts(by_turns: list[dict], tokens: dict | None = None, rows: int = 1000) -> dict:
    """A prompt set's statistics in the manifest's format (what the prompts job writes)."""
    return {
        "fingerprint": "f" * 64,
        "rows": rows,
        "lengths": {
            "rows": rows,
            "chars": {"p50": 400, "p90": 2000, "p99": 6000, "max": 9000},
            "utf8_bytes": {"p50": 420, "p90": 2100, "p99": 6300, "max": 9500},
            "tokens": tokens,
            "tokens_reason": ("counted with the model's chat template" if tokens
                              else "no --tokenizer was given"),
            "tokenizer": None,
            "by_turns": by_turns,
        },
    }


SINGLE_TURN = _prompts(
    [{"turns": 1, "rows": 1000, "max_chars": 9000, "max_utf8_bytes": 9500, "max_tokens": 1830}],
    tokens={"p50": 90, "p90": 420, "p99": 1200, "max": 1830},
)
MULTI_TURN = _prompts(
    [
        {"turns": 1, "rows": 900, "max_chars": 9000, "max_utf8_bytes": 9500, "max_tokens": 1830},
        {"turns": 3, "rows": 100, "max_chars": 2500, "max_utf8_bytes": 2600, "max_tokens": 700},
    ],
    tokens={"p50": 90, "p90": 420, "p99": 1200, "max": 1830},
)


# --- the length budget -------------------------------------------------------------------------------


def test_the_budget_is_the_longest_prompt_plus_max_tokens() -> None:
    result = length_budget(SINGLE_TURN)
    # 1,830 prompt tokens + 1 turn x (4,096 max_tokens + 8 template tokens) = 5,934
    assert (result["prompt_tokens"], result["max_tokens"], result["budget"]) == (1830, 4096, 5934)
    assert result["method"] == "tokens"
    assert "1,830 prompt tokens + 1 turn x (4,096 max_tokens + 8 template tokens) = 5,934" in (
        result["reasons"]["budget"]
    )
    assert "p99 1,200" in result["reasons"]["budget"] and result["warnings"] == []


def test_a_multi_turn_conversation_needs_every_turn() -> None:
    result = length_budget(MULTI_TURN, max_tokens=2048)
    # one turn: 1,830 + 1 x (2,048 + 8) = 3,886; three turns (each later turn reads the earlier answers):
    # 700 + 3 x (2,048 + 8) = 6,868, the larger
    assert result["budget"] == 6868
    assert "700 prompt tokens + 3 turns x (2,048 max_tokens + 8 template tokens) = 6,868" in (
        result["reasons"]["budget"]
    )
    assert "100 conversation(s) regenerate up to 3 assistant turns" in result["reasons"]["budget"]


def test_the_one_override_sets_the_budget_and_max_tokens_follows() -> None:
    result = length_budget(MULTI_TURN, budget=8192)
    # the most max_tokens every conversation fits in 8,192: one turn (8,192 - 1,830) // 1 - 8 = 6,354;
    # three turns (8,192 - 700) // 3 - 8 = 2,497 - 8 = 2,489; the smaller wins
    assert (result["budget"], result["max_tokens"]) == (8192, 2489)
    assert "set in inventory (regen_length_budget)" in result["reasons"]["budget"]


def test_a_budget_below_the_longest_prompt_is_refused_with_the_fix() -> None:
    with pytest.raises(BudgetError, match=r"regen_length_budget=1,024 leaves no room.*1,830 tokens"):
        length_budget(SINGLE_TURN, budget=1024)
    with pytest.raises(BudgetError, match="must be a positive number of tokens"):
        length_budget(SINGLE_TURN, budget=0)


def test_the_budget_never_exceeds_the_model_context() -> None:
    result = length_budget(SINGLE_TURN, max_tokens=40000, model_max=40960)  # Qwen3-8B's context
    # 1,830 + 40,008 = 41,838 > 40,960: capped; max_tokens (40,960 - 1,830) - 8 = 39,122
    assert (result["budget"], result["max_tokens"]) == (40960, 39122)
    assert any("exceeds the model's context of 40,960" in w for w in result["warnings"])


def test_without_a_tokenizer_the_bytes_bound_the_tokens() -> None:
    result = length_budget(_prompts([{"turns": 1, "rows": 1000, "max_chars": 9000, "max_utf8_bytes": 9500,
                                      "max_tokens": None}]))
    # every token covers at least one byte: 9,500 bytes + 64 template tokens = 9,564; + 4,096 + 8 = 13,668
    assert (result["method"], result["prompt_tokens"], result["budget"]) == ("utf8_bytes", 9564, 13668)
    assert "no --tokenizer was given" in result["reasons"]["budget"]


def test_without_statistics_the_prompt_is_assumed_and_said_so() -> None:
    result = length_budget(None)
    # 2,048 assumed + 4,096 + 8 = 6,152
    assert (result["method"], result["budget"]) == ("assumed", 6152)
    assert "no prompt-set statistics" in result["reasons"]["budget"]


# --- the plan reads it everywhere --------------------------------------------------------------------


def test_the_plan_carries_one_budget_to_serving_and_generation() -> None:
    plan = make_plan(read_model_dir(str(CONFIGS / "kimi-k2.5")), None, rtx_pro_6000(), prompts=SINGLE_TURN)
    length, serving = plan["length"], plan["serving"]
    assert length["budget"]["value"] == serving["context_length"]["value"] == 5934
    assert "length.budget" in serving["context_length"]["reason"]
    args = serving["sglang_args"]["value"]
    assert args[args.index("--context-length") + 1] == "5934"
    assert length["max_tokens"]["value"] == 4096 and length["prompt_set"]["value"]["method"] == "tokens"


def test_regen_length_budget_and_the_plan_override_reach_every_value() -> None:
    arch = read_model_dir(str(CONFIGS / "kimi-k2.5"))
    plan = make_plan(arch, None, rtx_pro_6000(), prompts=SINGLE_TURN, length_budget=16384)
    # 16,384 - 1,830 - 8 = 14,546 generated tokens per turn
    assert (plan["length"]["budget"]["value"], plan["length"]["max_tokens"]["value"]) == (16384, 14546)
    assert plan["length"]["budget"]["derived"] == 5934  # what the plan would have chosen
    assert plan["serving"]["context_length"]["value"] == 16384
    short = make_plan(arch, None, rtx_pro_6000(), {"length": {"max_tokens": 48}}, prompts=SINGLE_TURN)
    assert short["length"]["budget"]["value"] == 1830 + 48 + 8


def test_a_bad_length_override_fails_the_plan_module(capsys: pytest.CaptureFixture[str]) -> None:
    arch = read_model_dir(str(CONFIGS / "qwen3-8b"))
    args = {"architecture": arch, "prompts": SINGLE_TURN, "length_budget": 100}
    result = run_module("model_plan_info", args, capsys)
    assert result["failed"] is True and "regen_length_budget=100 leaves no room" in result["msg"]
    ok = run_module("model_plan_info", {"architecture": arch, "prompts": SINGLE_TURN}, capsys)
    assert ok["plan_values"]["length"]["budget"] == 5934


# --- KV bytes per token at the declared KV-cache dtype -----------------------------------------------


def test_an_fp8_kv_cache_declaration_halves_the_kv_bytes() -> None:
    llama = read_model_dir(str(CONFIGS / "llama-70b-nvfp4"))
    # hf_quant_config.json kv_cache_quant_algo FP8: 80 layers x 2 (K, V) x 8 KV heads x 128 x 1 B = 163,840
    assert llama["kv_cache_dtype"]["dtype"] == "fp8_e4m3"
    assert llama["kv_cache_bytes_per_token"] == 80 * 2 * 8 * 128 * 1 == 163840
    kimi = read_model_dir(str(CONFIGS / "kimi-k2.5"))
    # kv_cache_scheme: null -> the model's bf16: 61 layers x (512 latent + 64 rope) x 2 B = 70,272
    assert kimi["kv_cache_dtype"] == {"dtype": "bfloat16", "bytes": 2,
                                      "source": "no KV-cache quantization declared: the model's dtype"}
    assert kimi["kv_cache_bytes_per_token"] == 61 * (512 + 64) * 2 == 70272


def test_a_compressed_tensors_fp8_kv_scheme_is_read_too() -> None:
    # Kimi K2.5's real quantization_config with the kv_cache_scheme an FP8-KV compressed-tensors
    # checkpoint writes ({"type": "float", "num_bits": 8, ...}, as in RedHatAI's FP8 builds).
    import json

    from ansible.module_utils.regen_config import normalize_config

    config = json.loads((CONFIGS / "kimi-k2.5" / "config.json").read_text())
    fp8 = {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True, "type": "float"}
    for scope in (config, config["text_config"]):  # the print carries it at both levels
        scope["quantization_config"]["kv_cache_scheme"] = fp8
    arch = normalize_config(config)
    arch["weight_bytes"] = arch["weight_estimate"]["bytes"]
    # 61 x (512 + 64) x 1 B = 35,136: half of the bf16 cache
    assert arch["kv_cache_dtype"]["dtype"] == "fp8_e4m3" and arch["kv_cache_bytes_per_token"] == 35136
    plan = make_plan(arch, None, b200())  # trtllm_mla reads an FP8 cache natively: the declaration holds
    assert plan["serving"]["kv_cache_dtype"]["value"] == "fp8_e4m3"
    assert "kv_cache_scheme {type: float, num_bits: 8}" in plan["serving"]["kv_cache_dtype"]["reason"]
    assert plan["serving"]["memory"]["value"]["kv_bytes_per_token"] == 35136
    # On sm_120 the backend is FlashInfer MLA, which casts the cache to bf16 at every step: the pair table
    # names bf16 and the pool arithmetic counts 2 B, with the declaration named as not used.
    plan = make_plan(arch, None, rtx_pro_6000())
    entry = plan["serving"]["kv_cache_dtype"]
    assert (entry["value"], entry["pair"]) == ("bf16", ["flashinfer", "bf16"])
    assert "declares fp8_e4m3" in entry["reason"] and "flashinfer-mla-bf16" in entry["reason"]
    assert plan["serving"]["memory"]["value"]["kv_bytes_per_token"] == 70272


# --- weight bytes: the index's total_size first, the config estimate as a fallback -------------------


def test_weight_bytes_come_from_the_index_and_the_estimate_counts_nvfp4_scales_right() -> None:
    arch = read_model_dir(str(CONFIGS / "llama-70b-nvfp4"))
    assert (arch["weight_bytes"], arch["weight_bytes_source"]) == (42709045632, "safetensors_index")
    # The estimate from config.json alone: 70,552,387,584 parameters (2 x 128,256 x 8,192 embedding and
    # LM head + 80 x 150,994,944 attention + 80 x 3 x 8,192 x 28,672 MLP); all but embedding and head in
    # NVFP4 at 4 bits + one FP8 scale per 16 weights (0.5 bit): 68,451,041,280 x 4.5 / 8 = 38,503,710,720,
    # plus 2,101,346,304 x 2 B = 4,202,692,608 in bf16 -> 42,706,403,328 (0.006% under the index). A 16-bit
    # scale would give 46,984,593,408, 10% over.
    assert arch["parameters"]["total"] == 70552387584
    assert estimate_weight_bytes(arch) == 42706403328


# --- memory margin, mem-fraction-static, KV pool and concurrency -------------------------------------


def test_the_margin_and_fraction_on_rtx_pro_6000_for_an_mla_model() -> None:
    # SGLang's own estimate for 97,887 MiB per GPU (the 90-160 GiB class at TP8: 8,192 chunked-prefill
    # tokens, decode graphs of 512): 512 + 1.5 x 8,192 + 2 x 512 + 1,024 x 8/8 + 1,536 (MLA) = 16,384 MiB
    margin, _ = regen_budget.memory_margin(97887 * MIB, 8, mla=True)
    assert margin == 16384 * MIB
    plan = make_plan(read_model_dir(str(CONFIGS / "kimi-k2.5")), None, rtx_pro_6000())
    # The plan captures decode graphs only up to its concurrency: 27 requests in flight (the first pass,
    # with 512 graphs in the margin) -> a batch of 32; 512 + 12,288 + 2 x 32 + 1,024 + 1,536 = 15,424 MiB;
    # 1 - 15,424 / 97,887 = 0.8424 -> 0.84
    graphs = plan["serving"]["cuda_graph_max_bs"]
    assert graphs["value"] == 32 and "planned concurrency 27 rounded up" in graphs["reason"]
    assert "--cuda-graph-max-bs 8-32" in graphs["reason"]  # the public settings beside the plan's
    entry = plan["serving"]["mem_fraction_static"]
    assert entry["value"] == 0.84
    assert "2 MiB x 32 decode-graph batch" in entry["reason"]
    assert "1 - 15,424 MiB margin / 97,887 MiB per GPU = 0.8424" in entry["reason"]
    args = plan["serving"]["sglang_args"]["value"]
    assert args[args.index("--cuda-graph-max-bs-decode") + 1] == "32"


def test_the_margin_on_b200() -> None:
    margin, _ = regen_budget.memory_margin(183359 * MIB, 8, mla=True)
    # above 160 GiB: 16,384 chunked-prefill tokens, decode graphs of 512:
    # 512 + 24,576 + 1,024 + 1,024 + 1,536 = 28,672 MiB; 1 - 28,672 / 183,359 = 0.8436 -> 0.84
    assert margin == 28672 * MIB
    assert regen_budget.mem_fraction_static(183359 * MIB, margin)[0] == 0.84
    assert make_plan(read_model_dir(str(CONFIGS / "deepseek-v3")), None, b200())["serving"][
        "mem_fraction_static"]["value"] == 0.84


def test_the_kv_pool_and_concurrency_of_an_nvfp4_model_with_an_fp8_cache() -> None:
    plan = make_plan(read_model_dir(str(CONFIGS / "llama-70b-nvfp4")), None, rtx_pro_6000(),
                     prompts=SINGLE_TURN)
    serving = plan["serving"]
    assert (serving["tp_size"]["value"], serving["dp_size"]["value"]) == (1, 8)
    memory = serving["memory"]["value"]
    # 256 requests in flight (capped) -> decode graphs of 256: margin 512 + 12,288 + 512 + 1,024 = 14,336
    # MiB (no MLA): 1 - 14,336 / 97,887 = 0.8535 -> 0.85; 97,887 MiB = 102,641,958,912 B x 0.85 =
    # 87,245,665,075 usable - 42,709,045,632 weights (the index, TP1) = 44,536,619,443 B pool; / 163,840 B
    # per token (FP8) = 271,829 tokens per replica, x 8 = 2,174,632
    assert serving["cuda_graph_max_bs"]["value"] == 256
    assert serving["mem_fraction_static"]["value"] == 0.85
    assert memory["weight_bytes_source"] == "safetensors_index"
    assert memory["kv_pool_bytes_per_gpu"] == 44536619443
    assert (memory["tokens_per_rank"], memory["tokens"]) == (271829, 2174632)
    assert "the safetensors index's total_size" in serving["memory"]["reason"]
    assert "x 8 replicas = 2,174,632 tokens" in serving["memory"]["reason"]
    # floor(2,174,632 / 5,934) = 366 requests would fit; capped at 256 per endpoint
    concurrency = plan["generation"]["concurrency"]
    assert concurrency["value"] == 256 and "= 366, capped at 256" in concurrency["reason"]


def test_kimi_on_ct200_sizes_the_generation_job_to_its_kv_pool() -> None:
    arch = read_model_dir(str(CONFIGS / "kimi-k2.5"))
    plan = make_plan(arch, None, rtx_pro_6000(), prompts=SINGLE_TURN)
    memory = plan["serving"]["memory"]["value"]
    weights = arch["weight_bytes"]  # no index in the fixture: the config estimate, and the reason says so
    assert arch["weight_bytes_source"] == "estimate"
    assert "estimated from config.json (no weight index)" in plan["serving"]["memory"]["reason"]
    # per GPU: 102,641,958,912 B x 0.84 - weights / 8 (EP8: experts split, MLA latent whole on each rank)
    pool = int(102641958912 * 0.84 - weights / 8)
    tokens = pool // 70272
    assert (memory["kv_pool_bytes_per_gpu"], memory["tokens"]) == (pool, tokens)
    # every request may grow to 5,934 tokens: floor(tokens / 5,934) in flight, far below the old 64 x ~5k
    assert plan["generation"]["concurrency"]["value"] == tokens // 5934 < 64


def test_the_cpu_plan_keeps_a_few_requests_in_flight() -> None:
    plan = make_plan(read_model_dir(str(CONFIGS / "qwen3-8b")), None, summarize([], reason="no GPU"))
    assert plan["generation"]["concurrency"]["value"] == 4
    assert plan["serving"]["memory"]["value"] is None and plan["serving"]["kv_cache_dtype"]["value"] is None
