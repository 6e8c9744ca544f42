"""A vectorized screen in front of the degeneration checks: rules a normal answer out in linear time.

The checks in `regen.quality.detector` are exact but cost Python-level work per character and per word
(a character Counter, a regex token split, 16 passes of the n-gram loop search): about 2.5 ms for a 6 KB
answer, which is most of a generation client's CPU per answer (issue 29). This module computes, with
numpy over the answer's code points, bounds that are *necessary conditions* for each finding:

  one_token_repeated  for characters: how many neighbours are equal (a character making up a share
                      s > 1/2 of n leaves at least (2s - 1)n - 1 of them), then, only where that could
                      pass, the exact count of the most common non-space character; for tokens: the
                      fullest of 4,096 buckets of a key per token (its first and last characters and its
                      length), an upper bound on the most common token's count
  ngram_loop          over the same last `loop_tail_tokens` tokens, the longest back-to-back run for every
                      n <= max_n on those keys (the second character added)
  whitespace_run      whether a run of `whitespace_chars` whitespace characters exists

Equal tokens always get equal keys; two different tokens sharing a key can only raise a count or
lengthen a run, so every bound is still an upper bound.
A check whose bound cannot reach its threshold cannot find anything; any other check runs exactly as
before (`suspects` names them). So the verdicts and the finding texts are the detector's own, always:
the screen only skips work that could not have produced a finding. The tokenization here is the
detector's (`\\w+|([^\\w\\s])\\1*`): a character is a word character where `str.isalnum()` or `_`, space
where `str.isspace()`, the same classes Python's `re` uses for str patterns.

numpy is part of the jobs' dependencies (the generation job's ledger uses it); without it the detector
runs every check, with the same results.
"""

from __future__ import annotations

import functools
import math

import numpy as np

_SPACE, _WORD, _PUNCT = 0, 1, 2


def _class_of(char: str) -> int:
    if char.isspace():
        return _SPACE
    if char.isalnum() or char == "_":
        return _WORD
    return _PUNCT


# The class of every code point, filled in as characters are met: 255 until looked up. One byte per
# code point (1.1 MB), so a text's classes are one indexing operation once its characters were seen.
_UNKNOWN = 255
_CLASS = np.full(0x110000, _UNKNOWN, dtype=np.uint8)
_CLASS[:128] = [_class_of(chr(i)) for i in range(128)]
# An ASCII text (most answers) is read as bytes: its classes and its characters without whitespace come
# from bytes.translate, a C loop, instead of indexing and masking code-point arrays.
_ASCII_CLASS = bytes(_CLASS[:128].tolist()) + bytes(128)
_ASCII_SPACES = bytes(i for i in range(128) if _CLASS[i] == _SPACE)


def _run_lengths(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of True in a 1-D boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).view(np.int8)))
    return edges[::2], edges[1::2] - edges[::2]


def _has_run(values: np.ndarray, length: int, value: int = 1) -> bool:
    """Whether a one-byte array (bool or uint8) holds `length` elements equal to `value` in a row (a C
    substring search of its bytes)."""
    return length <= 0 or bytes((value,)) * length in values.tobytes()


def _code_points(text: str) -> np.ndarray:
    # utf-32 gives one element per character (lone surrogates from JSON escapes pass through as such)
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _classes(cp: np.ndarray) -> np.ndarray:
    cls = _CLASS[cp]
    unknown = cls == _UNKNOWN
    if unknown.any():
        new = np.unique(cp[unknown])
        _CLASS[new] = [_class_of(chr(c)) for c in new.tolist()]
        cls = _CLASS[cp]
    return cls


