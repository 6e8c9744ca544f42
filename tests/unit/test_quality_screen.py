"""The vectorized screen (regen.quality.screen) never changes what the degeneration detector finds.

The screen only decides which checks run; a check it skips must be one that could not have found
anything. Compared here against the detector with every check run (`_screen` off), on the recorded
outputs and on random texts built to sit near each threshold: loops of every n, one repeated character
or word, whitespace runs, non-ASCII words and punctuation, lone surrogates, markdown rules.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from regen.quality import detector
from regen.quality.detector import Thresholds, degeneration
from regen.quality.screen import suspects, suspects_many

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quality"
OUTPUTS = json.loads((FIXTURES / "outputs.json").read_text(encoding="utf-8"))


def exhaustive(text, thresholds=detector.DEFAULT_THRESHOLDS):
    screen, detector._screen = detector._screen, None
    try:
        return degeneration(text, thresholds=thresholds)
    finally:
        detector._screen = screen


def test_the_screen_is_in_use():
    assert detector._screen is suspects_many


@pytest.mark.parametrize("entry", OUTPUTS["garbage"] + OUTPUTS["good"], ids=lambda e: e["id"])
def test_recorded_outputs_same_findings(entry):
    assert degeneration(entry["text"]) == exhaustive(entry["text"])


# pieces random texts are made of: words (ASCII and not), punctuation runs, whitespace
_WORDS = ["the", "a", "loop", "I", "think", "so", "été", "Привет", "数据", "x_1", "42", "naïve"]
_PUNCT = [".", ",", "-----", "|", "!", "…", "—", "+", "++", "\ud800", "“", "”", "(", ")"]
_SPACE = [" ", " ", " ", "\n", "\t", "\u00a0", "\u3000", "\n\n"]
_LONG_SPACE = [" " * 40, "\n" * 10 + " " * 30, "\n" * 7 + " " * 30]


def _random_text(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(0, 120)):
        shape = rng.random()
        if shape < 0.006:
            parts.append(rng.choice(_LONG_SPACE))
        elif shape < 0.02:  # a loop: an n-gram repeated back to back
            gram = [rng.choice(_WORDS + _PUNCT) for _ in range(rng.randint(1, 18))]
            sep = rng.choice([" ", "", "\n"])
            parts.append(sep.join(gram * rng.randint(2, 8)))
        elif shape < 0.03:  # one character many times
            parts.append(rng.choice("+aé=\ufffd") * rng.randint(1, 80))
        else:
            parts.append(rng.choice(_WORDS + _PUNCT))
        parts.append(rng.choice(_SPACE) if rng.random() < 0.8 else "")
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_texts_same_findings(seed):
    text = _random_text(random.Random(seed))
    assert degeneration(text) == exhaustive(text)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from([*"ab .-\n", "é", "—", "\u3000"]), max_size=400))
def test_small_alphabet_texts_same_findings(text):
    # few distinct tokens: loops, repeated words and characters are everywhere
    tight = Thresholds(min_loop_tokens=6, min_repeats=3, loop_tail_tokens=40, whitespace_chars=4)
    assert degeneration(text) == exhaustive(text)
    assert degeneration(text, thresholds=tight) == exhaustive(text, tight)


def test_screen_rules_out_a_long_normal_answer_and_keeps_a_loop():
    prose = " ".join(e["text"] for e in OUTPUTS["good"])
    long_answer = (prose + "\n\n") * 30  # 25 KB; repeats only at a period far beyond max_n tokens
    assert suspects(long_answer, detector.DEFAULT_THRESHOLDS) == frozenset()
    looped = long_answer + " I think so." * 12
    assert "ngram_loop" in suspects(looped, detector.DEFAULT_THRESHOLDS)
    assert [f.kind for f in degeneration(looped)] == ["ngram_loop"]


def test_ascii_fast_path_reads_the_same_arrays():
    # an ASCII text is read through bytes.translate; it must give the code-point path's classes and
    # characters, for every ASCII character (the control characters str.isspace() counts included)
    from regen.quality import screen

    rng = random.Random(7)
    texts = ["".join(chr(i) for i in range(128))] + [
        "".join(chr(rng.randrange(128)) for _ in range(rng.randint(1, 200))) for _ in range(50)
    ]
    for text in texts:
        ascii_path, ref = screen._ascii_batch([text]), screen._code_point_batch([text])
        cp, cls, chars = ascii_path.cp, ascii_path.cls, ascii_path.chars
        ref_cp, ref_cls = ref.cp, ref.cls
        assert cp.tolist() == ref_cp.tolist()
        assert cls.tolist() == ref_cls.tolist()
        assert chars.tolist() == ref_cp[ref_cls != screen._SPACE].tolist()


def _text_arrays_of(text):
    from regen.quality import screen

    batch = screen._ascii_batch([text]) if text.isascii() else screen._code_point_batch([text])
    return batch.cp, batch.cls


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_token_keys_follow_the_detectors_tokens(seed):
    # one key per token of the detector's own split, in order, and equal tokens with equal keys: what
    # makes the bucket count and the loop runs upper bounds
    from regen.quality import screen

    text = _random_text(random.Random(seed))
    tokens = detector.tokens_of(text)
    if not text or text.isspace():
        return
    keys, first, length = screen._token_keys(*_text_arrays_of(text))
    assert keys.size == len(tokens)
    key_of: dict[str, int] = {}
    for token, key, start, extra in zip(tokens, keys.tolist(), first.tolist(), length.tolist(), strict=True):
        assert key_of.setdefault(token, key) == key
        assert extra == len(token) - 1
        assert text.encode("utf-32-le", "surrogatepass")[4 * start : 4 * start + 4] == token[0].encode(
            "utf-32-le", "surrogatepass"
        )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=80),
    st.sampled_from([0.5, 0.51, 0.6, 0.75, 0.9, 1.0]),
)
def test_the_neighbour_bound_never_rules_out_a_majority(values, share):
    from regen.quality import screen

    chars = np.array(values, dtype=np.uint8)
    top = max(values.count(v) for v in set(values))
    if top / len(values) >= share:
        assert screen._may_hold_a_majority(chars, share)


def test_the_neighbour_bound_rules_out_prose():
    from regen.quality import screen

    prose = " ".join(e["text"] for e in OUTPUTS["good"]).replace(" ", "")
    chars = np.frombuffer(prose.encode("utf-32-le"), dtype="<u4")
    assert not screen._may_hold_a_majority(chars, detector.DEFAULT_THRESHOLDS.char_share)
    assert screen._may_hold_a_majority(np.array([7] * 60 + [1, 2] * 20, dtype=np.uint8), 0.6)


# ---------------------------------------------------------------------------- batches (suspects_many)
# The generation job's judge screens the answers of a batch at once (one concatenation): nothing about a
# text may depend on the texts beside it, in the same batch or split across batches.


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.sampled_from([1, 64, 700, 1 << 18]))
def test_a_batch_finds_what_each_text_finds_alone(seed, batch_chars):
    from regen.quality import screen

    rng = random.Random(seed)
    texts = [_random_text(rng) for _ in range(rng.randint(1, 12))]
    texts += ["", "   \n\t", None, rng.choice(OUTPUTS["garbage"])["text"]]
    rng.shuffle(texts)
    saved, screen.BATCH_CHARS = screen.BATCH_CHARS, batch_chars
    try:
        assert detector.degeneration_many(texts) == [exhaustive(text) for text in texts]
        shaped = [text for text in texts if text and not text.isspace()]
        assert suspects_many(shaped, detector.DEFAULT_THRESHOLDS) == [
            suspects(text, detector.DEFAULT_THRESHOLDS) for text in shaped
        ]
    finally:
        screen.BATCH_CHARS = saved


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.text(alphabet=st.sampled_from([*"ab .-\n", "é", "—"]), min_size=1, max_size=120), max_size=8)
)
def test_a_batch_of_loops_and_repeats_keeps_each_texts_findings(texts):
    # few distinct tokens and tight thresholds: runs and repeats at every lag, next to each other in the
    # concatenation; a run must never reach from one text into the next
    tight = Thresholds(min_loop_tokens=6, min_repeats=3, loop_tail_tokens=40, whitespace_chars=4)
    for thresholds in (detector.DEFAULT_THRESHOLDS, tight):
        assert detector.degeneration_many(texts, thresholds=thresholds) == [
            exhaustive(text, thresholds) for text in texts
        ]


def test_no_loop_or_run_spans_two_texts():
    # each text alone is clean; joined, the first's end and the second's start would make a loop of one
    # token (x repeated 30 times) and a run of 40 whitespace characters with newlines
    words = " ".join(f"word{i}" for i in range(24))
    first, second = f"{words} " + "x " * 15, "x " * 15 + words
    pad_end, pad_start = "some words then" + "\n " * 10, "\n " * 10 + "more words"
    assert [f.kind for f in degeneration(first + second)] == ["ngram_loop"]
    assert [f.kind for f in degeneration(pad_end + pad_start)] == ["whitespace_run"]
    batch = [first, second, pad_end, pad_start]
    assert detector.degeneration_many(batch) == [[], [], [], []]
    assert suspects_many(batch, detector.DEFAULT_THRESHOLDS) == [frozenset()] * 4
    # nor between a text's last tokens and what the screen puts after them: with thresholds that a
    # run of 14 equal keys passes, a clean text is still ruled out
    tight = Thresholds(min_loop_tokens=6, min_repeats=3, whitespace_chars=4)
    clean = ["one two three four five six seven", "eight nine ten"]
    assert suspects_many(clean, tight) == [frozenset()] * 2
