"""The demo model's weights, in the real Kimi K2.5/K2.6 checkpoint layout: seeded initial draws, then a
short pre-training on the demo corpus (``regen.demo.pretrain``; ``pretrain_steps: 0`` keeps the draws).

Keys follow the real checkpoint: ``language_model.model.layers.N.self_attn.q_a_proj.weight`` (MLA),
``...mlp.{gate,up,down}_proj.weight`` in the dense prefix layers, ``...mlp.gate.weight`` +
``...mlp.gate.e_score_correction_bias`` (float32) for the router, one ``...mlp.experts.E.*`` tensor per
routed expert, ``...mlp.shared_experts.*``, and ``language_model.lm_head.weight``. Layers are spread over
the shards in order and the embeddings, final norm and head go into the last one, with a
``model.safetensors.index.json`` as in any sharded checkpoint.

Each initial tensor is drawn from its own generator, seeded from (seed, key), so the draws depend only on
the seed and the shapes, never on the order tensors are made in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from regen.demo.spec import DemoSpec

PREFIX = "language_model."


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros"
    dtype: str = "bfloat16"
    layer: int | None = None  # None: embeddings, final norm, head


def checkpoint_layout(spec: DemoSpec) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in order, with its shape and how it is initialised."""
    hidden = spec.hidden_size
    heads = spec.num_attention_heads
    qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    embed = TensorSpec(f"{PREFIX}model.embed_tokens.weight", (spec.vocab_size, hidden), "normal")
    out: list[TensorSpec] = [embed]
    for layer in range(spec.num_hidden_layers):
        p = f"{PREFIX}model.layers.{layer}."
        rows: list[tuple[str, tuple[int, ...], str, str]] = [
            ("input_layernorm.weight", (hidden,), "ones", "bfloat16"),
            ("self_attn.q_a_proj.weight", (spec.q_lora_rank, hidden), "normal", "bfloat16"),
            ("self_attn.q_a_layernorm.weight", (spec.q_lora_rank,), "ones", "bfloat16"),
            ("self_attn.q_b_proj.weight", (heads * qk_head, spec.q_lora_rank), "normal", "bfloat16"),
            (
                "self_attn.kv_a_proj_with_mqa.weight",
                (spec.kv_lora_rank + spec.qk_rope_head_dim, hidden),
                "normal",
                "bfloat16",
            ),
            ("self_attn.kv_a_layernorm.weight", (spec.kv_lora_rank,), "ones", "bfloat16"),
            (
                "self_attn.kv_b_proj.weight",
                (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
                "normal",
                "bfloat16",
            ),
            ("self_attn.o_proj.weight", (hidden, heads * spec.v_head_dim), "normal", "bfloat16"),
            ("post_attention_layernorm.weight", (hidden,), "ones", "bfloat16"),
        ]
        if layer < spec.first_k_dense_replace:
            dense = spec.intermediate_size
            rows += [
                ("mlp.gate_proj.weight", (dense, hidden), "normal", "bfloat16"),
                ("mlp.up_proj.weight", (dense, hidden), "normal", "bfloat16"),
                ("mlp.down_proj.weight", (hidden, dense), "normal", "bfloat16"),
            ]
        else:
            expert = spec.moe_intermediate_size
            shared = expert * spec.n_shared_experts
            # The router's correction bias is float32 in the real checkpoint too.
            rows += [
                ("mlp.gate.weight", (spec.n_routed_experts, hidden), "normal", "bfloat16"),
                ("mlp.gate.e_score_correction_bias", (spec.n_routed_experts,), "zeros", "float32"),
            ]
            for index in range(spec.n_routed_experts):
                rows += [
                    (f"mlp.experts.{index}.gate_proj.weight", (expert, hidden), "normal", "bfloat16"),
                    (f"mlp.experts.{index}.up_proj.weight", (expert, hidden), "normal", "bfloat16"),
                    (f"mlp.experts.{index}.down_proj.weight", (hidden, expert), "normal", "bfloat16"),
                ]
            rows += [
                ("mlp.shared_experts.gate_proj.weight", (shared, hidden), "normal", "bfloat16"),
                ("mlp.shared_experts.up_proj.weight", (shared, hidden), "normal", "bfloat16"),
                ("mlp.shared_experts.down_proj.weight", (hidden, shared), "normal", "bfloat16"),
            ]
        out += [TensorSpec(p + name, shape, init, dtype, layer) for name, shape, init, dtype in rows]
    out.append(TensorSpec(f"{PREFIX}model.norm.weight", (hidden,), "ones"))
    out.append(TensorSpec(f"{PREFIX}lm_head.weight", (spec.vocab_size, hidden), "normal"))
    return out


def _tensor_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_tensor(spec: DemoSpec, tensor: TensorSpec):
    import torch

    dtype = getattr(torch, tensor.dtype)
    if tensor.init == "ones":
        return torch.ones(tensor.shape, dtype=dtype)
    if tensor.init == "zeros":
        return torch.zeros(tensor.shape, dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(spec.seed, tensor.key))
    values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * spec.initializer_range
    return values.to(dtype)


def shard_names(num_shards: int) -> list[str]:
    return [f"model-{index:05d}-of-{num_shards:05d}.safetensors" for index in range(1, num_shards + 1)]


def assign_shards(spec: DemoSpec, layout: list[TensorSpec]) -> dict[str, str]:
    """Key -> shard file: layers in order across the shards, non-layer tensors in the last one."""
    names = shard_names(spec.num_shards)
    per_shard = -(-spec.num_hidden_layers // spec.num_shards)
    return {
        t.key: names[-1] if t.layer is None else names[min(t.layer // per_shard, spec.num_shards - 1)]
        for t in layout
    }


def model_tensors(spec: DemoSpec, directory: Path) -> dict:
    """Every tensor of the checkpoint: the seeded draws, pre-trained when the spec asks for steps.

    ``directory`` must already hold the tokenizer and chat template (the pre-training text goes through
    them, exactly as every later stage tokenizes).
    """
    tensors = {t.key: make_tensor(spec, t) for t in checkpoint_layout(spec)}
    if spec.pretrain_steps:
        from regen.demo import pretrain

        tensors = pretrain.pretrain(spec, tensors, directory)
    return tensors


def write_checkpoint(spec: DemoSpec, directory: Path) -> list[str]:
    """Write the shards and the index into ``directory``; return the file names written."""
    from safetensors.torch import save_file

    layout = checkpoint_layout(spec)
    placement = assign_shards(spec, layout)
    weights = model_tensors(spec, directory)
    total_size = 0
    written = []
    for shard in shard_names(spec.num_shards):
        tensors = {t.key: weights[t.key] for t in layout if placement[t.key] == shard}
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        written.append(shard)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(placement.items()))}
    index_text = json.dumps(index, indent=2) + "\n"
    (directory / "model.safetensors.index.json").write_text(index_text, encoding="utf-8")
    written.append("model.safetensors.index.json")
    return written
