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

Texts are screened in batches (`suspects_many`; `suspects` is a batch of one): the generation job's judge
worker hands over the answers that finished together, and one numpy pass over their concatenation
replaces one per answer. Measured in the worker (bench/results/2026-12-07-screen-batches/): 41 us per
~6 KB answer instead of 71, 110 us per ~24 KB answer instead of 135; nothing about a text depends on the
texts beside it (tests/unit/test_quality_screen.py holds the batch against each text alone).

numpy is part of the jobs' dependencies (the generation job's ledger uses it); without it the detector
runs every check, with the same results.
"""

from __future__ import annotations

import bisect
import functools
import math

import numpy as np

_SPACE, _WORD, _PUNCT = 0, 1, 2
# In a batch's concatenation each text is followed by a separator that no text holds: a class of its own
# (it starts and ends no token and breaks every whitespace run) and a code point equal to no character.
_SEP = 3
_SEP_CP = 0x110000  # one past the last code point: no str holds it
_ASCII_SEP = 0xFF  # no ASCII text holds it
# A batch stops growing past this many characters: its arrays stay a few MB (cache-sized) however long
# the answers are, and one pass over them already costs far more than the calls.
BATCH_CHARS = 1 << 18


def _class_of(char: str) -> int:
    if char.isspace():
        return _SPACE
    if char.isalnum() or char == "_":
        return _WORD
    return _PUNCT


# The class of every code point, filled in as characters are met: 255 until looked up. One byte per
# code point (1.1 MB), so a text's classes are one indexing operation once its characters were seen.
_UNKNOWN = 255
_CLASS = np.full(_SEP_CP + 1, _UNKNOWN, dtype=np.uint8)
_CLASS[:128] = [_class_of(chr(i)) for i in range(128)]
_CLASS[_SEP_CP] = _SEP
# An ASCII text (most answers) is read as bytes: its classes and its characters without whitespace come
# from bytes.translate, a C loop, instead of indexing and masking code-point arrays.
_ASCII_CLASS = bytes(_CLASS[:128].tolist()) + bytes(127) + bytes((_SEP,))
_ASCII_SPACES = bytes(i for i in range(128) if _CLASS[i] == _SPACE)


def _run_lengths(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of True in a 1-D boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).view(np.int8)))
    return edges[::2], edges[1::2] - edges[::2]


def _has_run(mask: np.ndarray, length: int) -> bool:
    """Whether a boolean array holds `length` True in a row (a C substring search of its bytes)."""
    return length <= 0 or b"\x01" * length in mask.tobytes()


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
    need. A separator (a batch's) is neither a word nor punctuation: it starts and ends no token."""
    word = cls == _WORD
    punct = cls == _PUNCT
    differs = cp[1:] != cp[:-1]
    word_edge = word[1:] != word[:-1]
    # a token starts at a word character after a non-word one, and at a punctuation character unless it
    # repeats the one before it ("-----" is one token); it ends where the next character would not
    # continue it
    starts = np.empty(cls.size, dtype=bool)
    starts[0] = word[0] or punct[0]
    starts[1:] = (word_edge & word[1:]) | (punct[1:] & differs)
    ends = np.empty(cls.size, dtype=bool)
    ends[-1] = word[-1] or punct[-1]
    ends[:-1] = (word_edge & word[:-1]) | (punct[:-1] & differs)
    first = np.flatnonzero(starts)
    last = np.flatnonzero(ends)
    last_offset = (last - first).astype(np.uint32)
    key = cp[first].astype(np.uint32) * np.uint32(0x9E3779B1)
    key ^= cp[last].astype(np.uint32) * np.uint32(0xC2B2AE3D)
    key ^= last_offset * np.uint32(0x27D4EB2F)
    return key, first, last_offset


class _Batch:
    """Texts concatenated, each followed by a separator: `cp` their characters, `cls` the classes,
    `chars` the characters without whitespace; text i is cp[bounds[i] : bounds[i + 1] - 1] and
    chars[char_bounds[i] : char_bounds[i + 1] - 1]."""

    def __init__(self, cp, cls, chars, bounds: list[int], char_bounds: list[int]):
        self.cp, self.cls, self.chars = cp, cls, chars
        self.bounds, self.char_bounds = bounds, char_bounds


