"""Acceptance figures from per-step traces, with 95% intervals over prompts (standard library only).

A *trace* is what one prompt's speculative decoding produced: for every verification step the number of
draft tokens the target accepted (0 .. block_size - 1). The acceptance length of a step counts the bonus
token the target adds itself, so it is ``accepted + 1`` (the figure SGLang and the DFlash paper report);
a drafter whose every guess is wrong scores 1.0, a perfect one ``block_size``.

Intervals come from a seeded percentile bootstrap over prompts (steps of one prompt are not independent,
prompts are), so the same traces always give the same interval and a report does not change on re-run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def acceptance_length(traces: Sequence[Sequence[int]]) -> float | None:
    """Tokens committed per verification step over all prompts (a ratio of sums, as engines count it)."""
    steps = sum(len(t) for t in traces)
    if not steps:
        return None
    return sum(a + 1 for t in traces for a in t) / steps


def acceptance_by_position(traces: Sequence[Sequence[int]], block_size: int) -> list[float | None]:
    """For draft position k = 1 .. block_size - 1: the share of steps whose k-th draft token was accepted.

    Unconditional (not "given k-1 was accepted"), so the list falls with k and sums to the mean acceptance
    length minus the bonus token.
    """
    steps = [a for t in traces for a in t]
    if not steps:
        return [None] * (block_size - 1)
    return [sum(1 for a in steps if a >= k) / len(steps) for k in range(1, block_size)]


def bootstrap_ci(
    groups: Sequence[Any],
    statistic: Callable[[Sequence[Any]], float | None],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = 0.95,
) -> list[float] | None:
    """Percentile bootstrap interval of `statistic` over resampled `groups` (prompts), seeded.

    One group gives no spread to resample: the interval is then the point itself, which the report
    flags by the prompt count it prints beside it.
    """
    if not groups:
        return None
    rng = random.Random(seed)
    n = len(groups)
    values = []
    for _ in range(resamples):
        value = statistic([groups[rng.randrange(n)] for _ in range(n)])
        if value is not None:
            values.append(value)
    if not values:
        return None
    values.sort()
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    return [_quantile(values, lo_q), _quantile(values, hi_q)]


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def throughput(runs: Sequence[tuple[int, float]]) -> float | None:
    """Output tokens per second over (tokens, seconds) runs: total tokens over total time."""
    tokens = sum(t for t, _ in runs)
    seconds = sum(s for _, s in runs)
    return tokens / seconds if seconds > 0 else None


def speedup_ci(spec: Sequence[tuple[int, float]], plain: Sequence[tuple[int, float]]) -> list[float] | None:
    """Bootstrap interval of spec/plain throughput, pairing the two runs of each prompt."""
    pairs = list(zip(spec, plain, strict=True))

    def ratio(sample: Sequence[tuple[tuple[int, float], tuple[int, float]]]) -> float | None:
        s, p = throughput([x for x, _ in sample]), throughput([y for _, y in sample])
        return s / p if s and p else None

    return bootstrap_ci(pairs, ratio)


def summarize(traces: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    """The per-drafter block of report.json: mean acceptance length, its interval, by-position rates."""
    value = acceptance_length(traces)
    return {
        "acceptance_length": _round(value),
        "acceptance_length_ci95": _round_all(bootstrap_ci(list(traces), acceptance_length)),
        "acceptance_by_position": [_round(x) for x in acceptance_by_position(traces, block_size)],
        "steps": sum(len(t) for t in traces),
        "prompts": len(traces),
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _round_all(values: Sequence[float] | None, digits: int = 4) -> list[float] | None:
    return None if values is None else [round(v, digits) for v in values]
