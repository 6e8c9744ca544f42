"""Every real config the pinned aiconfigurator-core wheel ships, planned for three real GPU hosts.

The configs (about 90 `config.json` files of the field's large models, with ModelOpt
`hf_quant_config.json` beside the NVFP4/FP8 ones) are read at test time out of the hashed wheel
(tests/helpers/aiconfigurator_wheel.py), not copied into the repository. Each is read by
`normalize_config` (what the introspect stage runs on a model directory) and planned by `make_plan`
for 8x RTX PRO 6000 Blackwell (96 GiB, sm_120), 8x H200 (141 GiB, sm_90) and 8x B200 (180 GiB,
sm_100). For each: no crash; layers, hidden size and expert counts equal the config's; the planned TP
divides the attention heads (and so does any TP the plan suggests); the fits verdict equals the
weight + KV arithmetic redone here; a family regen has no row for is named as such in the warnings,
with the facts it could read. The whole file runs in a few seconds once the wheel is cached.
"""

from __future__ import annotations

import re

import pytest
from ansible.module_utils.regen_config import normalize_config
from ansible.module_utils.regen_families import FAMILIES
from ansible.module_utils.regen_gpu import described
from ansible.module_utils.regen_plan import make_plan, plan_values

from tests.helpers.aiconfigurator_wheel import model_configs

GIB = 1024**3
# (name, GPUs, memory per GPU as nvidia-smi reports it, compute capability)
HOSTS = {
    "8x-rtx-pro-6000": (8, 97_887 * 1024**2, "12.0"),
    "8x-h200": (8, 143_771 * 1024**2, "9.0"),
    "8x-b200": (8, 183_359 * 1024**2, "10.0"),
}


@pytest.fixture(scope="module")
def configs():
    return model_configs()


def _text(config):
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict):
            return config[key]
    return config


def _first(scope, *keys):
    for key in keys:
        if isinstance(scope.get(key), int) and not isinstance(scope.get(key), bool):
            return scope[key]
    return None


def test_the_wheel_ships_the_configs_the_issue_names(configs):
    assert len(configs) >= 85
    for name in ("nvidia--Kimi-K2.6-NVFP4", "moonshotai--Kimi-K2.5", "nvidia--Kimi-K2.5-NVFP4",
                 "nvidia--Kimi-K2.7-Code-NVFP4", "moonshotai--Kimi-K3", "deepseek-ai--DeepSeek-V3",
                 "openai--gpt-oss-120b", "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"):
        assert name in configs, name
    assert configs["nvidia--Kimi-K2.6-NVFP4"]["hf_quant_config"]["quantization"]["quant_algo"] == "NVFP4"