def _bounds(lengths: list[int]) -> list[int]:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length + 1)
    return bounds


def _ascii_batch(texts: list[str]) -> _Batch:
    raws = [text.encode("ascii") for text in texts]
    chars = [raw.translate(None, _ASCII_SPACES) for raw in raws]
    sep = bytes((_ASCII_SEP,))
    joined = sep.join(raws)
    return _Batch(
        np.frombuffer(joined, dtype=np.uint8),
        np.frombuffer(joined.translate(_ASCII_CLASS), dtype=np.uint8),
        np.frombuffer(sep.join(chars), dtype=np.uint8),
        _bounds([len(raw) for raw in raws]),
        _bounds([len(c) for c in chars]),
    )


def _code_point_batch(texts: list[str]) -> _Batch:
    parts = [_code_points(text) for text in texts]
    if len(parts) == 1:
        cp = parts[0]
    else:
        sep = np.array([_SEP_CP], dtype="<u4")
        cp = np.concatenate([part for code_points in parts for part in (code_points, sep)][:-1])
    cls = _classes(cp)
    chars = cp[cls != _SPACE]
    ends = np.flatnonzero(chars == _SEP_CP).tolist() if len(parts) > 1 else []
    char_bounds = [0, *(end + 1 for end in ends), chars.size + 1]
    return _Batch(cp, cls, chars, _bounds([len(part) for part in parts]), char_bounds)


def suspects(text: str, t) -> frozenset[str]:
    """The names of the checks (`one_token_repeated`, `ngram_loop`, `whitespace_run`) that could find
    something in `text` under thresholds `t`; the others cannot. `text` is not empty."""
    return suspects_many([text], t)[0]


def suspects_many(texts: list[str], t) -> list[frozenset[str]]:
    """`suspects` of each text, screened in batches of up to BATCH_CHARS characters (ASCII texts apart
    from the others, which are read as code points). None of the texts is empty."""
    found: list[frozenset[str]] = [frozenset()] * len(texts)
    for ascii_only in (True, False):
        batch: list[int] = []
        size = 0
        for i, text in enumerate(texts):
            if text.isascii() is not ascii_only:
                continue
            batch.append(i)
            size += len(text)
            if size >= BATCH_CHARS:
                _screen_into(found, batch, texts, ascii_only, t)
                batch, size = [], 0
        if batch:
            _screen_into(found, batch, texts, ascii_only, t)
    return found


def _screen_into(found: list, which: list[int], texts: list[str], ascii_only: bool, t) -> None:
    chosen = [texts[i] for i in which]
    batch = _ascii_batch(chosen) if ascii_only else _code_point_batch(chosen)
    for i, could in zip(which, _screen_batch(batch, t), strict=True):
        found[i] = frozenset(could)


def _screen_batch(b: _Batch, t) -> list[set[str]]:
    count = len(b.bounds) - 1
    found: list[set[str]] = [set() for _ in range(count)]

    # whitespace_run: only a run of at least whitespace_chars whitespace characters can be one (a
    # separator ends every run, so a run found lies in one text)
    if t.whitespace_chars <= 0:
        for could in found:
            could.add("whitespace_run")
    else:
        classes = b.cls.tobytes()
        run = bytes((_SPACE,)) * t.whitespace_chars
        at = classes.find(run)
        while at >= 0:
            i = bisect.bisect_right(b.bounds, at) - 1
            found[i].add("whitespace_run")
            at = classes.find(run, b.bounds[i + 1]) if i + 1 < count else -1

    # one_token_repeated, for characters: the most common non-space character's share, where the
    # neighbour bound allows one to reach it; ASCII characters counted one by one, all others in one
    # bin (an upper bound for each of them)
    screened = []  # the texts with a character that is not whitespace
    for i in range(count):
        chars = b.chars[b.char_bounds[i] : b.char_bounds[i + 1] - 1]
        n_chars = chars.size
        if n_chars == 0:
            continue
        screened.append(i)
        if n_chars >= t.char_min_chars and _may_hold_a_majority(chars, t.char_share):
            counts = np.bincount(chars if chars.dtype == np.uint8 else np.minimum(chars, 128))
            top = int(counts.max())
            if top / n_chars >= t.char_share and counts.size == 129 and counts[128] == top:
                top = max(
                    int(counts[:128].max()), int(np.unique(chars[chars >= 128], return_counts=True)[1].max())
                )
            if top / n_chars >= t.char_share:
                found[i].add("one_token_repeated")
    if not screened:
        return found

    # the tokens of every text at once; text i's are keys[token_bounds[i] : token_bounds[i + 1]]
    keys, first, last_offset = _token_keys(b.cp, b.cls)
    token_bounds = np.searchsorted(first, b.bounds).tolist()
    tails: list[tuple[int, int, int]] = []  # (text, first token of its tail, end)
    for i in screened:
        lo, hi = token_bounds[i], token_bounds[i + 1]
        n_tokens = hi - lo
        if "one_token_repeated" not in found[i] and n_tokens >= t.word_min_words:
            # the fullest of 4096 key buckets bounds the most common token's count
            top = int(np.bincount(keys[lo:hi] >> np.uint32(20)).max())
            if top / n_tokens >= t.word_share:
                found[i].add("one_token_repeated")
        # the loop search reads the last loop_tail_tokens tokens, sliced as the detector slices its list
        tail = range(lo, hi)[-t.loop_tail_tokens :]
        if len(tail) >= 2:
            tails.append((i, tail.start, tail.stop))
    if tails and t.max_n >= 1:
        for i in _loop_suspects(tails, keys, first, last_offset, b.cp, t):
            found[i].add("ngram_loop")
    return found


