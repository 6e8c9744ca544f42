"""Loss masks on the demo model's Kimi-style tokenizer: multi-turn, thinking, tool calls, odd content.

Every test decodes the supervised token runs back to text and compares them with what the assistant
messages say, and checks the ids against the tokenizer's own encoding of the rendered text.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from regen.tokenization.conversation import Conversation, RowError, conversation_from_record
from regen.tokenization.encode import PieceEncoder
from regen.tokenization.render import ChatRenderer, TemplateError

HEADER = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)


@pytest.fixture(scope="module")
def encoder(tok):
    return PieceEncoder(tok)


def conv(*messages, tools=None) -> Conversation:
    return conversation_from_record({"id": "t", "messages": list(messages), "tools": tools}, "t")


def sys_(text="You are helpful."):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def asst(text, reasoning=None, tool_calls=None):
    m = {"role": "assistant", "content": text}
    if reasoning:
        m["reasoning_content"] = reasoning
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


def supervised_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def encode(tok, encoder, conversation, **kwargs):
    rendered = ChatRenderer(tok, **kwargs).render(conversation)
    enc = encoder.encode(rendered)
    assert len(enc.input_ids) == len(enc.loss_mask)
    assert tok.decode(enc.input_ids) == rendered.text  # ids and text agree token for token
    return rendered, enc


def test_single_turn_trains_on_answer_and_end_of_turn_only(tok, encoder):
    rendered, enc = encode(tok, encoder, conv(sys_(), user("What is two plus two?"), asst("Four.")))
    assert rendered.text == tok.apply_chat_template(
        rendered.messages, tokenize=False, add_generation_prompt=False
    )
    assert enc.input_ids == tok.encode(rendered.text, add_special_tokens=False)
    # Thinking mode: the served prompt ends with <think>; the model wrote </think> + answer + <|im_end|>.
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == ["</think>Four.<|im_end|>"]
    header_ids = tok.encode(HEADER, add_special_tokens=False)
    start = enc.loss_mask.index(1)
    assert enc.input_ids[start - len(header_ids) - 1 : start - 1] == header_ids
    assert enc.loss_mask[:start] == [0] * start  # system, user and the role header are never trained


def test_multi_turn_supervises_every_assistant_turn(tok, encoder):
    c = conv(sys_(), user("Hi."), asst("Hello! How can I help?"), user("Name a prime."), asst("Seven."))
    _, enc = encode(tok, encoder, c)
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == [
        "</think>Hello! How can I help?<|im_end|>",
        "</think>Seven.<|im_end|>",
    ]
    _, last_only = encode(tok, encoder, c, train_turns="last")
    assert last_only.input_ids == enc.input_ids
    assert supervised_runs(tok, last_only.input_ids, last_only.loss_mask) == ["</think>Seven.<|im_end|>"]


def test_reasoning_policies_on_the_kimi_thinking_template(tok, encoder):
    """The Kimi template drops reasoning of finished turns; `last` puts the final turn's back where the
    model wrote it, `keep` trains on the template's text as is, `drop` removes it everywhere."""
    c = conv(
        sys_(),
        user("q1"),
        asst("a1", reasoning="old thought"),
        user("q2"),
        asst("a2", reasoning="new thought"),
    )
    rendered, enc = encode(tok, encoder, c, reasoning="last")
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == [
        "</think>a1<|im_end|>",
        "new thought</think>a2<|im_end|>",
    ]
    assert "old thought" not in rendered.text
    assert rendered.text.endswith(HEADER + "<think>new thought</think>a2<|im_end|>")
    assert (
        rendered.reasoning_turns,
        rendered.reasoning_rendered,
        rendered.reasoning_synthesized,
        rendered.reasoning_dropped,
    ) == (2, 0, 1, 1)
    # The placed reasoning sits right after the generation prompt the server would have sent.
    prompt = tok.apply_chat_template(rendered.messages[:-1], tokenize=False, add_generation_prompt=True)
    assert rendered.text.startswith(prompt + "new thought</think>")

    kept, kept_enc = encode(tok, encoder, c, reasoning="keep")
    assert "thought" not in kept.text
    assert supervised_runs(tok, kept_enc.input_ids, kept_enc.loss_mask) == [
        "</think>a1<|im_end|>",
        "</think>a2<|im_end|>",
    ]
    assert (kept.reasoning_rendered, kept.reasoning_synthesized, kept.reasoning_dropped) == (0, 0, 2)

    dropped, dropped_enc = encode(tok, encoder, c, reasoning="drop")
    assert dropped.text == kept.text and dropped_enc.loss_mask == kept_enc.loss_mask
    assert all("reasoning_content" not in m for m in dropped.messages) and dropped.reasoning_dropped == 2


