"""Counters of a tokenize run, the stats report, and the length histogram as a picture."""

from __future__ import annotations

import io
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Reasons a well-formed conversation is left out by policy (the rest are bad input).
DROP_REASONS = ("too_long", "insufficient_supervision", "contains_mask_token", "special_token_in_content")

_COUNTERS = (
    "input_rows",
    "samples",
    "tokens",
    "supervised_tokens",
    "truncated",
    "unfinished",
    "assistant_turns",
    "supervised_turns",
    "reasoning_turns",
    "reasoning_rendered",
    "reasoning_synthesized",
    "reasoning_dropped",
    "special_in_content",
    "straddles",
    "trimmed_by_template",
)

BAR_COLOR = "#3b6ea8"  # the bars of the length histogram


@dataclass
class Stats:
    input_rows: int = 0
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0  # cut to --max-length
    unfinished: int = 0  # generation stopped at max_tokens: trained without an end-of-turn token
    assistant_turns: int = 0
    supervised_turns: int = 0
    reasoning_turns: int = 0
    reasoning_rendered: int = 0
    reasoning_synthesized: int = 0
    reasoning_dropped: int = 0
    special_in_content: int = 0  # kept samples whose messages hold a special-token string (encoded as text)
    straddles: int = 0
    trimmed_by_template: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> rows (bad input and policy drops)
    lengths: list[int] = field(default_factory=list)  # token length of every kept sample

    def add(self, other: Stats) -> None:
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected.update(other.rejected)
        self.lengths.extend(other.lengths)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        doc["rejected"] = dict(sorted(self.rejected.items()))
        doc["lengths"] = self.lengths
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Stats:
        out = cls(**{name: int(doc.get(name, 0)) for name in _COUNTERS})
        out.rejected = Counter({str(k): int(v) for k, v in doc.get("rejected", {}).items()})
        out.lengths = [int(x) for x in doc.get("lengths", [])]
        return out


def _quantile(ordered: list[int], q: float) -> int | None:
    if not ordered:
        return None
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def histogram(lengths: list[int], max_length: int | None, bins: int = 32) -> dict[str, list[int]]:
    """Equal-width bins from 0 to the longest sample (or --max-length when that is larger and set)."""
    top = max([*lengths, max_length or 0, 1])
    width = max(1, math.ceil(top / bins))
    edges = [i * width for i in range(bins + 1)]
    counts = [0] * bins
    for n in lengths:
        counts[min(n // width, bins - 1)] += 1
    return {"bin_edges": edges, "counts": counts}


def report(stats: Stats, *, config: dict[str, Any], mask_token: dict[str, Any] | None) -> dict[str, Any]:
    ordered = sorted(stats.lengths)
    dropped = {k: v for k, v in stats.rejected.items() if k in DROP_REASONS}
    rejected = {k: v for k, v in stats.rejected.items() if k not in DROP_REASONS}
    return {
        "schema": "regen.tokenize.stats/v1",
        "input_rows": stats.input_rows,
        "samples": stats.samples,
        "tokens": stats.tokens,
        "supervised_tokens": stats.supervised_tokens,
        "supervised_fraction": round(stats.supervised_tokens / stats.tokens, 6) if stats.tokens else 0.0,
        "truncated": stats.truncated,
        "unfinished_generations": stats.unfinished,
        "dropped": dict(sorted(dropped.items())),
        "dropped_total": sum(dropped.values()),
        "rejected": dict(sorted(rejected.items())),
        "rejected_total": sum(rejected.values()),
        "turns": {"assistant": stats.assistant_turns, "supervised": stats.supervised_turns},
        "reasoning": {
            "policy": config.get("reasoning"),
            "turns_with_reasoning": stats.reasoning_turns,
            "rendered_by_template": stats.reasoning_rendered,
            "placed_after_generation_prompt": stats.reasoning_synthesized,
            "not_trained": stats.reasoning_dropped,
        },
        "special_token_strings_in_content": stats.special_in_content,
        "mask_boundary_straddles": stats.straddles,
        "fields_trimmed_by_template": stats.trimmed_by_template,
        "length": {
            "min": ordered[0] if ordered else None,
            "max": ordered[-1] if ordered else None,
            "mean": round(sum(ordered) / len(ordered), 2) if ordered else None,
            "p50": _quantile(ordered, 0.5),
            "p90": _quantile(ordered, 0.9),
            "p99": _quantile(ordered, 0.99),
        },
        "histogram": histogram(stats.lengths, config.get("max_length")),
        "mask_token": mask_token,
        "config": config,
    }


# --------------------------------------------------------------------------------------------------
# The picture
# --------------------------------------------------------------------------------------------------


def histogram_png(doc: dict[str, Any]) -> bytes:
    """The length histogram of a `report` as a PNG, drawn by matplotlib (Agg, no display needed).

    The same report gives the same bytes (no timestamp or version in the metadata), so a re-run with
    nothing new changes nothing.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    hist = doc["histogram"]
    edges, counts = hist["bin_edges"], hist["counts"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        widths = [b - a for a, b in itertools.pairwise(edges)]
        ax.bar(
            edges[:-1], counts, width=widths, align="edge", color=BAR_COLOR, edgecolor="white", linewidth=0.5
        )
        max_length = (doc.get("config") or {}).get("max_length")
        if max_length:
            ax.axvline(
                max_length, color="#c0392b", linestyle="--", linewidth=1, label=f"--max-length {max_length}"
            )
            ax.legend(loc="upper right")
        length = doc["length"]
        ax.set_title(
            f"Sample length: {doc['samples']} samples, {doc['tokens']} tokens, "
            f"{doc['supervised_fraction']:.1%} supervised (p50 {length['p50']}, p99 {length['p99']})",
            fontsize=10,
        )
        ax.set_xlabel("tokens per sample")
        ax.set_ylabel("samples")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")  # labels kept whole
        return buf.getvalue()
    finally:
        plt.close(fig)