def _text_arrays(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(code points, classes) of any text."""
    cp = _code_points(text)
    return cp, _classes(cp)


def _ascii_arrays(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(code points, classes, the code points without whitespace) of an ASCII text, as uint8."""
    raw = text.encode("ascii")
    return (
        np.frombuffer(raw, dtype=np.uint8),
        np.frombuffer(raw.translate(_ASCII_CLASS), dtype=np.uint8),
        np.frombuffer(raw.translate(None, _ASCII_SPACES), dtype=np.uint8),
    )


@functools.lru_cache(maxsize=64)
def _min_loop_run(max_n: int, t) -> int:
    """The shortest run of positions j with tail[j] == tail[j + n], for any n <= max_n, whose n-gram loop
    passes the thresholds (the detector's repeats = run // n + 1, at least min_repeats, covering at least
    min_loop_tokens); at least 1, as the detector needs one repeat."""
    runs = []
    for n in range(1, max_n + 1):
        repeats = max(t.min_repeats, -(-t.min_loop_tokens // n))
        runs.append((repeats - 1) * n)
    return max(1, min(runs))


def _may_hold_a_majority(chars: np.ndarray, share: float) -> bool:
    """False when no value can make up `share` (> 1/2) of `chars`: a value met k times, between the n - k
    others, forms at most n - k + 1 runs, so at least 2k - n - 1 neighbours are equal to each other. One
    comparison of the array with itself instead of a histogram."""
    n = chars.size
    least = math.floor(share * n) - 1  # at or below the smallest count that reaches `share` (float-safe)
    need = 2 * least - n - 1
    return need <= 0 or int(np.count_nonzero(chars[1:] == chars[:-1])) >= need


def _token_keys(cp: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, first, last_offset) of every token of the detector's tokenization (`\\w+|([^\\w\\s])\\1*`), in
    order: `key` a uint32 hash of the token's first and last characters and its length, `first` where the
    token starts, `last_offset` its last character's offset from the first (its length - 1). Equal
    tokens get equal keys (a collision can only make more of them equal), which is all the bounds below
    need."""
    word = cls == _WORD
    punct = cls == _PUNCT
    differs = cp[1:] != cp[:-1]
    word_edge = word[1:] != word[:-1]
    # a token starts at a word character after a non-word one, and at a punctuation character unless it
    # repeats the one before it ("-----" is one token); it ends where the next character would not
    # continue it
    starts = np.empty(cls.size, dtype=bool)
    starts[0] = cls[0] != _SPACE
    starts[1:] = (word_edge & word[1:]) | (punct[1:] & differs)
    ends = np.empty(cls.size, dtype=bool)
    ends[-1] = cls[-1] != _SPACE
    ends[:-1] = (word_edge & word[:-1]) | (punct[:-1] & differs)
    first = np.flatnonzero(starts)
    last = np.flatnonzero(ends)
    last_offset = (last - first).astype(np.uint32)
    key = cp[first].astype(np.uint32) * np.uint32(0x9E3779B1)
    key ^= cp[last].astype(np.uint32) * np.uint32(0xC2B2AE3D)
    key ^= last_offset * np.uint32(0x27D4EB2F)
    return key, first, last_offset


def suspects(text: str, t) -> frozenset[str]:
    """The names of the checks (`one_token_repeated`, `ngram_loop`, `whitespace_run`) that could find
    something in `text` under thresholds `t`; the others cannot. `text` is not empty."""
    if text.isascii():
        cp, cls, chars = _ascii_arrays(text)
    else:
        cp, cls = _text_arrays(text)
        chars = cp[cls != _SPACE]
    found: set[str] = set()

    # whitespace_run: only a run of at least whitespace_chars whitespace characters can be one
    if _has_run(cls, t.whitespace_chars, _SPACE):
        found.add("whitespace_run")

    n_chars = chars.size
    if n_chars == 0:
        return frozenset(found)
    if n_chars >= t.char_min_chars and _may_hold_a_majority(chars, t.char_share):
        # ASCII characters counted one by one; all others in one bin, an upper bound for each of them
        counts = np.bincount(chars if chars.dtype == np.uint8 else np.minimum(chars, 128))
        top = int(counts.max())
        if top / n_chars >= t.char_share and counts.size == 129 and counts[128] == top:
            top = max(
                int(counts[:128].max()), int(np.unique(chars[chars >= 128], return_counts=True)[1].max())
            )
        if top / n_chars >= t.char_share:
            found.add("one_token_repeated")

    keys, first, last_offset = _token_keys(cp, cls)
    n_tokens = keys.size
    if "one_token_repeated" not in found and n_tokens >= t.word_min_words:
        # the fullest of 4096 key buckets bounds the most common token's count
        top = int(np.bincount(keys >> np.uint32(20)).max())
        if top / n_tokens >= t.word_share:
            found.add("one_token_repeated")

    # the loop search reads the last loop_tail_tokens tokens, as the detector slices its list (0: all);
    # their keys also take the second character (the first again for a one-character token), which
    # tells apart tokens like w12 and w22 that a loop at a lag of 10 would otherwise confuse
    in_tail = slice(-t.loop_tail_tokens, None)
    second = cp[first[in_tail] + (last_offset[in_tail] > 0)]
    tail = keys[in_tail] ^ (second.astype(np.uint32) * np.uint32(0x85EBCA77))
    size = tail.size
    max_n = min(t.max_n, size // 2)
    if max_n >= 1:
        # same[n-1, j]: tail[j] == tail[j + n]; a False closes every row, so runs never join
        same = np.zeros((max_n, size + 1), dtype=bool)
        for n in range(1, max_n + 1):
            np.equal(tail[n:], tail[:-n], out=same[n - 1, : size - n])
        if _has_run(same, _min_loop_run(max_n, t)):
            # a run long enough for some n: settle it per n (rare in normal text)
            run_starts, run_lengths = _run_lengths(same.ravel())
            n = run_starts // (size + 1) + 1
            repeats = run_lengths // n + 1
            if bool(((repeats >= t.min_repeats) & (repeats * n >= t.min_loop_tokens)).any()):
                found.add("ngram_loop")
    return frozenset(found)
