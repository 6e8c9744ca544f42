"""Is a completion degenerate? Pure checks over its text, and a rolling share for a long generation run.

A server can answer `/health_generate` and still emit garbage: public reports on RTX PRO 6000 (sm_120)
show one character repeated for the whole answer (sgl-project/sglang issue 24321: "+++++..."), and
fluent-looking nonsense (issue 21132). The checks here catch the *shapes* of degenerate output that need
no reference answer:

  empty              nothing but whitespace in the content
  replacement_char   U+FFFD: the server decoded token bytes that do not form UTF-8
  one_token_repeated one character or one word makes up most of the text
  ngram_loop         the same run of 1..N words repeated back to back many times
  whitespace_run     a long run of blank lines/spaces (a model that lost the thread and rambles whitespace)
  roundtrip          encode(text) then decode() with the model's tokenizer does not give the text back

Fluent nonsense in the right script ("MethodInfoyageegebensatunya amatööri ...") passes all of these:
the probe set (regen.quality.probes) catches that with questions whose answers are known. Standard
library only, so the generation job can import it on any host; where numpy is importable (the jobs'
dependencies), a vectorized screen (regen.quality.screen) first rules out the checks that cannot find
anything in a text, so a normal answer costs linear, C-speed work (issue 29). The findings are the same
either way: a check the screen cannot rule out runs exactly as without it.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

try:
    from regen.quality.screen import suspects_many as _screen
except ImportError:  # no numpy on this host: every check runs
    _screen = None

# Words, and runs of one punctuation character ("-----" in a markdown table is one token, not a loop of
# five); whitespace is looked at separately (whitespace_run).
_TOKENS = re.compile(r"\w+|([^\w\s])\1*", re.UNICODE)


def tokens_of(text: str) -> list[str]:
    return [m.group(0) for m in _TOKENS.finditer(text)]


_WHITESPACE_RUN = re.compile(r"\s{2,}")
_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.S)


@dataclass(frozen=True)
class Thresholds:
    """Where normal text ends and degenerate text begins. Defaults keep real prose and code clean (see
    tests/unit/test_quality_detector.py for the good outputs they are checked against)."""

    # one_token_repeated: the most common non-space character's share of a text of at least min_chars,
    # or the most common word's share of at least min_words words.
    char_share: float = 0.6
    char_min_chars: int = 16
    word_share: float = 0.5
    word_min_words: int = 8
    # ngram_loop: an n-gram (n <= max_n words) repeated back to back at least min_repeats times, covering
    # at least min_loop_tokens tokens.
    max_n: int = 16
    min_repeats: int = 4
    min_loop_tokens: int = 24
    # Only the last loop_tail_tokens tokens are searched for loops: a model stuck in one loops until
    # max_tokens, so the loop is at the end, and the check stays cheap on long completions.
    loop_tail_tokens: int = 1024
    # whitespace_run: at least this many whitespace characters in one run, holding at least min_newlines.
    whitespace_chars: int = 32
    whitespace_newlines: int = 8


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Finding:
    """One reason a text looks degenerate."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _one_token_repeated(text: str, t: Thresholds) -> Finding | None:
    chars = [c for c in text if not c.isspace()]
    if len(chars) >= t.char_min_chars:
        char, count = collections.Counter(chars).most_common(1)[0]
        if count / len(chars) >= t.char_share:
            return Finding(
                "one_token_repeated",
                f"{char!r} is {count} of {len(chars)} non-space characters ({count / len(chars):.0%})",
            )
    words = tokens_of(text)
    if len(words) >= t.word_min_words:
        word, count = collections.Counter(words).most_common(1)[0]
        if count / len(words) >= t.word_share:
            return Finding(
                "one_token_repeated",
                f"{word!r} is {count} of {len(words)} tokens ({count / len(words):.0%})",
            )
    return None


