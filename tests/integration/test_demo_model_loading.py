"""The demo model through transformers' real loading path (remote code, sharded safetensors) on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from regen.demo.spec import DemoSpec

SPEC = DemoSpec()


@pytest.fixture(scope="module")
def loaded(demo_model_dir: Path):
    model, info = AutoModelForCausalLM.from_pretrained(
        demo_model_dir, trust_remote_code=True, output_loading_info=True
    )
    return model.eval(), info


def test_config_loads_with_the_text_model_nested(demo_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(demo_model_dir, trust_remote_code=True)
    text = config.get_text_config()

    assert config.model_type == "kimi_k25_demo" and text.model_type == "kimi_k2"
    assert text is config.text_config
    assert (text.kv_lora_rank, text.q_lora_rank, text.qk_rope_head_dim) == (
        SPEC.kv_lora_rank,
        SPEC.q_lora_rank,
        SPEC.qk_rope_head_dim,
    )
    assert (text.n_routed_experts, text.num_experts_per_tok, text.first_k_dense_replace) == (8, 2, 1)
    assert text.vocab_size == SPEC.vocab_size
    assert config.dtype == torch.bfloat16


def test_every_checkpoint_tensor_lands_in_the_model(loaded) -> None:
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == "KimiK25DemoForConditionalGeneration"
    assert type(model.language_model).__name__ == "DeepseekV3ForCausalLM"
    layers = model.language_model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert type(layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert model.dtype == torch.bfloat16


def test_per_expert_checkpoint_tensors_are_stacked_in_order(loaded, demo_model_dir: Path) -> None:
    model, _ = loaded
    experts = model.language_model.model.layers[2].mlp.experts
    prefix = "language_model.model.layers.2.mlp.experts"
    weight_map = json.loads((demo_model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = demo_model_dir / weight_map[f"{prefix}.0.gate_proj.weight"]
    with safe_open(str(shard), framework="pt") as handle:
        for index in (0, SPEC.n_routed_experts - 1):
            gate = handle.get_tensor(f"{prefix}.{index}.gate_proj.weight")
            up = handle.get_tensor(f"{prefix}.{index}.up_proj.weight")
            down = handle.get_tensor(f"{prefix}.{index}.down_proj.weight")
            assert torch.equal(experts.gate_up_proj[index], torch.cat([gate, up]))
            assert torch.equal(experts.down_proj[index], down)


def test_generates_on_the_cpu_deterministically(loaded, demo_model_dir: Path) -> None:
    model, _ = loaded
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt_length = inputs["input_ids"].shape[1]

    first = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    second = model.generate(**inputs, max_new_tokens=6, do_sample=False)

    assert first.device.type == "cpu"
    assert first.shape == (1, prompt_length + 6)
    assert torch.equal(first, second)
    assert int(first.max()) < SPEC.vocab_size
    assert isinstance(tokenizer.decode(first[0, prompt_length:]), str)


def test_hidden_states_of_every_layer_are_exposed(loaded) -> None:
    model, _ = loaded
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert len(out.hidden_states) == SPEC.num_hidden_layers + 1
    assert out.hidden_states[-1].shape == (1, 3, SPEC.hidden_size)
    assert out.logits.shape == (1, 3, SPEC.vocab_size)
