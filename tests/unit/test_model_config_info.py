"""model_config_info: real public configs, broken inputs, random JSON shapes, and the module wrapper."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"

from ansible.module_utils.regen_config import ModelDirError, normalize_config, read_model_dir

from tests.helpers.modules import run_module


def _raw(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text(encoding="utf-8"))


# --- real configs of the families -----------------------------------------------------------------


def test_deepseek_v3_mla_moe_fp8() -> None:
    raw = _raw("deepseek-v3")
    arch = read_model_dir(str(FIXTURES / "deepseek-v3"))
    assert (arch["model_type"], arch["text_model_type"]) == ("deepseek_v3", "deepseek_v3")
    assert arch["architectures"] == ["DeepseekV3ForCausalLM"]
    assert arch["hidden_size"] == raw["hidden_size"] and arch["num_layers"] == raw["num_hidden_layers"]
    assert arch["vocab_size"] == raw["vocab_size"]
    assert arch["max_position_embeddings"] == raw["max_position_embeddings"]
    att = arch["attention"]
    assert att["kind"] == "mla"
    assert (att["kv_lora_rank"], att["q_lora_rank"]) == (raw["kv_lora_rank"], raw["q_lora_rank"])
    assert att["head_dim"] == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    moe = arch["moe"]
    assert moe["routed_experts"] == raw["n_routed_experts"]
    assert moe["shared_experts"] == raw["n_shared_experts"]
    assert moe["experts_per_token"] == raw["num_experts_per_tok"]
    assert moe["expert_intermediate_size"] == raw["moe_intermediate_size"]
    assert moe["dense_prefix_layers"] == raw["first_k_dense_replace"]
    assert (moe["n_group"], moe["topk_group"]) == (raw["n_group"], raw["topk_group"])
    assert moe["moe_layers"] == raw["num_hidden_layers"] - raw["first_k_dense_replace"]
    assert arch["mtp_layers"] == raw["num_nextn_predict_layers"]
    quant = arch["quantization"]
    assert (quant["method"], quant["bits"], quant["format"]) == ("fp8", 8, "e4m3")
    assert quant["weight_block_size"] == [128, 128]
    assert arch["special_token_ids"] == {
        "bos": raw["bos_token_id"],
        "eos": [raw["eos_token_id"]],
        "pad": None,
    }
    # DeepSeek publishes 671B total and 37B activated parameters (MTP excluded).
    assert arch["parameters"]["total"] == pytest.approx(671e9, rel=0.02)
    assert arch["parameters"]["active"] == pytest.approx(37e9, rel=0.05)
    assert arch["weight_bytes_source"] == "estimate" and arch["weight_bytes"] > 600e9
    assert arch["warnings"] == []


def test_kimi_k25_nested_text_config_and_int4_experts() -> None:
    raw = _raw("kimi-k2.5")
    text = raw["text_config"]
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    assert arch["model_type"] == "kimi_k25"
    assert arch["text_model_type"] == text["model_type"]
    assert arch["text_config_key"] == "text_config"
    assert arch["hidden_size"] == text["hidden_size"] and arch["num_layers"] == text["num_hidden_layers"]
    assert arch["vocab_size"] == text["vocab_size"]
    assert arch["attention"]["kind"] == "mla"
    assert arch["moe"]["routed_experts"] == text["n_routed_experts"] == 384
    assert arch["moe"]["dense_prefix_layers"] == text["first_k_dense_replace"]
    quant = arch["quantization"]
    assert (quant["method"], quant["bits"], quant["group_size"]) == ("compressed-tensors", 4, 32)
    assert "re:.*self_attn.*" in quant["ignores"]
    assert arch["special_token_ids"]["bos"] == raw["bos_token_id"]
    assert arch["special_token_ids"]["pad"] == raw["pad_token_id"]
    # Moonshot: 1T total, 32B activated; the published checkpoint is 595 GB (int4 experts, bf16 rest).
    assert arch["parameters"]["total"] == pytest.approx(1.03e12, rel=0.03)
    assert arch["parameters"]["active"] == pytest.approx(32.9e9, rel=0.05)
    assert arch["weight_bytes"] == pytest.approx(595e9, rel=0.03)


def test_qwen3_dense_and_moe() -> None:
    dense = read_model_dir(str(FIXTURES / "qwen3-8b"))
    assert dense["moe"] is None
    assert dense["attention"]["kind"] == "gqa"
    assert dense["attention"]["head_dim"] == 4096 // 32
    assert dense["parameters"]["total"] == dense["parameters"]["active"]
    assert dense["parameters"]["total"] == pytest.approx(8.2e9, rel=0.03)
    raw = _raw("qwen3-30b-a3b")
    moe = read_model_dir(str(FIXTURES / "qwen3-30b-a3b"))
    assert moe["moe"]["routed_experts"] == raw["num_experts"]
    assert moe["moe"]["experts_per_token"] == raw["num_experts_per_tok"]
    assert moe["moe"]["shared_experts"] == 0
    assert moe["moe"]["dense_prefix_layers"] == 0
    assert moe["moe"]["n_group"] is None and moe["moe"]["topk_group"] is None
    assert moe["attention"]["head_dim"] == raw["head_dim"]
    assert moe["parameters"]["total"] == pytest.approx(30.5e9, rel=0.03)
    assert moe["parameters"]["active"] == pytest.approx(3.3e9, rel=0.1)


def test_qwen35_wrapper_hybrid_attention() -> None:
    raw = _raw("qwen3.5-27b")
    arch = read_model_dir(str(FIXTURES / "qwen3.5-27b"))
    assert (arch["model_type"], arch["text_model_type"]) == ("qwen3_5", "qwen3_5_text")
    assert arch["hidden_size"] == raw["text_config"]["hidden_size"]
    counts = arch["attention"]["layer_types"]
    assert counts["linear_attention"] + counts["full_attention"] == raw["text_config"]["num_hidden_layers"]
    assert arch["attention"]["linear"]["value_heads"] == raw["text_config"]["linear_num_value_heads"]
    # Only the full-attention layers keep a KV cache.
    full = counts["full_attention"]
    assert arch["kv_cache_bytes_per_token"] == full * 2 * 4 * 256 * 2
    assert arch["special_token_ids"]["eos"] == [raw["text_config"]["eos_token_id"]]


def test_gpt_oss_mxfp4_experts_and_generation_config() -> None:
    arch = read_model_dir(str(FIXTURES / "gpt-oss-120b"))
    gen = json.loads((FIXTURES / "gpt-oss-120b" / "generation_config.json").read_text())
    assert arch["moe"]["routed_experts"] == 128 and arch["moe"]["experts_per_token"] == 4
    assert arch["moe"]["expert_intermediate_size"] == 2880  # experts are full-width MLPs
    assert arch["quantization"]["method"] == "mxfp4" and arch["quantization"]["bits"] == 4
    assert "lm_head" in arch["quantization"]["ignores"]
    assert arch["attention"]["sliding_window"] == 128
    assert arch["attention"]["layer_types"] == {"sliding_attention": 18, "full_attention": 18}
    # eos ids: the config's, then the generation config's extra ones.
    assert arch["special_token_ids"]["eos"] == gen["eos_token_id"]
    assert arch["special_token_ids"]["bos"] == gen["bos_token_id"]
    assert arch["generation_defaults"] == {"do_sample": True}
    assert arch["parameters"]["total"] == pytest.approx(117e9, rel=0.03)


def test_llama3_eos_list() -> None:
    raw = _raw("llama-3.1-8b-instruct")
    arch = read_model_dir(str(FIXTURES / "llama-3.1-8b-instruct"))
    assert arch["special_token_ids"]["eos"] == raw["eos_token_id"]
    assert arch["attention"]["kind"] == "gqa" and arch["moe"] is None
    assert arch["parameters"]["total"] == pytest.approx(8.03e9, rel=0.02)


def test_kimi_k2_flat_config_fp8() -> None:
    raw = _raw("kimi-k2-instruct")
    arch = read_model_dir(str(FIXTURES / "kimi-k2-instruct"))
    assert (arch["model_type"], arch["text_model_type"], arch["text_config_key"]) == (
        "kimi_k2",
        "kimi_k2",
        None,
    )
    assert arch["architectures"] == raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert arch["vocab_size"] == raw["vocab_size"] == 163840
    assert arch["max_position_embeddings"] == raw["max_position_embeddings"]
    att = arch["attention"]
    assert att["kind"] == "mla" and att["kv_lora_rank"] == raw["kv_lora_rank"]
    assert att["head_dim"] == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    moe = arch["moe"]
    assert moe["routed_experts"] == raw["n_routed_experts"] == 384
    assert moe["shared_experts"] == raw["n_shared_experts"] == 1
    assert moe["experts_per_token"] == raw["num_experts_per_tok"] == 8
    assert moe["dense_prefix_layers"] == raw["first_k_dense_replace"] == 1
    assert moe["moe_layers"] == raw["num_hidden_layers"] - raw["first_k_dense_replace"]
    assert moe["routed_scaling_factor"] == raw["routed_scaling_factor"]
    assert arch["mtp_layers"] == raw["num_nextn_predict_layers"] == 0
    quant = arch["quantization"]
    assert (quant["method"], quant["bits"], quant["format"]) == ("fp8", 8, "e4m3")
    assert quant["weight_block_size"] == raw["quantization_config"]["weight_block_size"]
    assert arch["special_token_ids"] == {
        "bos": raw["bos_token_id"],
        "eos": [raw["eos_token_id"]],
        "pad": None,
    }
    layers, latent = raw["num_hidden_layers"], raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert arch["kv_cache_bytes_per_token"] == layers * latent * 2
    # The same public report counts 1,026,470,731,056 parameters in the 61 shards, 958.51 GiB on disk.
    assert arch["parameters"]["total"] == pytest.approx(1_026_470_731_056, rel=0.005)
    assert arch["weight_bytes"] == pytest.approx(958.51 * 2**30, rel=0.01)
    assert arch["warnings"] == []


def test_deepseek_v32_is_known_and_reads_like_v3() -> None:
    raw = _raw("deepseek-v3.2")
    arch = read_model_dir(str(FIXTURES / "deepseek-v3.2"))
    assert (arch["model_type"], arch["text_model_type"]) == ("deepseek_v32", "deepseek_v32")
    assert arch["warnings"] == []  # deepseek_v32 is a known family now
    assert (
        arch["attention"]["kind"] == "mla" and arch["attention"]["heads"] == raw["num_attention_heads"] == 128
    )
    moe = arch["moe"]
    assert (moe["routed_experts"], moe["shared_experts"]) == (
        raw["n_routed_experts"],
        raw["n_shared_experts"],
    )
    assert (moe["n_group"], moe["topk_group"]) == (raw["n_group"], raw["topk_group"]) == (8, 4)
    assert moe["dense_prefix_layers"] == raw["first_k_dense_replace"] == 3
    assert arch["mtp_layers"] == raw["num_nextn_predict_layers"] == 1
    assert arch["quantization"]["method"] == raw["quantization_config"]["quant_method"] == "fp8"
    assert arch["max_position_embeddings"] == raw["max_position_embeddings"] == 163840
    # 671B without the MTP layer; the report's 685,396,921,376 counts the MTP layer's tensors too.
    assert arch["parameters"]["total"] == pytest.approx(671e9, rel=0.02)
    assert arch["parameters"]["total"] < 685_396_921_376


def test_qwen3_next_layer_types_from_full_attention_interval() -> None:
    raw = _raw("qwen3-next-80b-a3b-instruct")
    assert "layer_types" not in raw  # the published file only has full_attention_interval
    arch = read_model_dir(str(FIXTURES / "qwen3-next-80b-a3b-instruct"))
    assert (arch["model_type"], arch["text_model_type"]) == ("qwen3_next", "qwen3_next")
    full = raw["num_hidden_layers"] // raw["full_attention_interval"]
    assert arch["attention"]["layer_types"] == {
        "linear_attention": raw["num_hidden_layers"] - full,
        "full_attention": full,
    }
    assert arch["attention"]["linear"]["value_heads"] == raw["linear_num_value_heads"] == 32
    assert arch["attention"]["kind"] == "gqa" and arch["attention"]["head_dim"] == raw["head_dim"]
    # Only the 12 full-attention layers keep K and V (2 KV heads of 256, bf16).
    assert arch["kv_cache_bytes_per_token"] == full * 2 * raw["num_key_value_heads"] * raw["head_dim"] * 2
    moe = arch["moe"]
    assert moe["routed_experts"] == raw["num_experts"] == 512
    assert moe["experts_per_token"] == raw["num_experts_per_tok"] == 10
    assert moe["shared_experts"] == 1
    assert moe["shared_expert_intermediate_size"] == raw["shared_expert_intermediate_size"]
    assert moe["expert_intermediate_size"] == raw["moe_intermediate_size"]
    assert arch["special_token_ids"]["eos"] == [raw["eos_token_id"]]
    # Qwen: 80B total, about 3B activated.
    assert arch["parameters"]["total"] == pytest.approx(80e9, rel=0.02)
    assert arch["parameters"]["active"] < 4e9
    assert arch["warnings"] == []


def test_qwen35_moe_wrapper() -> None:
    raw = _raw("qwen3.5-35b-a3b")
    text = raw["text_config"]
    arch = read_model_dir(str(FIXTURES / "qwen3.5-35b-a3b"))
    assert (arch["model_type"], arch["text_model_type"]) == ("qwen3_5_moe", "qwen3_5_moe_text")
    assert arch["text_config_key"] == "text_config"
    assert arch["hidden_size"] == text["hidden_size"] and arch["vocab_size"] == text["vocab_size"]
    counts = arch["attention"]["layer_types"]
    assert counts == {
        "linear_attention": text["layer_types"].count("linear_attention"),
        "full_attention": text["layer_types"].count("full_attention"),
    }
    moe = arch["moe"]
    assert (moe["routed_experts"], moe["experts_per_token"]) == (
        text["num_experts"],
        text["num_experts_per_tok"],
    )
    assert moe["shared_experts"] == 1
    assert moe["shared_expert_intermediate_size"] == text["shared_expert_intermediate_size"]
    assert arch["mtp_layers"] == text["mtp_num_hidden_layers"] == 1
    full = counts["full_attention"]
    assert arch["kv_cache_bytes_per_token"] == full * 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    assert arch["special_token_ids"]["eos"] == [text["eos_token_id"]]
    assert arch["parameters"]["total"] == pytest.approx(35e9, rel=0.03)


def test_glm45_air_gqa_moe_with_shared_expert() -> None:
    raw = _raw("glm-4.5-air")
    arch = read_model_dir(str(FIXTURES / "glm-4.5-air"))
    assert (arch["model_type"], arch["text_model_type"]) == ("glm4_moe", "glm4_moe")
    att = arch["attention"]
    assert (att["kind"], att["heads"], att["kv_heads"]) == ("gqa", raw["num_attention_heads"], 8)
    assert att["head_dim"] == raw["head_dim"] == 128
    moe = arch["moe"]
    assert moe["routed_experts"] == raw["n_routed_experts"] == 128
    assert moe["shared_experts"] == raw["n_shared_experts"] == 1
    assert moe["experts_per_token"] == raw["num_experts_per_tok"] == 8
    assert moe["expert_intermediate_size"] == raw["moe_intermediate_size"]
    assert moe["shared_expert_intermediate_size"] == raw["moe_intermediate_size"]
    assert moe["dense_prefix_layers"] == raw["first_k_dense_replace"]
    assert moe["moe_layers"] == raw["num_hidden_layers"] - raw["first_k_dense_replace"] == 45
    assert arch["mtp_layers"] == raw["num_nextn_predict_layers"] == 1
    assert arch["special_token_ids"] == {"bos": None, "eos": raw["eos_token_id"], "pad": raw["pad_token_id"]}
    # Z.ai: 106B total, 12B active (embeddings and head aside).
    assert arch["parameters"]["total"] == pytest.approx(106e9, rel=0.02)
    embed_and_head = 2 * raw["vocab_size"] * raw["hidden_size"]
    assert arch["parameters"]["active"] - embed_and_head == pytest.approx(12e9, rel=0.03)
    assert arch["warnings"] == []


def test_glm47_flash_mla_moe_lite() -> None:
    raw = _raw("glm-4.7-flash")
    arch = read_model_dir(str(FIXTURES / "glm-4.7-flash"))
    assert (arch["model_type"], arch["text_model_type"]) == ("glm4_moe_lite", "glm4_moe_lite")
    assert arch["warnings"] == []
    att = arch["attention"]
    assert att["kind"] == "mla" and (att["kv_lora_rank"], att["q_lora_rank"]) == (512, 768)
    assert att["head_dim"] == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] == 256
    moe = arch["moe"]
    assert (moe["routed_experts"], moe["shared_experts"]) == (
        raw["n_routed_experts"],
        raw["n_shared_experts"],
    )
    assert moe["experts_per_token"] == raw["num_experts_per_tok"] == 4
    assert moe["dense_prefix_layers"] == raw["first_k_dense_replace"] == 1
    assert arch["mtp_layers"] == raw["num_nextn_predict_layers"] == 1
    assert arch["dtype"] == raw["dtype"] == "bfloat16"
    assert arch["special_token_ids"]["eos"] == raw["eos_token_id"]
    assert arch["special_token_ids"]["pad"] == raw["pad_token_id"]
    layers, latent = raw["num_hidden_layers"], raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert arch["kv_cache_bytes_per_token"] == layers * latent * 2
    # 30B-A3B; the report's 31,221,488,576 also counts the MTP layer (its own embedding and head).
    assert arch["parameters"]["total"] == pytest.approx(30e9, rel=0.03)
    assert arch["parameters"]["total"] < 31_221_488_576


def test_mixtral_num_local_experts_full_width() -> None:
    raw = _raw("mixtral-8x7b-v0.1")
    arch = read_model_dir(str(FIXTURES / "mixtral-8x7b-v0.1"))
    assert (arch["model_type"], arch["text_model_type"]) == ("mixtral", "mixtral")
    att = arch["attention"]
    assert (att["kind"], att["kv_heads"], att["head_dim"]) == ("gqa", raw["num_key_value_heads"], 128)
    assert att["sliding_window"] is None and raw["sliding_window"] is None
    moe = arch["moe"]
    assert moe["routed_experts"] == raw["num_local_experts"] == 8
    assert moe["experts_per_token"] == raw["num_experts_per_tok"] == 2
    assert moe["shared_experts"] == 0 and moe["shared_expert_intermediate_size"] is None
    assert moe["expert_intermediate_size"] == raw["intermediate_size"]  # experts are full-width MLPs
    assert moe["moe_layers"] == raw["num_hidden_layers"]
    assert arch["special_token_ids"] == {
        "bos": raw["bos_token_id"],
        "eos": [raw["eos_token_id"]],
        "pad": None,
    }
    # Mistral AI: 46.7B total, 12.9B active per token.
    assert arch["parameters"]["total"] == pytest.approx(46.7e9, rel=0.01)
    assert arch["parameters"]["active"] == pytest.approx(12.9e9, rel=0.01)
    assert arch["warnings"] == []


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file()))
def test_every_real_config_reads_without_warnings(name: str) -> None:
    arch = read_model_dir(str(FIXTURES / name))
    assert arch["warnings"] == []
    assert arch["attention"]["kind"] in ("mla", "gqa", "mha")
    assert arch["parameters"]["total"] and arch["kv_cache_bytes_per_token"]


# --- weights from safetensors metadata --------------------------------------------------------------


def _write_shard(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    header, offset = {}, 0
    sizes = {"BF16": 2, "F32": 4, "I32": 4}
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + count * sizes[dtype]],
        }
        offset += count * sizes[dtype]
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)
    return offset


def test_weight_bytes_from_headers_when_index_has_no_total(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    expected = _write_shard(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [16, 8])})
    expected += _write_shard(
        tmp_path / "model-00002-of-00002.safetensors", {"b": ("F32", [4]), "c": ("I32", [3])}
    )
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}}))
    arch = read_model_dir(str(tmp_path))
    assert arch["weight_bytes"] == expected
    assert arch["weight_bytes_source"] == "safetensors_headers"
    assert arch["weight_bytes_by_dtype"] == {"BF16": 256, "F32": 16, "I32": 12}


def test_weight_bytes_from_index_total(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16381470720}})
    )
    arch = read_model_dir(str(tmp_path))
    assert (arch["weight_bytes"], arch["weight_bytes_source"]) == (16381470720, "safetensors_index")


def test_corrupt_shard_header_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 40) + b"{not json")
    arch = read_model_dir(str(tmp_path))
    assert arch["weight_bytes_source"] == "estimate"
    assert any("model.safetensors" in w and "corrupt" in w for w in arch["warnings"])


# --- broken inputs ------------------------------------------------------------------------------------


def test_missing_directory_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"does not exist.*regen_model_path"):
        read_model_dir(str(tmp_path / "nope"))


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"config.json not found in .*Hugging Face model directory"):
        read_model_dir(str(tmp_path))


def test_truncated_config_json_says_truncated(tmp_path: Path) -> None:
    text = (FIXTURES / "deepseek-v3" / "config.json").read_text()
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelDirError) as err:
        read_model_dir(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "config.json") in message and "truncated" in message and "line" in message


def test_invalid_json_in_the_middle(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",, "hidden_size": 8}')
    with pytest.raises(ModelDirError, match=r"config.json is not valid JSON at line 1 column 24"):
        read_model_dir(str(tmp_path))


def test_empty_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("  \n")
    with pytest.raises(ModelDirError, match="is empty"):
        read_model_dir(str(tmp_path))


@pytest.mark.parametrize("value", [[1, 2], "deepseek", 3])
def test_text_config_not_an_object(value: object) -> None:
    with pytest.raises(ModelDirError, match=r"text_config must be a JSON object"):
        normalize_config({"model_type": "kimi_k25", "text_config": value})


def test_top_level_not_an_object() -> None:
    with pytest.raises(ModelDirError, match="top level must be a JSON object"):
        normalize_config([{"hidden_size": 8}])


def test_broken_generation_config_is_a_warning(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text("{")
    arch = read_model_dir(str(tmp_path))
    assert any("generation_config.json" in w and "ignored" in w for w in arch["warnings"])


def test_unknown_architecture_returns_what_it_can() -> None:
    arch = normalize_config(
        {"model_type": "mystery", "hidden_size": 512, "num_hidden_layers": "six", "num_attention_heads": True}
    )
    assert arch["hidden_size"] == 512 and arch["num_layers"] is None
    assert arch["attention"]["kind"] is None
    text = " ".join(arch["warnings"])
    assert "mystery" in text and "num_hidden_layers is 'six'" in text and "num_attention_heads" in text


def test_an_absurd_layer_count_is_ignored_not_allocated() -> None:
    # The layer pattern holds a character per layer: 2**40 layers (a damaged file, or the property test
    # below) once took the test run's 23 GB before the OOM killer stopped it.
    arch = normalize_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2**40,
                             "num_attention_heads": 4, "vocab_size": 100})  # fmt: skip
    assert arch["num_layers"] is None and arch["layer_pattern"] is None
    assert any("num_hidden_layers is 1099511627776, more than 10,000" in w for w in arch["warnings"])


# --- property test: random JSON shapes never crash the parser ---------------------------------------

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_keys = st.sampled_from(
    [
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "mlp_only_layers",
        "decoder_sparse_step",
        "n_shared_experts",
        "quantization_config",
        "eos_token_id",
        "layer_types",
        "head_dim",
        "tie_word_embeddings",
        "torch_dtype",
        "architectures",
        "intermediate_size",
    ]
)
_configs = st.dictionaries(_keys, _json_values, max_size=12)


@settings(max_examples=300, deadline=None)
@given(top=_configs, text=st.one_of(st.none(), _configs, _json_values), gen=st.one_of(st.none(), _configs))
def test_random_shapes_give_facts_or_a_clear_error(top: dict, text: object, gen: object) -> None:
    config = dict(top)
    if text is not None:
        config["text_config"] = text
    try:
        arch = normalize_config(config, gen)
    except ModelDirError as exc:
        assert "text_config" in str(exc)
        return
    for key in ("hidden_size", "num_layers", "vocab_size", "max_position_embeddings"):
        assert arch[key] is None or (type(arch[key]) is int and arch[key] > 0)
    assert arch["attention"]["kind"] in (None, "mla", "gqa", "mha")
    assert arch["moe"] is None or arch["moe"]["routed_experts"] > 1
    assert all(type(i) is int for i in arch["special_token_ids"]["eos"])
    assert isinstance(arch["warnings"], list)
    json.dumps(arch)  # the facts must serialize (Ansible returns them as JSON)


# --- the module wrapper -------------------------------------------------------------------------------


def _run_module(args: dict, capsys: pytest.CaptureFixture[str]) -> dict:
    return run_module("model_config_info", args, capsys)


def test_module_returns_facts_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    result = _run_module({"path": str(FIXTURES / "kimi-k2.5"), "_ansible_check_mode": True}, capsys)
    assert result["changed"] is False
    assert result["architecture"]["moe"]["routed_experts"] == 384


def test_module_fail_json_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k25", "text_config": []}')
    result = _run_module({"path": str(tmp_path)}, capsys)
    assert result["failed"] is True
    assert "text_config must be a JSON object" in result["msg"]
    assert "Traceback" not in json.dumps(result)