def longest_ngram_loop(tokens: list[str], max_n: int) -> tuple[int, int, int]:
    """(n, repeats, start) of the back-to-back repeated n-gram covering the most tokens; (0, 0, 0) if none.

    An n-gram repeated r times back to back is a run of (r - 1) * n positions j where
    tokens[j] == tokens[j + n]; one pass per n finds the longest such run (linear, no slicing: the
    generation job runs this on every completion).
    """
    best, best_cover = (0, 0, 0), 0
    size = len(tokens)
    for n in range(1, min(max_n, size // 2) + 1):
        run = run_start = 0
        for j, same in enumerate(map(str.__eq__, tokens, tokens[n:])):
            if not same:
                run = 0
                continue
            if run == 0:
                run_start = j
            run += 1
            repeats = run // n + 1
            if repeats > 1 and repeats * n > best_cover:
                best, best_cover = (n, repeats, run_start), repeats * n
    return best


def _ngram_loop(text: str, t: Thresholds) -> Finding | None:
    tokens = tokens_of(text)[-t.loop_tail_tokens :]
    n, repeats, start = longest_ngram_loop(tokens, t.max_n)
    if n and repeats >= t.min_repeats and n * repeats >= t.min_loop_tokens:
        gram = " ".join(tokens[start : start + n])
        return Finding("ngram_loop", f"{n}-gram {_preview(gram)} repeated {repeats} times back to back")
    return None


def _whitespace_run(text: str, t: Thresholds) -> Finding | None:
    for match in _WHITESPACE_RUN.finditer(text):
        run = match.group(0)
        if len(run) >= t.whitespace_chars and run.count("\n") >= t.whitespace_newlines:
            return Finding(
                "whitespace_run",
                f"{len(run)} whitespace characters ({run.count(chr(10))} newlines) in one run",
            )
    return None


def _roundtrip(text: str, tokenizer: Any) -> Finding | None:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    back = tokenizer.decode(ids)
    if back != text:
        where = next(
            (i for i, (a, b) in enumerate(zip(text, back, strict=False)) if a != b), min(len(text), len(back))
        )
        return Finding(
            "roundtrip",
            f"decode(encode(text)) differs from the text at character {where}: "
            f"{_preview(text[where : where + 20])} -> {_preview(back[where : where + 20])}",
        )
    return None


_CHECKS_BY_NAME = (
    ("one_token_repeated", _one_token_repeated),
    ("ngram_loop", _ngram_loop),
    ("whitespace_run", _whitespace_run),
)
_CHECKS = tuple(check for _, check in _CHECKS_BY_NAME)


def strip_reasoning(text: str) -> str:
    """The answer without an inline <think>...</think> block (servers started without a reasoning parser)."""
    return _THINK_BLOCK.sub("", text or "")


def degeneration(
    text: str | None,
    *,
    tokenizer: Any = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[Finding]:
    """Every degenerate shape found in `text` (empty list: looks like normal text).

    `tokenizer`: optional object with encode(text) and decode(ids) (a transformers tokenizer, or a
    `tokenizers.Tokenizer`); when given, a text it cannot reproduce is a finding too.
    """
    return degeneration_many([text], tokenizer=tokenizer, thresholds=thresholds)[0]


def degeneration_many(
    texts: list[str | None],
    *,
    tokenizer: Any = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[list[Finding]]:
    """`degeneration` of each text. The same findings as one call per text, for less CPU: the screen
    reads the texts as one batch (regen.quality.screen.suspects_many)."""
    texts = [text or "" for text in texts]
    found: list[list[Finding]] = []
    shaped: list[int] = []  # the texts with something besides whitespace: the others are `empty`
    for i, text in enumerate(texts):
        if not text:
            found.append([Finding("empty", "the content is empty")])
        elif text.isspace():  # not text.strip(): no copy of a long answer
            found.append([Finding("empty", f"only whitespace ({len(text)} characters)")])
        else:
            found.append([])
            shaped.append(i)
    coulds = _screen([texts[i] for i in shaped], thresholds) if _screen is not None and shaped else None
    for k, i in enumerate(shaped):
        found[i] = _findings(texts[i], None if coulds is None else coulds[k], tokenizer, thresholds)
    return found


def _findings(text: str, could: frozenset[str] | None, tokenizer: Any, t: Thresholds) -> list[Finding]:
    """The findings of a text that is not blank; `could`: the checks the screen did not rule out (None:
    every check runs)."""
    findings: list[Finding] = []
    bad = text.count("\ufffd")
    if bad:
        findings.append(
            Finding(
                "replacement_char", f"{bad} U+FFFD replacement character(s): broken UTF-8 from the server"
            )
        )
    checks = _CHECKS if could is None else tuple(check for name, check in _CHECKS_BY_NAME if name in could)
    for check in checks:
        found = check(text, t)
        if found:
            findings.append(found)
    if tokenizer is not None:
        found = _roundtrip(text, tokenizer)
        if found:
            findings.append(found)
    return findings


@dataclass
class RollingDegeneration:
    """The degenerate share of the last `window` completions; `tripped` once it passes `threshold`.

    The generation job feeds every finished completion to `add()` and stops (keeping what it has
    written) when `tripped`: garbage from a broken server would otherwise fill the whole run. It only
    judges after `min_samples` completions, so one odd answer at the start does not stop a run.
    """

    window: int = 200
    threshold: float = 0.2
    min_samples: int = 20
    tokenizer: Any = None
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    keep_examples: int = 5
    _recent: collections.deque = field(default_factory=collections.deque, repr=False)
    _examples: collections.deque = field(default_factory=collections.deque, repr=False)
    seen: int = 0
    degenerate_total: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 < self.threshold <= 1 or self.min_samples < 1:
            raise ValueError(
                f"RollingDegeneration needs window >= 1, 0 < threshold <= 1, min_samples >= 1 "
                f"(got window={self.window}, threshold={self.threshold}, min_samples={self.min_samples})"
            )
        self._recent = collections.deque(maxlen=self.window)
        self._in_window = 0  # sum(self._recent), kept as answers come and go: `tripped` is asked per answer
        self._examples = collections.deque(maxlen=self.keep_examples)

    def add(
        self,
        text: str | None,
        key: str | None = None,
        judge: Callable[[str | None], list[Finding]] | None = None,
    ) -> list[Finding]:
        """Judge one completion; returns its findings (empty when it looks fine)."""
        findings = (
            judge or (lambda t: degeneration(t, tokenizer=self.tokenizer, thresholds=self.thresholds))
        )(text)
        self.seen += 1
        if len(self._recent) == self.window:
            self._in_window -= self._recent[0]  # leaves the window with this append
        self._recent.append(bool(findings))
        self._in_window += bool(findings)
        if findings:
            self.degenerate_total += 1
            self._examples.append(
                {"id": key, "findings": [str(f) for f in findings], "text": (text or "")[:200]}
            )
        return findings

    @property
    def share(self) -> float:
        return self._in_window / len(self._recent) if self._recent else 0.0

    @property
    def tripped(self) -> bool:
        return len(self._recent) >= min(self.min_samples, self.window) and self.share > self.threshold

    def summary(self) -> dict[str, Any]:
        """JSON-ready state for the job's status file and its error message."""
        return {
            "window": self.window,
            "judged_in_window": len(self._recent),
            "degenerate_in_window": self._in_window,
            "share": round(self.share, 4),
            "threshold": self.threshold,
            "tripped": self.tripped,
            "seen": self.seen,
            "degenerate_total": self.degenerate_total,
            "examples": list(self._examples),
        }

    def message(self) -> str:
        """The clear error the job stops with."""
        s = self.summary()
        example = s["examples"][-1] if s["examples"] else None
        text = (
            f"{s['degenerate_in_window']} of the last {s['judged_in_window']} completions are degenerate "
            f"({s['share']:.0%} > threshold {self.threshold:.0%}): the server is producing garbage; stopped, "
            "keeping what was written. Check the server (run `python -m regen.jobs.quality_gate`), fix it, "
            "and re-run: finished prompts are kept"
        )
        if example:
            text += f"; latest: {example['findings'][0]} in {_preview(example['text'], 60)}"
        return text


def add_rolling_arguments(parser) -> None:
    """The generation job's flags for the rolling detector (--degenerate-window 0 turns it off)."""
    group = parser.add_argument_group("output quality (stop when the server produces garbage)")
    group.add_argument(
        "--degenerate-window",
        type=int,
        default=200,
        help="judge the last N completions (0: off; default 200)",
    )
    group.add_argument(
        "--degenerate-threshold",
        type=float,
        default=0.2,
        help="stop when more than this share of them is degenerate (default 0.2)",
    )
    group.add_argument(
        "--degenerate-min-samples",
        type=int,
        default=20,
        help="judge only after this many completions (default 20)",
    )


def rolling_from_args(args) -> RollingDegeneration | None:
    """The detector the flags ask for; None when --degenerate-window is 0. Raises ValueError with the
    flag names for settings that cannot work."""
    if args.degenerate_window == 0:
        return None
    try:
        return RollingDegeneration(
            window=args.degenerate_window,
            threshold=args.degenerate_threshold,
            min_samples=args.degenerate_min_samples,
        )
    except ValueError as exc:
        raise ValueError(
            f"--degenerate-window/--degenerate-threshold/--degenerate-min-samples: {exc}"
        ) from None
