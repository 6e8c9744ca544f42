"""The degeneration detector on real outputs quoted in public issues (tests/fixtures/quality/README.md).

Garbage from SGLang servers that were "healthy" (sgl-project/sglang 24321, 12824) and a rambling model
(ollama 8967) must be flagged with the right kind; real good answers from public docs and threads must
not be. Fluent nonsense (sglang 21132) has no degenerate shape: the detector says nothing and the probe
set catches it instead (test_quality_gate.py), which this file pins down too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.quality.detector import (
    RollingDegeneration,
    Thresholds,
    degeneration,
    longest_ngram_loop,
    strip_reasoning,
    tokens_of,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quality"
OUTPUTS = json.loads((FIXTURES / "outputs.json").read_text(encoding="utf-8"))
GARBAGE = {e["id"]: e for e in OUTPUTS["garbage"]}
GOOD = {e["id"]: e for e in OUTPUTS["good"]}


def kinds(text, **kw):
    return sorted({f.kind for f in degeneration(text, **kw)})


def test_fixtures_name_their_public_source():
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    for entry in OUTPUTS["garbage"] + OUTPUTS["good"]:
        assert entry["source"].startswith("https://"), entry["id"]
        assert entry["source"] in readme and entry["id"] in readme, entry["id"]


@pytest.mark.parametrize("case", sorted(GARBAGE), ids=sorted(GARBAGE))
def test_recorded_garbage(case):
    entry = GARBAGE[case]
    found = kinds(entry["text"])
    for kind in entry["degenerate_kinds"]:
        assert kind in found, (case, found)
    if not entry["degenerate_kinds"]:
        # Fluent-looking nonsense: nothing here can tell, the probes do.
        assert found == [], found


def test_nvfp4_plus_signs_are_one_token_repeated():
    findings = degeneration(GARBAGE["sglang-24321-nvfp4-plus"]["text"])
    assert [f.kind for f in findings] == ["one_token_repeated"]
    assert "'+' is 50 of 50" in findings[0].detail


@pytest.mark.parametrize("case", sorted(GOOD), ids=sorted(GOOD))
def test_recorded_good_outputs_are_clean(case):
    assert kinds(GOOD[case]["text"]) == []


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("", "empty"),
        ("   \n\t ", "empty"),
        ("The capital of France is Par\ufffd\ufffds.", "replacement_char"),
        ("the the the the the the the the the the", "one_token_repeated"),
        ("I think so. " * 12, "ngram_loop"),
    ],
)
def test_each_shape(text, kind):
    assert kind in kinds(text)


def test_thresholds_are_what_decides():
    text = "ok ok ok ok fine"  # 5 tokens: below word_min_words, so not judged
    assert kinds(text) == []
    assert "one_token_repeated" in kinds(text, thresholds=Thresholds(word_min_words=4))


def test_markdown_rules_and_short_repeats_are_not_loops():
    assert tokens_of("|-----|---|") == ["|", "-----", "|", "---", "|"]
    assert kinds("Yes, yes, yes! That is right.") == []


def test_longest_ngram_loop_finds_the_longest_cover():
    tokens = ["a", "b", "c", "a", "b", "c", "a", "b", "c", "x"]
    assert longest_ngram_loop(tokens, 5) == (3, 3, 0)
    assert longest_ngram_loop(["x", "y"], 5) == (0, 0, 0)


def test_think_blocks_are_not_the_answer():
    assert strip_reasoning("<think>17*23 = 17*20 + 17*3</think>391") == "391"
    assert strip_reasoning("<think>unfinished") == ""


class _ByteTokenizer:
    """A real byte-level round trip (UTF-8 bytes as ids), as a byte-level BPE has."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


class _LowercasingTokenizer(_ByteTokenizer):
    """A tokenizer that normalizes (an uncased vocabulary): the round trip does not hold."""

    def encode(self, text, add_special_tokens=False):
        return list(text.lower().encode("utf-8"))


def test_roundtrip_only_with_a_tokenizer_and_only_when_it_fails():
    text = GOOD["together-docs-capital"]["text"]
    assert kinds(text, tokenizer=_ByteTokenizer()) == []
    found = degeneration(text, tokenizer=_LowercasingTokenizer())
    assert [f.kind for f in found] == ["roundtrip"]
    assert "character 0" in found[0].detail


def test_rolling_detector_trips_on_a_degenerate_share_and_not_before():
    good = GOOD["truefoundry-1300-hermes3-capital"]["text"]
    bad = GARBAGE["sglang-24321-nvfp4-plus"]["text"]
    rolling = RollingDegeneration(window=10, threshold=0.3, min_samples=5)
    for _ in range(10):
        assert rolling.add(good) == []
    assert not rolling.tripped
    for i in range(3):
        rolling.add(bad, key=f"p{i}")
    assert rolling.share == pytest.approx(0.3)
    assert not rolling.tripped  # 3 of 10 is not *over* 30%
    rolling.add(bad, key="p3")
    assert rolling.tripped
    summary = rolling.summary()
    assert summary["degenerate_in_window"] == 4 and summary["examples"][-1]["id"] == "p3"
    assert "4 of the last 10 completions are degenerate" in rolling.message()
    assert "one_token_repeated" in rolling.message()


def test_rolling_detector_waits_for_min_samples():
    rolling = RollingDegeneration(window=100, threshold=0.1, min_samples=5)
    for _ in range(4):
        rolling.add("")
    assert rolling.share == 1.0 and not rolling.tripped
    rolling.add("")
    assert rolling.tripped


def test_rolling_detector_rejects_nonsense_settings():
    with pytest.raises(ValueError, match="threshold"):
        RollingDegeneration(threshold=0)


def test_generate_job_flags_build_the_detector():
    import argparse

    from regen.quality.detector import add_rolling_arguments, rolling_from_args

    parser = argparse.ArgumentParser()
    add_rolling_arguments(parser)
    rolling = rolling_from_args(
        parser.parse_args(["--degenerate-window", "50", "--degenerate-threshold", "0.5"])
    )
    assert (rolling.window, rolling.threshold, rolling.min_samples) == (50, 0.5, 20)
    assert rolling_from_args(parser.parse_args(["--degenerate-window", "0"])) is None
    with pytest.raises(ValueError, match="--degenerate-threshold"):
        rolling_from_args(parser.parse_args(["--degenerate-threshold", "2"]))
