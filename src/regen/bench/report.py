"""The layout sweep's report: `report.json`, `report.md` with its table, and three PNG plots.

`build_report` is pure (layout results + simulator estimates -> the report document); `render_markdown`
is pure text; `write_plots` draws with matplotlib's Agg backend (no display) and returns the file names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from regen.bench.stats import SLA_PERCENTILE, best_level, estimate_ratio, recommend

SCHEMA_VERSION = 1
PLOTS = {
    "throughput": "throughput.png",
    "latency": "latency.png",
    "estimate": "measured_vs_estimated.png",
}


def build_report(
    layouts: Sequence[Mapping[str, Any]],
    *,
    inputs: Mapping[str, Any],
    inputs_digest: str,
    max_ttft_ms: float | None = None,
    max_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The report document. `layouts`: one result per layout as `regen.jobs.sweep` wrote it (status
    measured / failed / infeasible), each with its `estimate` (the simulator's figures or why there are
    none). `inputs`: what the sweep measured with (model, request mix, concurrencies), recorded as is."""
    rows = []
    for layout in layouts:
        best = best_level(layout) if layout.get("status") == "measured" else None
        estimate = layout.get("estimate") or {}
        estimated = estimate.get("output_tokens_per_s")
        rows.append(
            {
                **dict(layout),
                "best": dict(best) if best else None,
                "measured_vs_estimated": estimate_ratio(
                    best["output_tokens_per_s"] if best else None, estimated
                ),
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "inputs_digest": inputs_digest,
        "inputs": dict(inputs),
        "objective": {
            "metric": "output_tokens_per_s",
            "sla_percentile": SLA_PERCENTILE,
            "max_ttft_ms": max_ttft_ms,
            "max_tpot_ms": max_tpot_ms,
        },
        "layouts": rows,
        "recommended": recommend(rows, max_ttft_ms=max_ttft_ms, max_tpot_ms=max_tpot_ms),
        "plots": dict(PLOTS),
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _settings_text(settings: Mapping[str, Any]) -> str:
    parts = []
    for key in sorted(settings):
        value = settings[key]
        if isinstance(value, Mapping):
            value = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        elif isinstance(value, list | tuple):
            value = " ".join(str(v) for v in value)
        parts.append(f"{key}={value}")
    return "; ".join(parts) or "(the plan's)"


def _estimate_text(estimate: Mapping[str, Any]) -> str:
    if estimate.get("output_tokens_per_s") is not None:
        return _fmt(float(estimate["output_tokens_per_s"]))
    return "—"


def render_markdown(report: Mapping[str, Any]) -> str:
    inputs = report.get("inputs") or {}
    lines = [
        "# Layout sweep",
        "",
        f"Model `{inputs.get('model')}` served by `{inputs.get('backend')}`; benchmark: "
        f"`{inputs.get('client')}`, {inputs.get('requests_per_level')} requests per level of "
        f"{inputs.get('max_tokens')} output tokens at most, concurrency "
        f"{', '.join(str(c) for c in inputs.get('concurrencies') or [])}.",
        "",
    ]
    rec = report.get("recommended") or {}
    if rec.get("layout"):
        lines += [
            f"**Recommended for the generate stage: `{rec['layout']}` at concurrency {rec['concurrency']}** "
            f"({_settings_text(rec.get('settings') or {})}): {rec['reason']}. The plan uses it unless "
            "the inventory overrides it.",
            "",
        ]
    else:
        lines += [f"**No recommendation**: {rec.get('reason')}.", ""]
    lines += [
        "| layout | settings | status | concurrency | output tok/s | TTFT p50 / p90 / p99 ms | "
        "TPOT p50 / p90 / p99 ms | simulator tok/s | measured / estimated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for layout in report.get("layouts") or []:
        name = f"`{layout['name']}`"
        settings = _settings_text(layout.get("settings") or {})
        estimate = layout.get("estimate") or {}
        if layout.get("status") != "measured":
            lines.append(
                f"| {name} | {settings} | {layout.get('status')} | — | — | — | — | "
                f"{_estimate_text(estimate)} | — |"
            )
            notes.append(f"- `{layout['name']}` {layout.get('status')}: {layout.get('reason')}")
            cause = (layout.get("diagnosis") or {}).get("summary")
            if cause:
                notes.append(f"  - log diagnosis: {cause}; {(layout.get('diagnosis') or {}).get('hint')}")
            continue
        for level in layout.get("levels") or []:
            best = layout.get("best") or {}
            is_best = best.get("concurrency") == level["concurrency"]
            ttft, tpot = level.get("ttft_ms") or {}, level.get("tpot_ms") or {}
            lines.append(
                f"| {name} | {settings} | measured"
                + (f" ({level['failed']} failed)" if level.get("failed") else "")
                + f" | {level['concurrency']} | {_fmt(level['output_tokens_per_s'])} | "
                f"{_fmt(ttft.get('p50'))} / {_fmt(ttft.get('p90'))} / {_fmt(ttft.get('p99'))} | "
                f"{_fmt(tpot.get('p50'))} / {_fmt(tpot.get('p90'))} / {_fmt(tpot.get('p99'))} | "
                + (
                    f"{_estimate_text(estimate)} | {_fmt(layout.get('measured_vs_estimated'), 2)} |"
                    if is_best
                    else "| |"
                )
            )
        if estimate and estimate.get("output_tokens_per_s") is None and estimate.get("reason"):
            notes.append(f"- `{layout['name']}` has no simulator estimate: {estimate['reason']}")
    if notes:
        lines += ["", *notes]
    plots = report.get("plots") or {}
    lines += ["", "## Plots", ""]
    for title, key in (
        ("Output throughput against concurrency", "throughput"),
        ("Latency percentiles", "latency"),
        ("Measured against the simulator's estimate", "estimate"),
    ):
        if key in plots:
            lines += [f"### {title}", "", f"![{title}]({plots[key]})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_plots(report: Mapping[str, Any], out_dir: Path) -> list[str]:
    """Draw the three plots into `out_dir`; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [lay for lay in report.get("layouts") or [] if lay.get("status") == "measured"]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for layout in measured:
        levels = sorted(layout.get("levels") or [], key=lambda lv: lv["concurrency"])
        ax.plot(
            [lv["concurrency"] for lv in levels],
            [lv["output_tokens_per_s"] for lv in levels],
            marker="o",
            label=layout["name"],
        )
    _concurrency_ticks(ax, measured)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput per layout")
    _finish(ax, measured, "no layout was measured")
    written.append(_save(fig, out_dir / PLOTS["throughput"]))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, metric, title in (
        (axes[0], "ttft_ms", "time to first token"),
        (axes[1], "tpot_ms", "time per output token"),
    ):
        for layout in measured:
            levels = sorted(layout.get("levels") or [], key=lambda lv: lv["concurrency"])
            xs = [lv["concurrency"] for lv in levels]
            for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ys = [(lv.get(metric) or {}).get(q) for lv in levels]
                if any(y is not None for y in ys):
                    ax.plot(
                        xs,
                        [y if y is not None else float("nan") for y in ys],
                        style,
                        marker=".",
                        label=f"{layout['name']} {q}",
                    )
        _concurrency_ticks(ax, measured)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.set_title(title)
        _finish(ax, measured, "no layout was measured")
    written.append(_save(fig, out_dir / PLOTS["latency"]))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [lay["name"] for lay in report.get("layouts") or []]
    measured_values = [
        ((lay.get("best") or {}).get("output_tokens_per_s") or 0.0) for lay in report.get("layouts") or []
    ]
    estimated_values = [
        ((lay.get("estimate") or {}).get("output_tokens_per_s") or 0.0) for lay in report.get("layouts") or []
    ]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], measured_values, width=0.4, label="measured (best level)")
    ax.bar([x + 0.2 for x in xs], estimated_values, width=0.4, label="simulator estimate")
    ax.set_xticks(xs, names, rotation=15)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Measured against estimated")
    if not any(estimated_values):
        reasons = {(lay.get("estimate") or {}).get("reason") for lay in report.get("layouts") or []}
        reason = next((r for r in reasons if r), "no estimate")
        ax.text(
            0.5,
            0.9,
            _wrap(f"no simulator estimate: {reason}"),
            transform=ax.transAxes,
            ha="center",
            va="top",
            fontsize=8,
        )
    ax.legend(fontsize=8)
    written.append(_save(fig, out_dir / PLOTS["estimate"]))
    plt.close("all")
    return written


def _wrap(text: str, width: int = 70) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _concurrency_ticks(ax, measured: Sequence[Any]) -> None:
    levels = sorted({lv["concurrency"] for lay in measured for lv in lay.get("levels") or []})
    if levels:
        ax.set_xticks(levels)


def _finish(ax, measured: Sequence[Any], empty_text: str) -> None:
    if measured:
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    else:
        ax.text(0.5, 0.5, empty_text, transform=ax.transAxes, ha="center")


def _save(fig, path: Path) -> str:
    # Written beside the final name and renamed, so a reader never sees half a PNG.
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    tmp.replace(path)
    return path.name