def test_every_config_reads_and_plans_on_every_host(configs):
    problems = []
    for name, files in sorted(configs.items()):
        config, text = files["config"], _text(files["config"])
        arch = normalize_config(config, None, files["hf_quant_config"])
        # What the config says, read here independently of regen_config.
        layers = _first(text, "num_hidden_layers", "n_layers", "num_layers")
        if layers is None and isinstance(text.get("layers_block_type"), list):
            layers = len(text["layers_block_type"])
        if layers is None and isinstance(text.get("hybrid_override_pattern"), str):
            layers = len(text["hybrid_override_pattern"])
        hidden = _first(text, "hidden_size", "d_model", "dim")
        experts = _first(text, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
        heads = _first(text, "num_attention_heads", "n_heads")
        if arch["num_layers"] != layers or arch["hidden_size"] != hidden:
            problems.append(f"{name}: layers/hidden {arch['num_layers']}/{arch['hidden_size']} != "
                            f"{layers}/{hidden}")
        got_experts = (arch["moe"] or {}).get("routed_experts")
        if (experts or 0) > 1 and got_experts != experts:
            problems.append(f"{name}: routed experts {got_experts} != {experts}")
        known = {arch["model_type"], arch["text_model_type"]} & set(FAMILIES)
        if not known and not any(repr(arch["model_type"]) in w and "not one regen knows" in w
                                 for w in arch["warnings"]):
            problems.append(f"{name}: unknown family {arch['model_type']} not named in the warnings")
        if not (arch["parameters"] or {}).get("total") or not arch["weight_estimate"]:
            problems.append(f"{name}: no parameter count or weight estimate from the facts it read")
            continue
        arch["weight_bytes"], arch["weight_bytes_source"] = arch["weight_estimate"]["bytes"], "estimate"
        for host, (count, per_gpu, cc) in HOSTS.items():
            plan = make_plan(arch, None, described(count, per_gpu, cc))
            serving = plan_values(plan)["serving"]
            tp, fits = serving["tp_size"], serving["fits"]
            where = f"{name} on {host}"
            if heads and heads % tp:
                problems.append(f"{where}: TP{tp} does not divide {heads} heads")
            suggested = re.search(r"\(TP(\d+), which divides", plan["serving"]["fits"]["reason"])
            if suggested and heads and heads % int(suggested.group(1)):
                problems.append(f"{where}: suggests TP{suggested.group(1)} for {heads} heads")
            # The plan takes the smallest power-of-two TP that holds weights/TP + the KV cache of its
            # kv_cache_tokens within GPU memory x mem_fraction_static: it fits iff some such TP exists.
            expected = _any_tp_fits(arch, per_gpu, serving, count, heads)
            if fits is not expected or (fits and not _fits_at(arch, per_gpu, serving, tp)):
                problems.append(f"{where}: fits={fits} disagrees with the arithmetic ({expected})")
            if fits and (serving["memory"] or {}).get("kv_pool_bytes_per_gpu", 0) <= 0:
                problems.append(f"{where}: fits but leaves no KV pool")
    assert not problems, "\n".join(problems)


def _kv_per_gpu(arch, tokens, tp):
    per_token = arch["kv_cache_bytes_per_token"] or 0
    attention = arch["attention"]
    if attention["kind"] == "mla" or not attention.get("kv_heads"):
        return per_token * tokens
    kv_heads = attention["kv_heads"]
    return per_token * tokens * max(1, kv_heads // tp) / kv_heads


def _fits_at(arch, per_gpu, serving, tp):
    usable = per_gpu * serving["mem_fraction_static"]
    return arch["weight_bytes"] / tp + _kv_per_gpu(arch, serving["kv_cache_tokens"], tp) <= usable


def _any_tp_fits(arch, per_gpu, serving, count, heads):
    tp = 1
    while tp <= count:
        if (heads or 1) % tp == 0 and _fits_at(arch, per_gpu, serving, tp):
            return True
        tp *= 2
    return False


def test_kimi_k2_6_nvfp4_weights_within_three_percent_of_553_gib(configs):
    files = configs["nvidia--Kimi-K2.6-NVFP4"]
    arch = normalize_config(files["config"], None, files["hf_quant_config"])
    estimate = arch["weight_estimate"]
    assert estimate["bytes"] == pytest.approx(553 * GIB, rel=0.03)
    routed = estimate["components"]["routed_experts"]
    # 60 MoE layers x 384 experts x 3 x 7,168 x 2,048, all NVFP4 (4 bits + an FP8 scale per 16 = 4.5 bits).
    assert routed["params"] == routed["quantized_params"] == 60 * 384 * 3 * 7168 * 2048
    # The exclude list keeps attention, shared experts, layer 0's dense MLP and the LM head in bf16.
    for name in ("attention", "shared_experts", "dense_mlp", "lm_head", "vision"):
        assert estimate["components"][name]["quantized_params"] == 0, name
    assert estimate["components"]["vision"]["params"] > 0.3e9  # MoonViT, 27 blocks of 1,152
    # The FP8 KV cache the checkpoint declares: 61 layers x (512 + 64) x 1 B.
    assert arch["kv_cache_bytes_per_token"] == 61 * 576


def test_kimi_k3_reads_its_hybrid_and_latent_moe(configs):
    arch = normalize_config(configs["moonshotai--Kimi-K3"]["config"])
    assert arch["attention"]["kv_layers"] == 24  # linear_attn_config.full_attn_layers
    assert arch["layer_pattern"]["mixer"].count("L") == 69  # Kimi Delta Attention layers
    assert arch["kv_cache_bytes_per_token"] == 24 * (512 + 64) * 2
    assert arch["recurrent_state_bytes_per_request"] > 0
    # Latent MoE: the 896 routed experts work at routed_expert_hidden_size 3,584, not at 7,168.
    routed = arch["parameters"]["components"]["routed_experts"]
    assert routed == 92 * 896 * 3 * 3584 * 3072
    assert arch["weight_estimate"]["scheme"] == "mxfp4"


def test_nemotron_h_counts_only_its_attention_layers_for_kv(configs):
    files = configs["nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"]
    arch = normalize_config(files["config"], None, files["hf_quant_config"])
    pattern = files["config"]["hybrid_override_pattern"]
    assert arch["attention"]["kv_layers"] == pattern.count("*") == 8
    assert arch["kv_cache_bytes_per_token"] == 8 * 2 * 2 * 128 * 1  # FP8 KV (kv_cache_quant_algo FP8)
    ultra = normalize_config(configs["nvidia--NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16"]["config"])
    blocks = configs["nvidia--NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16"]["config"]["layers_block_type"]
    assert ultra["num_layers"] == len(blocks) and ultra["attention"]["kv_layers"] == blocks.count("attention")
    assert ultra["weight_estimate"]["bytes"] == pytest.approx(550e9 * 2, rel=0.05)
