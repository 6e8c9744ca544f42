"""The demo model's pure parts: config layout, token layout, checkpoint keys, BPE ranks, input hash.

The real Kimi K2.5 config.json (tests/fixtures/configs/kimi-k2.5/config.json) is the yardstick: the demo
must carry the same structure (keys, nesting, token-id offsets), only smaller.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from regen.demo import bpe, build, spec, weights
from regen.demo.model_files import tokenization_kimi

ROOT = Path(__file__).resolve().parents[2]
REAL = json.loads((ROOT / "tests/fixtures/configs/kimi-k2.5/config.json").read_text())
REAL_NUM_RANKS = 163584  # the real vocabulary (163840) minus its 256 special ids

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = (
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "norm_topk_prob",
    "routed_scaling_factor",
)


@pytest.fixture(scope="module")
def demo() -> spec.DemoSpec:
    return spec.DemoSpec()


def test_config_nests_the_deepseek_v3_text_model_like_the_real_checkpoint(demo: spec.DemoSpec) -> None:
    config = spec.model_config(demo)
    text = config["text_config"]

    assert config["model_type"] == "kimi_k25_demo"
    assert config["architectures"] == ["KimiK25DemoForConditionalGeneration"]
    assert text["model_type"] == "kimi_k2"
    assert "vision_config" in config and "vision_config" in REAL
    # Architecture fields live only in text_config, in the real checkpoint and here.
    for key in (*MLA_KEYS, *MOE_KEYS, "hidden_size", "num_hidden_layers", "vocab_size"):
        assert key in REAL["text_config"] and key not in REAL
        assert key in text and key not in config
        assert type(text[key]) is type(REAL["text_config"][key]), key
    assert (text["n_shared_experts"], text["num_experts_per_tok"]) == (1, 2)
    assert 0 < text["first_k_dense_replace"] < text["num_hidden_layers"]
    assert text["n_routed_experts"] % text["n_group"] == 0
    assert text["vocab_size"] == demo.num_bpe_ranks + 256
    assert config["dtype"] == text["dtype"] == REAL["dtype"] == "bfloat16"


def test_config_keeps_every_top_level_key_of_the_real_one_but_quantization(demo: spec.DemoSpec) -> None:
    ours = spec.model_config(demo)
    missing = set(REAL) - set(ours) - {"quantization_config", "transformers_version"}
    assert not missing
    assert (
        set(ours["auto_map"]) == set(REAL["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    )
    for target in ours["auto_map"].values():
        module = target.split(".")[0]
        assert f"{module}.py" in build.MODEL_FILES


def test_special_tokens_sit_above_the_ranks_at_the_real_offsets(demo: spec.DemoSpec) -> None:
    tokens = spec.special_tokens(demo)
    ranks = demo.num_bpe_ranks

    assert sorted(tokens) == list(range(ranks, ranks + 256))
    assert len(set(tokens.values())) == 256
    # The same offsets as the real ids in config.json.
    config = spec.model_config(demo)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
        assert config[key] - ranks == REAL[key] - REAL_NUM_RANKS, key
    assert tokens[ranks + 2] == "<|im_end|>"
    assert tokens[ranks + 5] == f"<|reserved_token_{ranks + 5}|>"
    for name in ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>"):
        assert name in tokens.values()


def test_tokenizer_config_declares_a_remote_slow_tokenizer_with_all_specials(demo: spec.DemoSpec) -> None:
    config = spec.tokenizer_config(demo)

    assert config["auto_map"]["AutoTokenizer"] == ["tokenization_kimi.TikTokenTokenizer", None]
    assert config["tokenizer_class"] == "TikTokenTokenizer"
    decoder = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    assert decoder == spec.special_tokens(demo)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert config[name] in decoder.values()
    assert "<think>" not in config["additional_special_tokens"]


def test_generation_stops_at_the_end_of_a_turn(demo: spec.DemoSpec) -> None:
    assert spec.generation_config(demo)["eos_token_id"] == spec.special_token_id(demo, "<|im_end|>")


def test_checkpoint_keys_follow_the_real_layout(demo: spec.DemoSpec) -> None:
    layout = {t.key: t for t in weights.checkpoint_layout(demo)}
    layer = "language_model.model.layers."

    assert all(key.startswith("language_model.") for key in layout)
    assert layout["language_model.lm_head.weight"].shape == (demo.vocab_size, demo.hidden_size)
    assert f"{layer}0.mlp.gate_proj.weight" in layout  # dense prefix layer
    assert f"{layer}0.mlp.experts.0.gate_proj.weight" not in layout
    last = demo.num_hidden_layers - 1
    for expert in range(demo.n_routed_experts):  # one tensor per expert, never fused
        assert layout[f"{layer}{last}.mlp.experts.{expert}.down_proj.weight"].shape == (
            demo.hidden_size,
            demo.moe_intermediate_size,
        )
    assert not any("gate_up_proj" in key for key in layout)
    assert layout[f"{layer}1.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert layout[f"{layer}1.self_attn.kv_a_proj_with_mqa.weight"].shape == (
        demo.kv_lora_rank + demo.qk_rope_head_dim,
        demo.hidden_size,
    )
    heads = demo.num_attention_heads
    assert layout[f"{layer}1.self_attn.q_b_proj.weight"].shape == (
        heads * (demo.qk_nope_head_dim + demo.qk_rope_head_dim),
        demo.q_lora_rank,
    )


def test_layers_spread_over_shards_and_the_head_goes_last(demo: spec.DemoSpec) -> None:
    layout = weights.checkpoint_layout(demo)
    placement = weights.assign_shards(demo, layout)
    names = weights.shard_names(demo.num_shards)

    assert set(placement.values()) == set(names)
    assert placement["language_model.lm_head.weight"] == names[-1]
    assert placement["language_model.model.layers.0.input_layernorm.weight"] == names[0]
    for tensor in layout:  # a layer never straddles two shards
        if tensor.layer is not None:
            first = placement[f"language_model.model.layers.{tensor.layer}.input_layernorm.weight"]
            assert placement[tensor.key] == first


@pytest.fixture(scope="module")
def ranks(demo: spec.DemoSpec) -> dict[bytes, int]:
    return bpe.train_ranks(bpe.training_texts(), demo.num_bpe_ranks, tokenization_kimi.PAT_STR)


def test_bpe_ranks_start_with_every_byte_and_merge_in_rank_order(ranks: dict[bytes, int]) -> None:
    assert len(ranks) == spec.DemoSpec().num_bpe_ranks
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    for token, rank in ranks.items():
        if rank >= 256:  # each merge joins two pieces learned before it
            assert any(
                ranks.get(token[:cut], rank) < rank and ranks.get(token[cut:], rank) < rank
                for cut in range(1, len(token))
            ), token


def test_bpe_training_is_deterministic(ranks: dict[bytes, int]) -> None:
    again = bpe.train_ranks(bpe.training_texts(), len(ranks), tokenization_kimi.PAT_STR)
    assert bpe.dump_tiktoken(again) == bpe.dump_tiktoken(ranks)


def test_tiktoken_file_round_trips_and_encodes_text(tmp_path: Path, ranks: dict[bytes, int]) -> None:
    path = tmp_path / "tiktoken.model"
    path.write_bytes(bpe.dump_tiktoken(ranks))
    assert load_tiktoken_bpe(str(path)) == ranks

    encoding = tiktoken.Encoding(
        "demo", pat_str=tokenization_kimi.PAT_STR, mergeable_ranks=ranks, special_tokens={}
    )
    text = "The ledger skips finished ids. 推测解码让草稿模型先猜。 x = 12345\n"
    tokens = encoding.encode(text)
    assert encoding.decode(tokens) == text
    assert len(tokens) < len(text.encode()) / 2  # merges were learned, not just bytes


def test_too_small_a_corpus_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"only yields \d+ BPE ranks"):
        bpe.train_ranks(["ab ab"], 600, tokenization_kimi.PAT_STR)


def test_spec_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        replace(spec.DemoSpec(), first_k_dense_replace=4).validate()
    with pytest.raises(ValueError, match="seed"):
        replace(spec.DemoSpec(), seed=-1).validate()
    with pytest.raises(ValueError, match="pretrain_steps=-1"):
        replace(spec.DemoSpec(), pretrain_steps=-1).validate()
    with pytest.raises(ValueError, match="pretrain_threads=0"):
        replace(spec.DemoSpec(), pretrain_threads=0).validate()
    with pytest.raises(ValueError, match="pretrain_learning_rate"):
        replace(spec.DemoSpec(), pretrain_learning_rate=0.0).validate()


def test_input_hash_follows_the_seed_and_the_pretraining_and_is_stable() -> None:
    base = spec.DemoSpec()
    assert build.inputs_digest(base) == build.inputs_digest(spec.DemoSpec())
    assert build.inputs_digest(base) != build.inputs_digest(replace(base, seed=1))
    assert build.inputs_digest(base) != build.inputs_digest(replace(base, pretrain_steps=0))


def test_model_files_agree_on_the_architecture_name() -> None:
    from regen.demo.model_files import configuration_kimi_k25_demo

    assert configuration_kimi_k25_demo.ARCHITECTURE == spec.ARCHITECTURE
    assert tokenization_kimi.NUM_RESERVED_SPECIAL_TOKENS == spec.NUM_RESERVED_SPECIAL_TOKENS
