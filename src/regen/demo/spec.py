"""What the demo model is: sizes, token layout and the config files derived from them (pure data).

The demo mirrors the real Kimi K2.6 checkpoint at tiny scale: a multimodal-style wrapper config with the
DeepSeek-V3 language model nested under ``text_config`` (MLA attention, routed + shared experts, a dense
prefix layer, sigmoid top-k routing), 256 special-token ids above the BPE ranks, the same special-token
offsets, and the same checkpoint key layout (``language_model.*``, one tensor per routed expert).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODEL_TYPE = "kimi_k25_demo"
TEXT_MODEL_TYPE = "kimi_k2"
ARCHITECTURE = "KimiK25DemoForConditionalGeneration"
CONFIG_MODULE = "configuration_kimi_k25_demo"
MODELING_MODULE = "modeling_kimi_k25_demo"
TOKENIZER_MODULE = "tokenization_kimi"
TOKENIZER_CLASS = "TikTokenTokenizer"

# Ids above the BPE ranks reserved for special tokens (the real tokenizer: 163584 ranks + 256 = 163840).
NUM_RESERVED_SPECIAL_TOKENS = 256

# Offsets above the last BPE rank, as in the real Kimi tokenizer (e.g. [BOS] = 163584 + 0,
# <|im_end|> = 163584 + 2, <|media_pad|> = 163584 + 21, [PAD] = 163584 + 255). Every other slot
# becomes <|reserved_token_ID|>, named by its absolute id like the real ones.
SPECIAL_TOKEN_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}

# The tokens the real tokenizer_config.json lists as additional special tokens: skipped when decoding
# with skip_special_tokens=True. <think> and </think> are not among them, so reasoning tags survive.
ADDITIONAL_SPECIAL_TOKENS = (
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
)


@dataclass(frozen=True)
class DemoSpec:
    """Every number that shapes the demo model. All of it goes into the builder's input hash."""

    seed: int = 0
    num_bpe_ranks: int = 3840  # + 256 special ids = a vocabulary of 4096
    hidden_size: int = 64
    intermediate_size: int = 128  # the dense prefix layer's MLP
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    original_max_position_embeddings: int = 4096
    rope_factor: float = 4.0
    rope_theta: float = 50000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    num_shards: int = 2
    # Pre-training on the demo corpus at build time (regen.demo.pretrain); 0 steps keeps the seeded random
    # initial weights. Sized to take well under a minute on 2 CPU cores.
    pretrain_steps: int = 150
    pretrain_batch_size: int = 16
    pretrain_seq_len: int = 128
    pretrain_learning_rate: float = 3e-3
    pretrain_threads: int = 1

    @property
    def vocab_size(self) -> int:
        return self.num_bpe_ranks + NUM_RESERVED_SPECIAL_TOKENS

    @property
    def max_position_embeddings(self) -> int:
        return int(self.original_max_position_embeddings * self.rope_factor)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        problems = []
        if self.num_bpe_ranks < 512:
            problems.append(f"num_bpe_ranks={self.num_bpe_ranks} (needs >= 512: 256 bytes plus merges)")
        if not 0 <= self.first_k_dense_replace < self.num_hidden_layers:
            problems.append("first_k_dense_replace must leave at least one MoE layer")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            problems.append("n_routed_experts must split into n_group groups of at least 2 experts")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            problems.append("num_experts_per_tok must be between 1 and n_routed_experts")
        if not 1 <= self.num_shards <= self.num_hidden_layers:
            problems.append("num_shards must be between 1 and num_hidden_layers")
        if self.seed < 0:
            problems.append(f"seed={self.seed} (must be >= 0)")
        if self.pretrain_steps < 0:
            problems.append(f"pretrain_steps={self.pretrain_steps} (must be >= 0; 0 keeps random weights)")
        if self.pretrain_batch_size < 1 or self.pretrain_seq_len < 2:
            problems.append("pretrain_batch_size must be >= 1 and pretrain_seq_len >= 2")
        if not self.pretrain_learning_rate > 0:
            problems.append(f"pretrain_learning_rate={self.pretrain_learning_rate} (must be > 0)")
        if self.pretrain_threads < 1:
            problems.append(f"pretrain_threads={self.pretrain_threads} (must be >= 1)")
        if problems:
            raise ValueError("invalid demo model spec: " + "; ".join(problems))


