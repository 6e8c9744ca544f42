"""The MoE/quantization table and the (attention backend, KV dtype) table: one test per row, every value a
choice SGLang 0.5.23 accepts (the golden lines of test_serving_hardware.py go through its parser too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils import regen_kernel_tables as tables
from ansible.module_utils.regen_config import normalize_config, read_model_dir
from ansible.module_utils.regen_serving import KV_CACHE_DTYPES, MOE_RUNNER_BACKENDS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def test_every_value_is_one_sglang_accepts():
    values = tables.table_values()
    assert set(values["moe_runner_backend"]) <= set(MOE_RUNNER_BACKENDS)
    assert set(values["kv_cache_dtype"]) <= set(KV_CACHE_DTYPES)
    assert set(values["quantization"]) == {"modelopt_fp4"}
    assert all(row["sources"] for row in tables.MOE_TABLE + tables.KV_DTYPE_TABLE)


def _scheme(directory):
    return tables.serving_scheme(read_model_dir(str(CONFIGS / directory)))


def test_schemes_of_the_real_configs():
    assert _scheme("kimi-k2.6-nvfp4") == "modelopt_fp4"
    assert _scheme("kimi-k2.5") == "compressed_tensors_wna16"
    assert _scheme("kimi-k3") == "compressed_tensors_mxfp4"
    assert _scheme("deepseek-v3") == "fp8_block"
    assert _scheme("gpt-oss-120b") == "mxfp4"
    assert _scheme("qwen3-30b-a3b") == "none"


@pytest.mark.parametrize(("row", "cc", "model", "quantization", "runner"), [
    ("sm120-nvfp4", "12.0", "kimi-k2.6-nvfp4", "modelopt_fp4", "flashinfer_cutlass"),
    ("sm100-nvfp4", "10.0", "kimi-k2.6-nvfp4", "modelopt_fp4", "flashinfer_trtllm"),
    ("sm90-nvfp4", "9.0", "kimi-k2.6-nvfp4", "modelopt_fp4", "marlin"),
    ("sm100-wna16", "10.0", "kimi-k2.5", None, "flashinfer_trtllm"),
    ("wna16", "12.0", "kimi-k2.5", None, "marlin"),
    ("other", "12.0", "deepseek-v3", None, None),
])
def test_each_moe_row(row, cc, model, quantization, runner):
    chosen = tables.choose_moe(cc, read_model_dir(str(CONFIGS / model)))
    picked = (chosen["row"], chosen["quantization"], chosen["moe_runner_backend"])
    assert picked == (row, quantization, runner)
    assert chosen["reason"] and chosen["sources"]


def test_the_sm120_nvfp4_row_names_what_sglang_would_pick_and_avoid():
    chosen = tables.choose_moe("12.0", read_model_dir(str(CONFIGS / "kimi-k2.6-nvfp4")))
    assert "flashinfer_trtllm" in chosen["avoid"] and "SM100-only" in chosen["reason"]
    assert tables.choose_moe("12.0", read_model_dir(str(CONFIGS / "qwen3-8b")))["row"] is None  # dense
    assert tables.choose_moe(None, read_model_dir(str(CONFIGS / "kimi-k2.5")))["row"] is None


def test_the_kv_dtype_rows():
    declared = {"dtype": "fp8_e4m3", "bytes": 1, "declared": "hf_quant_config.json kv_cache_quant_algo FP8"}
    flashinfer = tables.choose_kv_dtype("flashinfer", "mla", declared)
    assert (flashinfer["value"], flashinfer["bytes"], flashinfer["row"]) == ("bf16", 2, "flashinfer-mla-bf16")
    assert "fp8_e4m3" in flashinfer["avoid"] and "not used" in flashinfer["reason"]
    trtllm = tables.choose_kv_dtype("trtllm_mla", "mla", declared)
    assert (trtllm["value"], trtllm["row"]) == ("fp8_e4m3", None)
    assert tables.choose_kv_dtype("flashinfer", "gqa", None)["value"] is None  # GQA reads FP8 natively


def test_ep_risk_is_named_on_sm120_only():
    assert "21132" in tables.ep_risk("12.0", 8)
    assert tables.ep_risk("12.0", 1) is None and tables.ep_risk("10.0", 8) is None


def test_the_config_estimate_is_within_three_percent_of_every_real_index():
    # Every model directory here with a safetensors index (total_size), and the Kimi K2 Instruct shards'
    # published 958.51 GiB (tests/fixtures/configs/README.md).
    checked = 0
    for index in sorted(CONFIGS.glob("*/model.safetensors.index.json")):
        directory = index.parent
        arch = read_model_dir(str(directory))
        total = json.loads(index.read_text())["metadata"]["total_size"]
        assert arch["weight_estimate"]["bytes"] == pytest.approx(total, rel=0.03), directory.name
        checked += 1
    assert checked >= 1
    kimi_k2 = normalize_config(json.loads((CONFIGS / "kimi-k2-instruct" / "config.json").read_text()))
    assert kimi_k2["weight_estimate"]["bytes"] == pytest.approx(958.51 * 2**30, rel=0.03)