def _loop_suspects(tails, keys, first, last_offset, cp, t) -> set[int]:
    """The texts whose tail may hold an n-gram loop: the tails' keys side by side, `max_n` distinct spacer
    keys between two tails (no comparison at a lag of up to max_n meets the next tail), and for every lag
    n <= max_n the runs of positions j with key[j] == key[j + n]."""
    gap = t.max_n
    spans = [hi - lo for _, lo, hi in tails]
    total = sum(spans) + gap * len(tails)
    if len(tails) == 1:  # one text: its tokens' arrays sliced, not gathered
        index: slice | np.ndarray = slice(tails[0][1], tails[0][2])
    else:
        index = np.concatenate([np.arange(lo, hi) for _, lo, hi in tails])
    # the keys also take the second character (the first again for a one-character token), which tells
    # apart tokens like w12 and w22 that a loop at a lag of 10 would otherwise confuse; a token's key is
    # even and a spacer's odd, so the two never meet (clearing a bit can only make more keys equal)
    second = cp[first[index] + (last_offset[index] > 0)]
    tail_keys = keys[index] ^ (second.astype(np.uint32) * np.uint32(0x85EBCA77))
    tail_keys &= np.uint32(0xFFFFFFFE)
    # then `gap` more spacers (other odd keys), so that every position has a key at each lag
    row = np.empty(total + gap, dtype=np.uint32)
    spacer = np.arange(1, 2 * gap, 2, dtype=np.uint32)
    starts = []  # where each tail begins in `row`
    at = taken = 0
    for span in spans:
        starts.append(at)
        row[at : at + span] = tail_keys[taken : taken + span]
        row[at + span : at + span + gap] = spacer
        at += span + gap
        taken += span
    row[total:] = spacer + np.uint32(2 * gap)
    # same[n-1, j]: row[j] == row[j + n], every lag in one comparison with a view of `row` that starts one
    # element further on each line; a line of `same` ends on a spacer (False), so runs never join
    step = row.itemsize
    shifted = np.ndarray((gap, total), dtype=row.dtype, buffer=row, offset=step, strides=(step, step))
    same = shifted == row[:total]
    if not _has_run(same, _min_loop_run(gap, t)):
        return set()
    # a run long enough for some n: settle it per n and per text (rare in normal text)
    run_starts, run_lengths = _run_lengths(same.ravel())
    n = run_starts // total + 1
    repeats = run_lengths // n + 1
    looping = (repeats >= t.min_repeats) & (repeats * n >= t.min_loop_tokens)
    suspect = set()
    for start, lag in zip((run_starts % total)[looping].tolist(), n[looping].tolist(), strict=True):
        k = bisect.bisect_right(starts, start) - 1
        if lag <= spans[k] // 2:  # the detector searches n up to half the tail
            suspect.add(tails[k][0])
    return suspect