def special_tokens(spec: DemoSpec) -> dict[int, str]:
    """All 256 special tokens by absolute id, named ones and reserved fillers."""
    base = spec.num_bpe_ranks
    return {
        base + offset: SPECIAL_TOKEN_OFFSETS.get(offset, f"<|reserved_token_{base + offset}|>")
        for offset in range(NUM_RESERVED_SPECIAL_TOKENS)
    }


def special_token_id(spec: DemoSpec, content: str) -> int:
    for offset, name in SPECIAL_TOKEN_OFFSETS.items():
        if name == content:
            return spec.num_bpe_ranks + offset
    raise KeyError(content)


def text_config(spec: DemoSpec) -> dict[str, Any]:
    """The language model's config, nested under ``text_config`` like the real checkpoint's."""
    bos, eos, pad = (special_token_id(spec, t) for t in ("[BOS]", "[EOS]", "[PAD]"))
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": f"{CONFIG_MODULE}.KimiK2DemoTextConfig"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ep_size": 1,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.initializer_range,
        "intermediate_size": spec.intermediate_size,
        "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": TEXT_MODEL_TYPE,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": spec.n_group,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": spec.num_attention_heads,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "pad_token_id": pad,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": spec.rope_factor,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": spec.original_max_position_embeddings,
            "rope_theta": spec.rope_theta,
            "rope_type": "yarn",
            "type": "yarn",
        },
        "rope_theta": spec.rope_theta,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": spec.topk_group,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": spec.v_head_dim,
        "vocab_size": spec.vocab_size,
    }


def model_config(spec: DemoSpec) -> dict[str, Any]:
    """``config.json``: the wrapper (architecture, auto_map, token ids, vision metadata) around the text."""
    bos, eos, pad, media_pad = (
        special_token_id(spec, t) for t in ("[BOS]", "[EOS]", "[PAD]", "<|media_pad|>")
    )
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": {
            "AutoConfig": f"{CONFIG_MODULE}.KimiK25DemoConfig",
            "AutoModel": f"{MODELING_MODULE}.{ARCHITECTURE}",
            "AutoModelForCausalLM": f"{MODELING_MODULE}.{ARCHITECTURE}",
        },
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ignore_index": -100,
        "media_placeholder_token_id": media_pad,
        "model_type": MODEL_TYPE,
        "pad_token_id": pad,
        "text_config": text_config(spec),
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        # Metadata only (the demo has no vision tower): present because the real config carries one.
        "vision_config": {
            "init_pos_emb_height": 8,
            "init_pos_emb_time": 4,
            "init_pos_emb_width": 8,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mm_hidden_size": 32,
            "mm_projector_type": "patchmerger",
            "patch_size": 14,
            "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05,
            "text_hidden_size": spec.hidden_size,
            "video_attn_type": "spatial_temporal",
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 2,
        },
    }


def generation_config(spec: DemoSpec) -> dict[str, Any]:
    # A chat turn ends at <|im_end|>, so that is what generation stops on (as in the real checkpoint).
    return {
        "bos_token_id": special_token_id(spec, "[BOS]"),
        "eos_token_id": special_token_id(spec, "<|im_end|>"),
        "max_length": spec.max_position_embeddings,
        "pad_token_id": special_token_id(spec, "[PAD]"),
    }


def tokenizer_config(spec: DemoSpec) -> dict[str, Any]:
    """``tokenizer_config.json``: remote-code tokenizer (no fast class) and all 256 special tokens."""
    return {
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, content in special_tokens(spec).items()
        },
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_MODULE}.{TOKENIZER_CLASS}", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": "[PAD]",
        "tokenizer_class": TOKENIZER_CLASS,
        "unk_token": "[UNK]",
    }
