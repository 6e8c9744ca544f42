"""Pure parts of the tokenize stage: reading records, length/supervision policy, stats and the picture."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from regen.tokenization.conversation import RowError, conversation_from_record
from regen.tokenization.policy import (
    apply_length_policy,
    check_mask_token,
    check_supervision,
    has_consecutive_supervised_tokens,
)
from regen.tokenization.stats import BAR_COLOR, Stats, histogram, histogram_png, report


def reason(record) -> str:
    with pytest.raises(RowError) as err:
        conversation_from_record(record, "f:1")
    return err.value.reason


def test_generation_records_and_specforge_rows_are_read_alike():
    generated = {
        "id": "p1",
        "conversations": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
        ],
        "finish_reason": "stop",
    }
    c = conversation_from_record(generated, "f:1")
    assert c.id == "p1" and c.messages[1] == {
        "role": "assistant",
        "content": "hello",
        "reasoning_content": "greet",
    }
    assert c.extra == {"finish_reason": "stop"}
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    s = conversation_from_record(sharegpt, "f:2")
    assert s.id == "f:2" and [m["role"] for m in s.messages] == ["user", "assistant"]
    # SpecForge stores list fields as JSON strings for Arrow; they are read back.
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    row = {
        "id": 7,
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": json.dumps(calls)},
        ],
    }
    r = conversation_from_record(row, "f:3")
    assert r.id == "7" and r.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c", "reasoning": "vllm-style"},
        ]
    }
    p = conversation_from_record(parts, "f:4")
    assert p.messages[0]["content"] == "ab" and p.messages[1]["reasoning_content"] == "vllm-style"


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ([1, 2], "not_an_object"),
        ({"id": "x"}, "no_messages"),
        ({"messages": []}, "no_messages"),
        ({"messages": ["hi"]}, "bad_message"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "unknown_role",
        ),
        (
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
            "empty_content",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            "empty_content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "non_text_content",
        ),
        (
            {"messages": [{"role": "user", "content": "q\ud800"}, {"role": "assistant", "content": "x"}]},
            "invalid_utf8",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": "not json"},
                ]
            },
            "bad_tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
                ]
            },
            "bad_tool_calls",
        ),
    ],
)
def test_bad_rows_are_named(record, expected):
    assert reason(record) == expected


def test_length_policy_and_supervision_rule():
    ids, mask = list(range(10)), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert apply_length_policy(ids, mask, 20, "drop") == (ids, mask, False)
    assert apply_length_policy(ids, mask, 5, "truncate") == (ids[:5], mask[:5], True)
    assert apply_length_policy(ids, mask, None, "truncate") == (ids, mask, False)
    with pytest.raises(RowError, match="too_long"):
        apply_length_policy(ids, mask, 5, "drop")
    assert has_consecutive_supervised_tokens([0, 1, 1])
    assert not has_consecutive_supervised_tokens([1, 0, 1, 0, 1])
    assert not has_consecutive_supervised_tokens([])
    with pytest.raises(RowError) as err:
        check_supervision([1, 0, 1])
    assert err.value.reason == "insufficient_supervision" and "2 supervised" in err.value.detail


def test_mask_token_must_exist(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)
    reserved = len(tok) - 200
    assert check_mask_token(tok, reserved) == f"<|reserved_token_{reserved}|>"
    for bad in (len(tok), -1):
        with pytest.raises(ValueError, match="outside"):
            check_mask_token(tok, bad)


def test_stats_merge_report_and_histogram():
    a = Stats(input_rows=3, samples=2, tokens=30, supervised_tokens=12, lengths=[10, 20])
    a.rejected["invalid_json"] += 1
    b = Stats.from_json(
        json.loads(
            json.dumps(
                Stats(
                    input_rows=2, samples=1, tokens=40, supervised_tokens=8, truncated=1, lengths=[40]
                ).to_json()
            )
        )
    )
    b.rejected["too_long"] += 1
    a.add(b)
    doc = report(a, config={"max_length": 40, "reasoning": "last"}, mask_token=None)
    assert (doc["samples"], doc["tokens"], doc["truncated"]) == (3, 70, 1)
    assert doc["supervised_fraction"] == pytest.approx(20 / 70, abs=1e-6)
    assert doc["dropped"] == {"too_long": 1} and doc["rejected"] == {"invalid_json": 1}
    assert doc["length"] == {"min": 10, "max": 40, "mean": 23.33, "p50": 20, "p90": 40, "p99": 40}
    assert sum(doc["histogram"]["counts"]) == 3
    h = histogram([0, 5, 9, 10], max_length=None, bins=2)
    assert h == {"bin_edges": [0, 5, 10], "counts": [1, 3]}


def test_the_histogram_is_drawn_by_matplotlib_and_stable():
    from matplotlib import colors, image

    stats = Stats()
    stats.samples, stats.tokens, stats.supervised_tokens = 3, 70, 20
    stats.lengths = [10, 20, 40]
    doc = report(stats, config={"max_length": 40, "reasoning": "last"}, mask_token=None)
    png = histogram_png(doc)
    pixels = image.imread(io.BytesIO(png), format="png")
    # 8 x 4.5 inches at 100 dpi, cropped to the drawing (bbox_inches="tight": the margin left depends on the
    # fonts' metrics, so a few pixels either way)
    height, width = pixels.shape[:2]
    assert 420 <= height <= 470 and 760 <= width <= 820, pixels.shape
    bar = np.array(colors.to_rgb(BAR_COLOR))
    assert (np.abs(pixels[..., :3] - bar).max(axis=-1) < 0.02).sum() > 1000, "the bars are drawn"
    assert histogram_png(doc) == png, "the same report gives the same bytes (a re-run changes nothing)"
    stats.lengths = [10, 10, 40]
    assert histogram_png(report(stats, config={"max_length": 40}, mask_token=None)) != png
