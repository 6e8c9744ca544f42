"""The pre-trained demo target has structure a drafter can learn, and its greedy outputs are not the
degenerate loops that would make drafting trivially easy.

Loaded the way every stage loads it (transformers, trust_remote_code), the built model must predict its own
training text far better than the same network at its random initial weights, and its greedy answers to the
demo prompts (the pipeline's generation settings: chat template, greedy, a few dozen tokens) must mostly
pass the quality detector the generate stage uses, differ from prompt to prompt and end their turn.
What they say is not checked: a tiny model pre-trained on 12 KB cannot answer questions (see
docs/evaluation.md).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from regen.demo import pretrain, weights
from regen.demo.spec import DemoSpec
from regen.quality.detector import degeneration

PROMPTS = 16
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def loaded(demo_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, trust_remote_code=True, dtype=torch.float32)
    return model.eval(), tokenizer


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_the_model_learned_its_corpus(loaded, demo_model_dir: Path) -> None:
    model, _ = loaded
    spec = DemoSpec()
    ids = torch.tensor(pretrain.token_stream(spec, demo_model_dir)[:1024]).unsqueeze(0)
    untrained = pretrain.build_module(spec)
    initial = {t.key: weights.make_tensor(spec, t).float() for t in weights.checkpoint_layout(spec)}
    untrained.load_state_dict(pretrain.to_module_state(initial, spec.n_routed_experts))
    random_loss, trained_loss = _loss(untrained, ids), _loss(model, ids)
    # Random weights sit at about ln(vocabulary) = 8.3 nats per token.
    assert random_loss > 8.0 and trained_loss < random_loss / 3, (random_loss, trained_loss)


def _first_turn(conversation: list[dict]) -> list[dict]:
    turns = []
    for turn in conversation:
        if turn["role"] in ("system", "user"):
            turns.append(turn)
        if turn["role"] == "user":
            return turns
    return turns


def test_greedy_answers_are_varied_mostly_clean_and_end_their_turn(loaded) -> None:
    model, tokenizer = loaded
    text = resources.files("regen.data").joinpath("demo_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines()][:PROMPTS]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers, flagged, ended = [], [], 0
    for index, row in enumerate(rows):
        thinking = index % 2 == 1  # both kinds of turn the template renders
        inputs = tokenizer.apply_chat_template(
            _first_turn(row["conversations"]),
            add_generation_prompt=True,
            thinking=thinking,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=end)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        ended += end in new
        answer = tokenizer.decode([t for t in new if t != end])
        answers.append(answer)
        assert "<|reserved_token_" not in answer, answer  # random weights emit special-id salad
        findings = degeneration(answer.replace("</think>", " "))
        if findings:
            flagged.append((row["id"], answer, [str(f) for f in findings]))
    assert len(flagged) <= PROMPTS // 4, flagged
    assert len(set(answers)) >= PROMPTS * 3 // 4, answers
    assert ended >= PROMPTS // 2, answers
