"""The sweep's arithmetic: percentiles, one level's figures, bench_serving's record, the recommendation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from regen.bench.stats import (
    best_level,
    distribution_ms,
    estimate_ratio,
    level_from_bench_serving,
    percentile,
    recommend,
    summarize_level,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"


def test_percentile_interpolates_between_closest_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4: rank (n-1)q/100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentile_refuses_nan_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_distribution_is_in_milliseconds_and_skips_missing_values() -> None:
    dist = distribution_ms([0.1, 0.2, None, 0.3])
    assert dist == {"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0}
    assert distribution_ms([None]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _record(ttft: float, latency: float, tokens: int) -> dict:
    return {
        "ttft_s": ttft,
        "latency_s": latency,
        "output_tokens": tokens,
        "tpot_s": (latency - ttft) / (tokens - 1) if tokens > 1 else None,
    }


def test_level_throughput_is_total_output_over_wall_time() -> None:
    records = [_record(0.1, 1.1, 11), _record(0.3, 2.3, 21)]
    level = summarize_level(2, records, duration_s=2.5, failures=["HTTP 500: boom"])
    assert level["output_tokens"] == 32
    assert level["output_tokens_per_s"] == pytest.approx(12.8)
    assert (level["requests"], level["completed"], level["failed"]) == (3, 2, 1)
    assert level["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert level["tpot_ms"]["mean"] == pytest.approx(100.0)  # (1.0/10 + 2.0/20) / 2 s
    with pytest.raises(ValueError):
        summarize_level(1, records, duration_s=0)


def test_a_real_bench_serving_record_reads_as_a_level() -> None:
    record = json.loads((FIXTURES / "bench_serving_record.json").read_text())
    level = level_from_bench_serving(record)
    assert level["concurrency"] == 16 and level["completed"] == 300
    assert level["output_tokens_per_s"] == pytest.approx(3267.093)
    assert level["tpot_ms"]["p50"] == pytest.approx(4.83) and level["tpot_ms"]["p99"] == pytest.approx(5.82)
    assert level["tpot_ms"]["p90"] is None  # that release wrote no p90 keys
    assert level["e2e_ms"]["mean"] == pytest.approx(4760.2)
    with pytest.raises(ValueError, match="not a bench_serving result"):
        level_from_bench_serving({"completed": 1})


def _layout(name: str, *levels: tuple[int, float, int, float]) -> dict:
    return {
        "name": name,
        "status": "measured",
        "settings": {"tp_size": 8},
        "levels": [
            {
                "concurrency": c,
                "output_tokens_per_s": tps,
                "failed": failed,
                "completed": 4,
                "ttft_ms": {"p90": ttft},
                "tpot_ms": {"p90": 10.0},
            }
            for c, tps, failed, ttft in levels
        ],
    }


def test_recommend_takes_the_most_output_tokens_per_second() -> None:
    layouts = [
        _layout("plan", (1, 10.0, 0, 50.0), (8, 40.0, 0, 400.0)),
        _layout("tp4-dp2", (1, 12.0, 0, 40.0), (8, 55.0, 0, 900.0)),
    ]
    rec = recommend(layouts)
    assert (rec["layout"], rec["concurrency"], rec["output_tokens_per_s"]) == ("tp4-dp2", 8, 55.0)
    assert rec["settings"] == {"tp_size": 8}
    # With a TTFT limit the fast but slow-to-start level no longer counts.
    rec = recommend(layouts, max_ttft_ms=500)
    assert (rec["layout"], rec["concurrency"]) == ("plan", 8)
    assert "TTFT p90 <= 500 ms" in rec["reason"]


def test_recommend_skips_levels_with_failures_and_layouts_not_measured() -> None:
    layouts = [
        _layout("broken", (8, 99.0, 1, 10.0)),
        {"name": "dead", "status": "failed", "levels": []},
        _layout("plan", (1, 5.0, 0, 10.0)),
    ]
    assert recommend(layouts)["layout"] == "plan"
    none = recommend([layouts[0], layouts[1]])
    assert none["layout"] is None and "broken@8: 1 failed" in none["reason"]
    assert recommend([])["reason"] == "no layout was measured"


def test_ties_go_to_lower_concurrency_then_the_earlier_layout() -> None:
    layouts = [_layout("plan", (4, 20.0, 0, 1.0), (2, 20.0, 0, 1.0)), _layout("other", (1, 20.0, 0, 1.0))]
    rec = recommend(layouts)
    assert (rec["layout"], rec["concurrency"]) == ("other", 1)
    rec = recommend([_layout("plan", (2, 20.0, 0, 1.0)), _layout("other", (2, 20.0, 0, 1.0))])
    assert rec["layout"] == "plan"


def test_best_level_and_estimate_ratio() -> None:
    layout = _layout("plan", (1, 10.0, 0, 1.0), (8, 30.0, 2, 1.0), (4, 20.0, 0, 1.0))
    assert best_level(layout)["concurrency"] == 4
    assert estimate_ratio(20.0, 40.0) == 0.5
    assert estimate_ratio(20.0, None) is None and estimate_ratio(None, 3.0) is None