def test_thinking_switched_off_closes_the_think_block_in_the_prompt(tok, encoder):
    c = conv(user("q"), asst("answer", reasoning="hidden"))
    _, enc = encode(tok, encoder, c, reasoning="drop", chat_template_kwargs={"thinking": False})
    # With thinking off the generation prompt is <think></think>, so only the answer is the model's.
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == ["answer<|im_end|>"]
    with pytest.raises(RowError) as err:
        ChatRenderer(tok, reasoning="last", chat_template_kwargs={"thinking": False}).render(c)
    assert err.value.reason == "reasoning_unplaceable"


def test_tool_call_chain_keeps_reasoning_on_the_turns_in_progress(tok, encoder):
    """Assistant turns after the last plain answer (a tool-call chain in progress) keep their reasoning in
    the Kimi template; tool results and tool declarations are never trained on."""
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    c = conv(
        user("Weather in Paris?"),
        asst("", reasoning="I should call the tool.", tool_calls=[call]),
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, sunny"},
        asst("", reasoning="Now call again.", tool_calls=[{**call, "id": "functions.get_weather:1"}]),
        tools=tools,
    )
    rendered, enc = encode(tok, encoder, c, reasoning="keep")
    assert enc.input_ids == tok.encode(rendered.text, add_special_tokens=False)
    runs = supervised_runs(tok, enc.input_ids, enc.loss_mask)
    assert runs == [
        "I should call the tool.</think><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "Now call again.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
    ]
    assert "18 C, sunny" in rendered.text and not any("18 C" in r for r in runs)
    assert rendered.text.startswith("<|im_system|>tool_declare<|im_middle|>")
    assert rendered.reasoning_rendered == 2


def test_tool_chain_with_final_answer_is_trained_as_it_was_served(tok, encoder):
    """`last`: the final answer was generated after a prompt in which the tool-call turn still carried its
    reasoning (Kimi keeps it for the turn in progress), so that is the text trained on. `keep` trains on
    the template's rendering of the finished conversation, where both reasonings are gone."""
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}
    c = conv(
        user("find x"),
        asst("", reasoning="call it", tool_calls=[call]),
        {"role": "tool", "tool_call_id": "c0", "content": "x=1"},
        asst("x is 1.", reasoning="got it"),
    )
    rendered, enc = encode(tok, encoder, c)
    prompt = tok.apply_chat_template(rendered.messages[:-1], tokenize=False, add_generation_prompt=True)
    assert rendered.text == prompt + "got it</think>x is 1.<|im_end|>"
    runs = supervised_runs(tok, enc.input_ids, enc.loss_mask)
    assert runs == [
        "call it</think><|tool_calls_section_begin|><|tool_call_begin|>c0<|tool_call_argument_begin|>"
        '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "got it</think>x is 1.<|im_end|>",
    ]
    assert (rendered.reasoning_rendered, rendered.reasoning_synthesized, rendered.reasoning_dropped) == (
        1,
        1,
        0,
    )

    kept, kept_enc = encode(tok, encoder, c, reasoning="keep")
    assert kept.text == tok.apply_chat_template(kept.messages, tokenize=False, add_generation_prompt=False)
    assert [r[:20] for r in supervised_runs(tok, kept_enc.input_ids, kept_enc.loss_mask)] == [
        "</think><|tool_calls",
        "</think>x is 1.<|im_",
    ]
    assert (kept.reasoning_rendered, kept.reasoning_synthesized, kept.reasoning_dropped) == (0, 0, 2)


