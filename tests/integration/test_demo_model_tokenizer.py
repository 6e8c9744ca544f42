"""The demo tokenizer through transformers' real loading path: remote code, tiktoken, specials, template."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from regen.demo.spec import DemoSpec, special_token_id, special_tokens

SPEC = DemoSpec()
LOAD = "import transformers; transformers.AutoTokenizer.from_pretrained({path!r}, trust_remote_code=True)"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# A finished exchange (history), then a new question answered through a tool call (the turn in progress).
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the weather tool.",
        "tool_calls": [
            {
                "type": "function",
                "id": "functions.get_weather:0",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C, sunny"},
]
HISTORY = (
    "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
    "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>4.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
)
TOOL_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C, sunny<|im_end|>"
)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    return AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)


def test_loads_as_the_remote_slow_tiktoken_tokenizer(tokenizer) -> None:
    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    assert type(tokenizer).__module__.startswith("transformers_modules.")
    assert tokenizer.is_fast is False
    assert len(tokenizer) == SPEC.vocab_size


def test_needs_trust_remote_code(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(demo_model_dir)


def test_without_tiktoken_loading_fails_with_a_clear_import_error(
    demo_model_dir: Path, python_without_tiktoken: Path
) -> None:
    # The same load works in this process (the `tokenizer` fixture); only the interpreter differs.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = LOAD.format(path=str(demo_model_dir))
    failed = subprocess.run(
        [str(python_without_tiktoken), "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert failed.returncode != 0
    last_line = failed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError") and "tiktoken" in last_line, failed.stderr[-2000:]


def test_special_tokens_sit_above_the_ranks_and_map_to_their_ids(tokenizer, demo_model_dir: Path) -> None:
    num_ranks = sum(1 for line in (demo_model_dir / "tiktoken.model").read_text().splitlines() if line)
    assert num_ranks == SPEC.num_bpe_ranks
    for token_id, content in special_tokens(SPEC).items():
        assert token_id >= num_ranks
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        special_token_id(SPEC, "[BOS]"),
        special_token_id(SPEC, "[EOS]"),
        special_token_id(SPEC, "[PAD]"),
    )
    assert max(tokenizer.encode("plain text, no specials: <|im_end", add_special_tokens=False)) < num_ranks


def test_text_round_trips(tokenizer) -> None:
    text = "Résumé: naïve café — 推测解码 🚀\n\tdef f(x):\n        return x ** 2  # 12345.678\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())


def test_skip_special_tokens_keeps_reasoning_tags(tokenizer) -> None:
    ids = tokenizer.encode("<|im_assistant|>assistant<|im_middle|><think>hm</think>ok<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant<think>hm</think>ok"


def test_chat_template_with_thinking_keeps_reasoning_only_for_the_turn_in_progress(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        HISTORY
        + "<|im_assistant|>assistant<|im_middle|><think>I need the weather tool.</think>"
        + TOOL_CALL
        + "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_chat_template_without_thinking_drops_all_reasoning(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, thinking=False
    )
    assert rendered == (
        HISTORY
        + "<|im_assistant|>assistant<|im_middle|><think></think>"
        + TOOL_CALL
        + "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    assert "Add two and two." not in rendered and "I need the weather tool." not in rendered


def test_chat_template_declares_tools_first_and_tokenizes_markers_as_single_ids(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(CONVERSATION[:2], tools=TOOLS, tokenize=False)
    head = "<|im_system|>tool_declare<|im_middle|>"
    assert rendered.startswith(head)
    declared, rest = rendered[len(head) :].split("<|im_end|>", 1)
    assert json.loads(declared) == TOOLS
    assert rest.startswith("<|im_system|>system<|im_middle|>")

    ids = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert ids[0] == special_token_id(SPEC, "<|im_system|>")  # no BOS in front
    for marker in ("<|im_user|>", "<|im_middle|>", "<|im_end|>", "<think>"):
        assert special_token_id(SPEC, marker) in ids


def test_save_pretrained_writes_a_loadable_copy(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tiktoken.model").is_file()
    for name in ("tokenization_kimi.py", "chat_template.jinja"):
        assert (tmp_path / name).is_file(), name
    copy = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    text = "Weather in Paris?<|im_end|>"
    assert copy.encode(text) == tokenizer.encode(text)
    assert copy.apply_chat_template(CONVERSATION, tokenize=False) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )
