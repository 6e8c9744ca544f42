"""report.json and report.md from the evaluation's per-prompt results, and the PNG plots beside them.

Pure functions build the documents (tested without torch); `draw_plots` needs matplotlib (Agg backend)
and is skipped, with a line in report.md saying so, on a venv that lacks it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .stats import bootstrap_ci, speedup_ci, summarize, throughput

DRAFTERS = ("trained", "untrained", "oracle")
TREE_NOT_MEASURED = "DDTree budgets were not scored in this run (--tree-budgets was empty)"
TREE_NOTE = (
    "Per verification step of the chain run, the acceptance length greedy verification of a DDTree of that "
    "many nodes (the likeliest prefixes of the drafter's per-slot distributions) would have reached in the "
    "same state. Acceptance only: the reference decoder has no tree-attention verifier, so no tokens/s; the "
    "pinned engine's DFLASH verifies the chain."
)
BATCH_NOT_MEASURED = (
    "not measured by the reference decoder: it decodes one request at a time, and a batch whose requests "
    "accept different draft lengths needs per-request KV caches the reference does not model; the GPU path "
    "(SGLang, continuous batching) is where the batch setting is measured"
)
STEPS_NOT_MEASURED = (
    "one checkpoint only: the train stage kept no earlier complete checkpoint of this run (or the drafter "
    "is not a train-stage export, or --training-steps was 0)"
)


def build_report(
    results: Sequence[dict[str, Any]],
    *,
    block_size: int,
    settings: dict[str, Any],
    inputs: dict[str, Any],
    step_rows: Sequence[dict[str, Any]] = (),
    exported_step: int | None = None,
    batch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report from one result per (drafter, prompt, turn kind).

    A result: {"drafter", "prompt_id", "turn_kind", "category", "accepted": [int...], "tokens", "seconds",
    "plain_tokens", "plain_seconds", "lossless": bool}. `step_rows`: the trained drafter at earlier
    checkpoints ({"step", "prompt_id", "turn_kind", "accepted", ...}), on the first turn kind's prompts.
    `batch`: the speedup at a batch setting where one was measured (the GPU path); else it says why not.
    """
    drafters: dict[str, Any] = {}
    for name in DRAFTERS:
        rows = [r for r in results if r["drafter"] == name]
        if not rows:
            continue
        block = _counted(summarize([r["accepted"] for r in rows], block_size), rows)
        block["lossless"] = all(r["lossless"] for r in rows)
        block["tokens_per_s"] = _round(throughput([(r["tokens"], r["seconds"]) for r in rows]))
        block["speedup"] = _speedup(rows)
        block["categories"] = _groups(rows, "category", block_size)
        block["turn_kinds"] = _groups(rows, "turn_kind", block_size)
        drafters[name] = block
    plain_rows = [r for r in results if r["drafter"] == "trained"] or list(results)
    trained = drafters.get("trained")
    return {
        "block_size": block_size,
        "drafters": drafters,
        "lossless": bool(results) and all(r["lossless"] for r in results),
        "plain_tokens_per_s": _round(
            throughput([(r["plain_tokens"], r["plain_seconds"]) for r in plain_rows])
        ),
        "speedup": {
            **trained["speedup"],
            "batch": batch if batch is not None else {"measured": False, "reason": BATCH_NOT_MEASURED},
        }
        if trained
        else None,
        "turn_kinds": sorted({r.get("turn_kind") or "default" for r in results}),
        "training_steps": _training_steps(results, step_rows, exported_step, block_size),
        "tree": _tree(results, block_size),
        "settings": settings,
        "inputs": inputs,
        "prompts": len({r["prompt_id"] for r in results}),
    }


def _tree(results: Sequence[dict[str, Any]], block_size: int) -> dict[str, Any]:
    budgets = sorted({int(b) for r in results for b in (r.get("tree") or {})})
    if not budgets:
        return {"measured": False, "reason": TREE_NOT_MEASURED}
    per_budget: dict[str, Any] = {}
    for budget in budgets:
        entry = {}
        for name in DRAFTERS:
            traces = [
                r["tree"][str(budget)]
                for r in results
                if r["drafter"] == name and str(budget) in (r.get("tree") or {})
            ]
            if traces:
                block = summarize(traces, block_size)
                entry[name] = {k: block[k] for k in ("acceptance_length", "acceptance_length_ci95", "steps")}
        per_budget[str(budget)] = entry
    return {"measured": True, "budgets": per_budget, "note": TREE_NOTE}


