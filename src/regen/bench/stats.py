"""Pure arithmetic of the layout sweep: percentiles, one concurrency level's figures, the recommendation.

No I/O and standard library only, so every number in `artifacts/sweep/report.json` can be checked by a
unit test against a hand computation. Times are seconds in the request records and milliseconds in the
summaries (the unit SGLang's `bench_serving` reports, so the two clients' levels read the same).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)
# A level is judged on its 90th percentiles: the median hides the slow tail a generation run waits on,
# and with the few requests of a sweep level the 99th is one request.
SLA_PERCENTILE = 90


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    None for no values; NaN values are refused, so a broken measurement never averages in silently.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    data = sorted(float(v) for v in values)
    if any(math.isnan(v) for v in data):
        raise ValueError("a NaN among the values: a request was timed wrongly")
    if not data:
        return None
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return data[low]
    return data[low] + (data[high] - data[low]) * (rank - low)


def distribution_ms(values_s: Iterable[float | None]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds of the non-None values (seconds in), rounded to 0.01 ms."""
    values = [v * 1000.0 for v in values_s if v is not None]
    out: dict[str, float | None] = {"mean": round(sum(values) / len(values), 2) if values else None}
    for q in PERCENTILES:
        value = percentile(values, q)
        out[f"p{q}"] = round(value, 2) if value is not None else None
    return out


def summarize_level(
    concurrency: int, records: Sequence[Mapping[str, Any]], duration_s: float, failures: Sequence[str] = ()
) -> dict[str, Any]:
    """One concurrency level: throughput over the level's wall time and the latency distributions.

    `records`: the completed requests (`ttft_s`, `tpot_s`, `latency_s`, `output_tokens`); `failures`: the
    reasons of the requests that did not complete. Output tokens/s is the level's total output divided
    by its wall time, the figure a generation run at this concurrency would see.
    """
    if duration_s <= 0:
        raise ValueError(f"a level's duration must be positive, got {duration_s}")
    output_tokens = sum(int(r["output_tokens"]) for r in records)
    return {
        "concurrency": int(concurrency),
        "requests": len(records) + len(failures),
        "completed": len(records),
        "failed": len(failures),
        "failures": sorted(set(failures))[:5],
        "duration_s": round(duration_s, 4),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / duration_s, 3),
        "request_throughput": round(len(records) / duration_s, 4),
        "ttft_ms": distribution_ms(r.get("ttft_s") for r in records),
        "tpot_ms": distribution_ms(r.get("tpot_s") for r in records),
        "e2e_ms": distribution_ms(r.get("latency_s") for r in records),
    }


def level_from_bench_serving(result: Mapping[str, Any]) -> dict[str, Any]:
    """One level in the sweep's shape from one JSONL record of SGLang's `sglang.benchmark.serving`.

    bench_serving reports mean/median/p90/p95/p99 per metric in ms (`median_ttft_ms`, `p99_tpot_ms`, ...),
    `output_throughput` in tokens/s and `max_concurrency`; its median is the p50 here.
    """
    missing = [
        key for key in ("max_concurrency", "completed", "duration", "output_throughput") if key not in result
    ]
    if missing:
        raise ValueError(f"not a bench_serving result record: no {', '.join(missing)}")

    def dist(metric: str) -> dict[str, float | None]:
        def get(key: str) -> float | None:
            value = result.get(key)
            return round(float(value), 2) if isinstance(value, int | float) else None

        return {
            "mean": get(f"mean_{metric}_ms"),
            "p50": get(f"median_{metric}_ms"),
            "p90": get(f"p90_{metric}_ms"),
            "p99": get(f"p99_{metric}_ms"),
        }

    completed = int(result["completed"])
    requests = int(result.get("num_prompts") or completed)
    return {
        "concurrency": int(result["max_concurrency"]),
        "requests": requests,
        "completed": completed,
        "failed": max(0, requests - completed),
        "failures": [],
        "duration_s": round(float(result["duration"]), 4),
        "output_tokens": int(result.get("total_output_tokens") or 0),
        "output_tokens_per_s": round(float(result["output_throughput"]), 3),
        "request_throughput": round(float(result.get("request_throughput") or 0.0), 4),
        "ttft_ms": dist("ttft"),
        "tpot_ms": dist("tpot"),
        "e2e_ms": dist("e2e_latency"),
    }


