"""The demo model's pre-training, piece by piece: the training text made from the corpus, the mapping between
the checkpoint's per-expert keys and transformers' stacked experts, the schedule, and a few real steps.

The whole default pre-training (and what the model then writes) is checked on the built model in
tests/integration/test_demo_model_quality.py.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from regen.demo import bpe, build, pretrain, weights
from regen.demo.spec import DemoSpec

TEMPLATE = (Path(pretrain.__file__).parent / "model_files" / "chat_template.jinja").read_text()


def test_the_corpus_becomes_paragraphs_and_dialogues() -> None:
    paragraphs = pretrain.corpus_paragraphs(bpe.corpus_text())
    assert paragraphs and not any(p.lstrip().startswith("#") for p in paragraphs)
    pairs = dict(pretrain.dialogues(paragraphs))
    # The corpus's own dialogues, English and Chinese, become (user turn, answer) pairs...
    assert "Can you explain what a hash function does?" in pairs
    assert pairs["什么是混合专家模型\uff1f"].startswith("混合专家模型")
    # ...prose is split after its first sentence, and code stays plain text only.
    assert any(a.startswith("Nobody had ground grain there") for a in pairs.values())
    assert not any("def fibonacci" in q or "SELECT" in q for q in pairs)


def test_chat_turns_follow_the_template_in_both_modes() -> None:
    render = pretrain.chat_renderer(TEMPLATE)
    answer = "A hash maps data to a fixed size. The same input gives the same output."
    thinking = pretrain.chat_turn(render, "What is a hash?", answer, thinking=True)
    plain = pretrain.chat_turn(render, "What is a hash?", answer, thinking=False)
    prompt = "<|im_user|>user<|im_middle|>What is a hash?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    reasoning = "<think>A hash maps data to a fixed size.</think>"
    assert thinking == prompt + reasoning + "The same input gives the same output.<|im_end|>"
    assert plain == prompt + "<think></think>" + answer + "<|im_end|>"


def test_training_documents_favour_reasoning_after_an_open_think() -> None:
    documents = pretrain.training_documents(bpe.corpus_text(), TEMPLATE)
    opened = sum("<|im_middle|><think>" in d and "<think></think>" not in d for d in documents)
    closed = sum("<think></think>" in d for d in documents)
    # Otherwise `</think>` would be the likeliest token after an open <think>: no reasoning at all.
    assert opened > closed > 0
    assert all(d.endswith(("[EOS]", "<|im_end|>")) for d in documents)


def test_checkpoint_keys_and_stacked_experts_convert_both_ways() -> None:
    spec = DemoSpec()
    tensors = {t.key: weights.make_tensor(spec, t).float() for t in weights.checkpoint_layout(spec)}
    state = pretrain.to_module_state(tensors, spec.n_routed_experts)
    module_keys = set(pretrain.build_module(spec).state_dict())
    assert set(state) == module_keys
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (spec.n_routed_experts, 2 * spec.moe_intermediate_size, spec.hidden_size)
    assert torch.equal(gate_up[3, : spec.moe_intermediate_size],
                       tensors["language_model.model.layers.1.mlp.experts.3.gate_proj.weight"])  # fmt: skip
    back = pretrain.to_checkpoint_tensors(state, spec.moe_intermediate_size)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_missing_expert_is_named() -> None:
    spec = DemoSpec()
    tensors = {t.key: weights.make_tensor(spec, t) for t in weights.checkpoint_layout(spec)}
    del tensors["language_model.model.layers.2.mlp.experts.5.up_proj.weight"]
    tensors.pop("language_model.model.layers.2.mlp.experts.5.gate_proj.weight")
    tensors.pop("language_model.model.layers.2.mlp.experts.5.down_proj.weight")
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts: expected experts 0\.\.7"):
        pretrain.to_module_state(tensors, spec.n_routed_experts)


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    spec = replace(DemoSpec(), pretrain_steps=100, pretrain_learning_rate=1.0)
    rates = [pretrain.learning_rate(spec, step) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))
    assert rates[-1] == pytest.approx(0.1, abs=0.01)


def test_a_few_steps_lower_the_loss_keep_dtypes_and_leave_torch_settings_alone(tmp_path: Path) -> None:
    spec = replace(DemoSpec(), pretrain_steps=24, pretrain_batch_size=4, pretrain_seq_len=32)
    files = build.render_files(spec)
    for name in ("tiktoken.model", "chat_template.jinja"):
        (tmp_path / name).write_bytes(files[name])
    initial = {t.key: weights.make_tensor(spec, t) for t in weights.checkpoint_layout(spec)}
    threads = torch.get_num_threads()

    trained = pretrain.pretrain(spec, initial, tmp_path)

    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    assert {k: v.dtype for k, v in trained.items()} == {k: v.dtype for k, v in initial.items()}
    assert not torch.equal(trained["language_model.lm_head.weight"], initial["language_model.lm_head.weight"])
    ids = torch.tensor(pretrain.token_stream(spec, tmp_path)[:257]).unsqueeze(0)

    def loss(tensors: dict) -> float:
        model = pretrain.build_module(spec)
        model.load_state_dict(pretrain.to_module_state({k: v.float() for k, v in tensors.items()}, 8))
        with torch.no_grad():
            return float(model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)

    assert loss(trained) < loss(initial) - 0.5