def _speedup(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    spec = [(r["tokens"], r["seconds"]) for r in rows]
    plain = [(r["plain_tokens"], r["plain_seconds"]) for r in rows]
    s, p = throughput(spec), throughput(plain)
    return {
        "value": _round(s / p) if s and p else None,
        "ci95": _round_all(speedup_ci(spec, plain)),
        "spec_tokens_per_s": _round(s),
        "plain_tokens_per_s": _round(p),
        "concurrency": 1,
    }


# The group of rows that carry no value of the grouping key (prompts without a category).
UNGROUPED = "(none)"


def _groups(rows: Sequence[dict[str, Any]], key: str, block_size: int) -> dict[str, Any]:
    """Figures per value of `key` (category: code/math/chat...; turn_kind: thinking/non-thinking)."""
    names = sorted({r[key] for r in rows if r.get(key)})
    out = {}
    for name in names:
        picked = [r for r in rows if r.get(key) == name]
        block = _counted(summarize([r["accepted"] for r in picked], block_size), picked)
        block["speedup"] = _speedup(picked)
        out[name] = block
    rest = [r for r in rows if not r.get(key)]
    if names and rest:  # rows without a value form a group of their own, so the groups add up
        block = _counted(summarize([r["accepted"] for r in rest], block_size), rest)
        block["speedup"] = _speedup(rest)
        out[UNGROUPED] = block
    return out


def _counted(block: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`prompts`: distinct prompts (a prompt measured in two turn kinds counts once, so the categories'
    prompts add up to the report's); `runs`: decodes measured (prompt x turn kind)."""
    block["runs"] = block.get("prompts")
    block["prompts"] = len({r["prompt_id"] for r in rows})
    return block


def _training_steps(
    results: Sequence[dict[str, Any]],
    step_rows: Sequence[dict[str, Any]],
    exported_step: int | None,
    block_size: int,
) -> dict[str, Any]:
    """Acceptance of the trained drafter at each kept checkpoint, on the same prompts and turn kind."""
    if not step_rows or exported_step is None:
        return {"measured": False, "reason": STEPS_NOT_MEASURED}
    kind = step_rows[0].get("turn_kind")
    final = [r for r in results if r["drafter"] == "trained" and r.get("turn_kind") == kind]
    by_step: dict[int, list[list[int]]] = {}
    for r in step_rows:
        by_step.setdefault(int(r["step"]), []).append(r["accepted"])
    by_step[int(exported_step)] = [r["accepted"] for r in final]
    points = []
    for step in sorted(by_step):
        block = summarize(by_step[step], block_size)
        points.append(
            {
                "step": step,
                "exported": step == exported_step,
                **{k: block[k] for k in ("acceptance_length", "acceptance_length_ci95", "steps", "prompts")},
            }
        )
    return {"measured": True, "turn_kind": kind, "points": points}


def headline(report: dict[str, Any]) -> str:
    """One line for the run summary and `regen status`."""
    parts = []
    for name in DRAFTERS:
        d = (report.get("drafters") or {}).get(name)
        if not d or d.get("acceptance_length") is None:
            continue
        ci = d.get("acceptance_length_ci95") or [None, None]
        parts.append(f"{name} {d['acceptance_length']:.2f} [{_fmt(ci[0])}, {_fmt(ci[1])}]")
    text = "acceptance length " + ", ".join(parts) if parts else "no acceptance measured"
    text += f" (block {report.get('block_size')}, {report.get('prompts', 0)} prompts)"
    speed = report.get("speedup") or {}
    if speed.get("value") is not None:
        text += f"; speedup {speed['value']:.2f}x at concurrency 1"
    batch = speed.get("batch") or {}
    if batch.get("measured") and batch.get("value") is not None:
        text += f", {batch['value']:.2f}x at concurrency {batch.get('concurrency')}"
    text += "; lossless" if report.get("lossless") else "; NOT lossless"
    check = report.get("lossless_check") or {}
    near = sum(int(c.get("near_tie", 0)) for c in (check.get("settings") or {}).values())
    if report.get("lossless") and near:
        text += f" ({near} output(s) differ only at a near tie: known nondeterminism)"
    return text


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _group_table(report: dict[str, Any], key: str, title: str, column: str) -> list[str]:
    """A table of every drafter's figures per group (category or turn kind), when there are groups."""
    drafters = report.get("drafters") or {}
    names = sorted({g for d in drafters.values() for g in (d.get(key) or {})})
    if not names:
        return []
    lines = [
        "",
        f"## {title}",
        "",
        f"| {column} | drafter | acceptance length | 95% interval | prompts | runs | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for drafter, d in drafters.items():
            g = (d.get(key) or {}).get(name)
            if not g:
                continue
            ci = g.get("acceptance_length_ci95") or [None, None]
            lines.append(
                f"| {name} | {drafter} | {_fmt(g.get('acceptance_length'))} | [{_fmt(ci[0])}, {_fmt(ci[1])}] "
                f"| {g.get('prompts')} | {g.get('runs')} | {_fmt((g.get('speedup') or {}).get('value'))} |"
            )
    return lines


def render_markdown(report: dict[str, Any], plots: Sequence[str], plot_note: str | None = None) -> str:
    lines = [
        "# Drafter evaluation",
        "",
        headline(report),
        "",
        "Acceptance length: tokens committed per target verification step, the bonus token included "
        f"(1.0 = every draft rejected, {report.get('block_size')} = the whole block accepted). Intervals: "
        "95% bootstrap over prompts.",
        "",
        "| drafter | acceptance length | 95% interval | steps | tokens/s | speedup | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, d in (report.get("drafters") or {}).items():
        ci = d.get("acceptance_length_ci95") or [None, None]
        sp = d.get("speedup") or {}
        cells = [
            name,
            _fmt(d.get("acceptance_length")),
            f"[{_fmt(ci[0])}, {_fmt(ci[1])}]",
            str(d.get("steps")),
            _fmt(d.get("tokens_per_s")),
            _fmt(sp.get("value")),
            "yes" if d.get("lossless") else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    batch = (report.get("speedup") or {}).get("batch") or {}
    if batch.get("measured"):
        batch_text = (
            f"Batch setting, concurrency {batch.get('concurrency')}: speedup {_fmt(batch.get('value'))} "
            f"({_fmt(batch.get('spec_tokens_per_s'))} tokens/s with the drafter, "
            f"{_fmt(batch.get('plain_tokens_per_s'))} without; acceptance length "
            f"{_fmt(batch.get('acceptance_length'))}); {batch.get('note', '')}."
        )
    else:
        batch_text = "Batch setting: " + (batch.get("reason") or "not measured") + "."
    lines += [
        "",
        f"Plain greedy decoding of the same target: {_fmt(report.get('plain_tokens_per_s'))} tokens/s "
        "(concurrency 1). " + batch_text,
        "",
    ]
    lines += _lossless_lines(report)
    lines += ["## Acceptance by position", "", "Share of steps whose k-th draft token was accepted.", ""]
    header = "| drafter | " + " | ".join(str(k) for k in range(1, int(report.get("block_size") or 1))) + " |"
    lines += [header, "|---" * (int(report.get("block_size") or 1)) + "|"]
    for name, d in (report.get("drafters") or {}).items():
        lines.append(
            f"| {name} | " + " | ".join(_fmt(x) for x in d.get("acceptance_by_position") or []) + " |"
        )
    lines += _group_table(report, "categories", "Per category", "category")
    lines += _group_table(report, "turn_kinds", "Per kind of turn (thinking switch)", "turn kind")
    steps = report.get("training_steps") or {}
    lines += ["", "## Acceptance against training step", ""]
    if steps.get("measured"):
        lines += [
            f"The trained drafter at each checkpoint the run kept, on the same prompts "
            f"({steps.get('turn_kind')} turns).",
            "",
            "| step | acceptance length | 95% interval |",
            "|---|---|---|",
        ]
        for point in steps["points"]:
            ci = point.get("acceptance_length_ci95") or [None, None]
            mark = " (exported)" if point.get("exported") else ""
            lines.append(
                f"| {point['step']}{mark} | {_fmt(point.get('acceptance_length'))} "
                f"| [{_fmt(ci[0])}, {_fmt(ci[1])}] |"
            )
    else:
        lines.append(steps.get("reason", STEPS_NOT_MEASURED))
    lines += ["", "## Tree verification (DDTree)", ""]
    tree = report.get("tree") or {}
    if tree.get("measured"):
        names = sorted({n for entry in tree["budgets"].values() for n in entry}, key=DRAFTERS.index)
        lines += ["| budget | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        chain = [_fmt(((report.get("drafters") or {}).get(n) or {}).get("acceptance_length")) for n in names]
        lines.append("| chain | " + " | ".join(chain) + " |")
        for budget, entry in tree["budgets"].items():
            cells = []
            for n in names:
                ci = (entry.get(n) or {}).get("acceptance_length_ci95") or [None, None]
                cells.append(
                    f"{_fmt((entry.get(n) or {}).get('acceptance_length'))} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
                )
            lines.append(f"| {budget} | " + " | ".join(cells) + " |")
        lines += ["", tree.get("note", ""), ""]
    else:
        lines += [tree.get("reason", ""), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if plot_note:
        lines += [plot_note, ""]
    s = report.get("settings") or {}
    if s.get("backend") == "sglang":
        servers = (report.get("inputs") or {}).get("servers") or {}
        lines += [
            "## Settings",
            "",
            "SGLang served the target alone (plain) and with the trained drafter (`--speculative-algorithm "
            f"DFLASH`), one after the other in the same layout; greedy, concurrency "
            f"{', '.join(str(c) for c in s.get('concurrencies') or [1])}, up to "
            f"{s.get('max_new_tokens')} new tokens per prompt through SGLang's native /generate; prompts "
            f"from {s.get('prompts_source')}. "
            "Acceptance comes from SGLang's own per-request metadata (spec_verify_ct, "
            "spec_correct_drafts_histogram).",
            "",
        ]
        for name, server in servers.items():
            if server.get("command_line"):
                lines += [f"- {name}: `{server['command_line']}`"]
        for note in s.get("notes") or []:
            lines += [f"- {note}"]
        lines.append("")
        return "\n".join(lines)
    lines += [
        "## Settings",
        "",
        f"Reference decoder on {s.get('device', 'cpu')} ({s.get('dtype')}), greedy, concurrency 1, up to "
        f"{s.get('max_new_tokens')} new tokens per prompt; prompts from {s.get('prompts_source')}.",
        "",
    ]
    return "\n".join(lines)


def _lossless_lines(report: dict[str, Any]) -> list[str]:
    """The token-for-token check of the GPU path, per setting, with every difference and its verdict."""
    check = report.get("lossless_check")
    if not check:
        return []
    lines = [
        "## Lossless check",
        "",
        f"{check.get('method', '')}. A near tie: the plain server's own two likeliest tokens at the first "
        f"diverging position are the two outputs' tokens, within {check.get('tie_tolerance')} nats (known "
        "numerical nondeterminism: the verify forward computes the same logits in another batch shape).",
        "",
        "| setting | identical | near tie | differs |",
        "|---|---|---|---|",
    ]
    for setting, c in (check.get("settings") or {}).items():
        lines.append(f"| {setting} | {c.get('identical')} | {c.get('near_tie')} | {c.get('differs')} |")
    differences = check.get("differences") or []
    if differences:
        lines += [
            "",
            "| setting | prompt | turn kind | position | plain | spec | verdict | why |",
            "|---" * 8 + "|",
        ]
        for d in differences[:50]:
            lines.append(
                f"| {d.get('setting')} | {d.get('prompt_id')} | {d.get('turn_kind')} | {d.get('position')} "
                f"| {d.get('plain_token')} | {d.get('spec_token')} | {d.get('verdict')} "
                f"| {d.get('reason', '')} |"
            )
    lines.append("")
    return lines


def draw_plots(report: dict[str, Any], output_dir: Path) -> tuple[list[Path], str | None]:
    """PNG plots (acceptance by position; speedup per category; acceptance against training step when the
    run kept several checkpoints). Returns (files, note when skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Plots skipped: matplotlib does not import in this venv (report.json holds every figure)."
    files = []
    drafters = report.get("drafters") or {}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, d in drafters.items():
        ys = d.get("acceptance_by_position") or []
        ax.plot(
            range(1, len(ys) + 1), [y if y is not None else float("nan") for y in ys], marker="o", label=name
        )
    ax.set_xlabel("position in block")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by position")
    ax.legend()
    files.append(_save(fig, output_dir / "acceptance_by_position.png"))
    plt.close(fig)
    cats = (drafters.get("trained") or {}).get("categories") or {}
    if cats:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(cats)
        ax.bar(names, [(cats[n].get("speedup") or {}).get("value") or 0 for n in names])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel("speedup (spec / plain tokens/s)")
        ax.set_title("Speedup per category (trained drafter)")
        files.append(_save(fig, output_dir / "speedup_by_category.png"))
        plt.close(fig)
    points = (report.get("training_steps") or {}).get("points") or []
    if len(points) >= 2:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [p["step"] for p in points]
        ys = [p["acceptance_length"] for p in points]
        cis = [p.get("acceptance_length_ci95") or [p["acceptance_length"]] * 2 for p in points]
        lo = [y - ci[0] for y, ci in zip(ys, cis, strict=True)]
        hi = [ci[1] - y for y, ci in zip(ys, cis, strict=True)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label="trained")
        untrained = (drafters.get("untrained") or {}).get("acceptance_length")
        if untrained is not None:
            ax.axhline(untrained, color="grey", linewidth=0.8, linestyle="--", label="untrained")
        ax.set_xlabel("training step")
        ax.set_ylabel("acceptance length")
        ax.set_title("Acceptance against training step")
        ax.legend()
        files.append(_save(fig, output_dir / "acceptance_by_step.png"))
        plt.close(fig)
    return files, None


def _save(fig: Any, path: Path) -> Path:
    from regen.fsio import atomic_write_bytes

    buf = io.BytesIO()
    # No timestamp or software tag: the same report draws the same bytes. A tight box keeps the axis labels
    # inside the picture (the default box cuts a long y label).
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None}, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _round_all(values: Sequence[float] | None, digits: int = 4) -> list[float] | None:
    return None if values is None else [round(v, digits) for v in values]


__all__ = ["DRAFTERS", "bootstrap_ci", "build_report", "draw_plots", "headline", "render_markdown"]