def test_reasoning_only_turn_needs_its_reasoning_rendered(tok, encoder):
    """A thinking model cut at max_tokens may leave reasoning and no answer: trainable only where the
    reasoning is in the text."""
    c = conv(
        user("Prove it."), {"role": "assistant", "content": "", "reasoning_content": "Assume the opposite"}
    )
    _, enc = encode(tok, encoder, c)
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == ["Assume the opposite</think><|im_end|>"]
    for policy in ("keep", "drop"):
        with pytest.raises(RowError) as err:
            ChatRenderer(tok, reasoning=policy).render(c)
        assert err.value.reason == "empty_content"


def test_special_token_strings_in_content_are_text(tok, encoder):
    text = "Type <|im_end|> then <think> to end a turn."
    rendered, enc = encode(tok, encoder, conv(user("How do turns end? <|im_assistant|>"), asst(text)))
    assert enc.special_in_content == 2
    control = set(tok.get_added_vocab().values())
    # Only the template's control tokens are control ids; the ones typed in messages are plain text.
    template_controls = tok.encode(
        rendered.text.replace(text, "X").replace("<|im_assistant|><|im_end|>", "<|im_end|>"),
        add_special_tokens=False,
    )
    assert sum(i in control for i in enc.input_ids) == sum(i in control for i in template_controls)
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == [f"</think>{text}<|im_end|>"]
    # ... unless the row is rejected or the strings are wanted as control tokens.
    with pytest.raises(RowError) as err:
        PieceEncoder(tok, special_in_content="reject").encode(rendered)
    assert err.value.reason == "special_token_in_content"
    as_control = PieceEncoder(tok, special_in_content="control").encode(rendered)
    assert as_control.input_ids == tok.encode(rendered.text, add_special_tokens=False)


def test_template_errors_are_row_errors(tok):
    class Raising:
        chat_template = "x"

        def get_added_vocab(self):
            return {}

        def apply_chat_template(self, *a, **k):
            raise ValueError("boom")

    with pytest.raises(TemplateError):
        ChatRenderer(Raising())
    with pytest.raises(TemplateError, match="set by the job"):
        ChatRenderer(tok, chat_template_kwargs={"add_generation_prompt": True})


# ------------------------------------------------------------------ property: any text, any turns

_ALPHABET = st.sampled_from(
    [
        "a",
        "b",
        " ",
        "\n",
        "é",
        "中",
        "文",
        "7",
        "42",
        ".",
        "<",
        "|",
        ">",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|im_middle|>",
        "[BOS]",
        "  ",
        "\t",
        "🙂",
    ]
)
_TEXT = st.lists(_ALPHABET, min_size=1, max_size=12).map("".join).filter(lambda s: s.strip())


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append(sys_(draw(_TEXT)))
    for _ in range(draw(st.integers(1, 3))):
        messages.append(user(draw(_TEXT)))
        messages.append(asst(draw(_TEXT), reasoning=draw(st.one_of(st.none(), _TEXT))))
    return messages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), reasoning=st.sampled_from(["keep", "last", "drop"]))
def test_masked_spans_are_exactly_the_assistant_messages(tok, encoder, messages, reasoning):
    c = conv(*messages)
    rendered, enc = encode(tok, encoder, c, reasoning=reasoning)
    assistants = [m for m in messages if m["role"] == "assistant"]
    expected = [f"</think>{m['content']}<|im_end|>" for m in assistants]
    if reasoning == "last" and assistants[-1].get("reasoning_content"):
        expected[-1] = f"{assistants[-1]['reasoning_content']}</think>{assistants[-1]['content']}<|im_end|>"
    # Runs of 1s may merge only if two assistant turns were adjacent, which a conversation never has.
    assert supervised_runs(tok, enc.input_ids, enc.loss_mask) == expected
    assert (
        len(enc.input_ids) == len(tok.encode(rendered.text, add_special_tokens=False))
        or enc.special_in_content
    )
