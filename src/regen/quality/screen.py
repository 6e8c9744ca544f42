"""A vectorized screen in front of the degeneration checks: rules a normal answer out in linear time.

The checks in `regen.quality.detector` are exact but cost Python-level work per character and per word
(a character Counter, a regex token split, 16 passes of the n-gram loop search): about 2.5 ms for a 6 KB
answer, which is most of a generation client's CPU per answer (issue 29). This module computes, with
numpy over the answer's code points, bounds that are *necessary conditions* for each finding:

  one_token_repeated  the exact share of the most common non-space character, and an upper bound on the
                      most common token's share (tokens hashed; a hash collision can only raise it)
  ngram_loop          over the same last `loop_tail_tokens` tokens, the longest back-to-back run for every
                      n <= max_n on the token hashes (a collision can only lengthen a run)
  whitespace_run      the longest run of whitespace characters

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
# The token hash: sum of (code point + 1) * P**(i - start) over a token's characters, mod 2**64. Computed
# for all tokens at once as P**-start * sum((cp_i + 1) * P**i); P is odd, so it has an inverse mod 2**64.
_P = 0x100000001B3  # the 64-bit FNV prime (odd)
_P_INV = pow(_P, -1, 2**64)
_powers: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _power_tables(size: int) -> tuple[np.ndarray, np.ndarray]:
    """P**i and P**-i mod 2**64 for i < size (kept for the process, grown when a longer text comes)."""
    have = _powers[0].size
    if have < size:
        grown = max(size, 2 * have, 8192)
        tables = []
        for base in (_P, _P_INV):
            table = np.ones(grown, dtype=np.uint64)
            table[1] = base
            filled, step = 2, base * base % 2**64  # step = base**filled
            while filled < grown:
                # array products wrap around mod 2**64, which is the arithmetic wanted
                chunk = min(filled, grown - filled)
                table[filled : filled + chunk] = table[:chunk] * np.uint64(step)
                filled += chunk
                step = step * step % 2**64
            tables.append(table)
        _powers[:] = tables
    return _powers[0], _powers[1]


def _run_lengths(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of True in a 1-D boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).view(np.int8)))
    return edges[::2], edges[1::2] - edges[::2]


def _has_run(mask: np.ndarray, length: int) -> bool:
    """Whether a boolean array holds `length` True values in a row (a C substring search of its bytes)."""
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


def suspects(text: str, t) -> frozenset[str]:
    """The names of the checks (`one_token_repeated`, `ngram_loop`, `whitespace_run`) that could find
    something in `text` under thresholds `t`; the others cannot. `text` is not empty."""
    cp, cls, chars = _ascii_arrays(text) if text.isascii() else (*_text_arrays(text), None)
    found: set[str] = set()
    space = cls == _SPACE

    # whitespace_run: only a run of at least whitespace_chars whitespace characters can be one
    if _has_run(space, t.whitespace_chars):
        found.add("whitespace_run")

    nonspace = ~space
    if chars is None:
        chars = cp[nonspace]
    n_chars = chars.size
    if n_chars == 0:
        return frozenset(found)
    if n_chars >= t.char_min_chars:
        # ASCII characters counted one by one; all others in one bin, an upper bound for each of them
        counts = np.bincount(chars if chars.dtype == np.uint8 else np.minimum(chars, 128))
        top = int(counts.max())
        if top / n_chars >= t.char_share and counts.size == 129 and counts[128] == top:
            top = max(
                int(counts[:128].max()), int(np.unique(chars[chars >= 128], return_counts=True)[1].max())
            )
        if top / n_chars >= t.char_share:
            found.add("one_token_repeated")

    # tokens: a word character after a non-word one starts a token; a punctuation character starts one
    # unless it repeats the character before it (a run like "-----" is one token)
    prev_cls = np.empty_like(cls)
    prev_cls[0] = _SPACE
    prev_cls[1:] = cls[:-1]
    prev_cp = np.empty_like(cp)
    prev_cp[0] = np.iinfo(cp.dtype).max  # any value: the first character starts a token by its class
    prev_cp[1:] = cp[:-1]
    starts = nonspace & ((cls != prev_cls) | ((cls == _PUNCT) & (cp != prev_cp)))
    # in the text without its whitespace, every token is a contiguous segment
    seg_starts = np.flatnonzero(np.compress(nonspace, starts))
    n_tokens = seg_starts.size
    powers, inverse_powers = _power_tables(n_chars)
    weighted = (chars.astype(np.uint64) + np.uint64(1)) * powers[:n_chars]
    # each token's sum: the running sum at its last character less the one at the token before's (the
    # segments tile the characters, the first starts at 0); mod 2**64 as np.add.reduceat, and cheaper
    ends = np.empty_like(seg_starts)
    ends[:-1] = seg_starts[1:] - 1
    ends[-1] = n_chars - 1
    sums = np.cumsum(weighted)[ends]
    sums[1:] -= sums[:-1].copy()
    hashes = sums * inverse_powers[seg_starts]

    if "one_token_repeated" not in found and n_tokens >= t.word_min_words:
        # the fullest of 4096 hash buckets bounds the most common token's count (linear); only a
        # bucket that could pass is settled by counting the hashes themselves (a sort)
        top = int(np.bincount((hashes & np.uint64(4095)).astype(np.intp), minlength=1).max())
        if top / n_tokens >= t.word_share:
            top = int(np.unique(hashes, return_counts=True)[1].max())
        if top / n_tokens >= t.word_share:
            found.add("one_token_repeated")

    tail = hashes[-t.loop_tail_tokens :]  # as the detector slices its token list (0: all of them)
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