def _within(level: Mapping[str, Any], max_ttft_ms: float | None, max_tpot_ms: float | None) -> str | None:
    """Why a level misses the latency limits (at SLA_PERCENTILE), or None when it meets them."""
    key = f"p{SLA_PERCENTILE}"
    ttft = (level.get("ttft_ms") or {}).get(key)
    tpot = (level.get("tpot_ms") or {}).get(key)
    if max_ttft_ms is not None and (ttft is None or ttft > max_ttft_ms):
        return f"TTFT {key} {ttft} ms > {max_ttft_ms:g} ms"
    if max_tpot_ms is not None and tpot is not None and tpot > max_tpot_ms:
        return f"TPOT {key} {tpot} ms > {max_tpot_ms:g} ms"
    return None


def recommend(
    layouts: Sequence[Mapping[str, Any]],
    *,
    max_ttft_ms: float | None = None,
    max_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The layout and concurrency the generate stage should use: the most output tokens/s.

    Only measured levels in which every request completed count, and, when limits are given, only those
    whose p90 TTFT/TPOT meet them. Ties go to the lower concurrency (the same throughput with less KV in
    flight), then to the earlier layout in the list (the plan's choice comes first). Returns
    `{"layout", "settings", "concurrency", "output_tokens_per_s", "reason"}`, or `{"layout": None,
    "reason"}` when nothing qualifies.
    """
    best: tuple[float, int, int] | None = None
    chosen = None
    rejected: list[str] = []
    for index, layout in enumerate(layouts):
        if layout.get("status") != "measured":
            continue
        for level in layout.get("levels") or []:
            if level.get("failed") or not level.get("completed"):
                rejected.append(f"{layout['name']}@{level.get('concurrency')}: {level.get('failed')} failed")
                continue
            miss = _within(level, max_ttft_ms, max_tpot_ms)
            if miss:
                rejected.append(f"{layout['name']}@{level['concurrency']}: {miss}")
                continue
            key = (float(level["output_tokens_per_s"]), -int(level["concurrency"]), -index)
            if best is None or key > best:
                best, chosen = key, (layout, level)
    if chosen is None:
        measured = sum(1 for layout in layouts if layout.get("status") == "measured")
        why = "no layout was measured" if not measured else "no measured level qualifies"
        if rejected:
            why += " (" + "; ".join(rejected[:6]) + ")"
        return {"layout": None, "reason": why}
    layout, level = chosen
    limits = []
    if max_ttft_ms is not None:
        limits.append(f"TTFT p{SLA_PERCENTILE} <= {max_ttft_ms:g} ms")
    if max_tpot_ms is not None:
        limits.append(f"TPOT p{SLA_PERCENTILE} <= {max_tpot_ms:g} ms")
    others = sum(len(item.get("levels") or []) for item in layouts if item.get("status") == "measured")
    reason = (
        f"the most output tokens/s ({level['output_tokens_per_s']:g}) of {others} measured level(s)"
        + (f" within {' and '.join(limits)}" if limits else "")
        + f", at concurrency {level['concurrency']}"
    )
    return {
        "layout": layout["name"],
        "settings": dict(layout.get("settings") or {}),
        "concurrency": int(level["concurrency"]),
        "output_tokens_per_s": level["output_tokens_per_s"],
        "reason": reason,
    }


def best_level(layout: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The level of one layout with the most output tokens/s among those where every request completed."""
    levels = [lv for lv in layout.get("levels") or [] if lv.get("completed") and not lv.get("failed")]
    return max(levels, key=lambda lv: (lv["output_tokens_per_s"], -lv["concurrency"]), default=None)


def estimate_ratio(measured: float | None, estimated: float | None) -> float | None:
    """measured / estimated, the simulator's accuracy on this host (None when either is missing)."""
    if not measured or not estimated:
        return None
    return round(measured / estimated, 3)
