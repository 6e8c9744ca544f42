"""A readable end-of-run summary built from the run's artifacts.

Every stage leaves a JSON record in the artifacts directory on the controller (facts, serving launch,
generation status, tokenize stats, training status), where `regen.records` says. This module turns
whichever of them exist into a short table, so `make regen` ends with what was produced rather than
only Ansible's task counts. A missing or unreadable record is reported as such, never as a crash: the
summary must not fail a run.

    python -m regen.summary --artifacts artifacts
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from regen import provenance, records
from regen.fsio import read_json_object

Record = dict[str, Any]


def _load(path: Path) -> Record | None:
    return read_json_object(path)


def model_lines(facts: Record) -> list[tuple[str, str]]:
    arch = facts.get("architecture") or {}
    moe = arch.get("moe")
    attention = (arch.get("attention") or {}).get("kind", "?")
    shape = (
        f"{arch.get('model_type')} / {arch.get('text_model_type')}: {arch.get('num_layers')} layers, "
        f"hidden {arch.get('hidden_size')}, vocab {arch.get('vocab_size')}, {attention.upper()} attention"
    )
    if moe:
        shape += (
            f", MoE {moe.get('routed_experts')} experts top-{moe.get('experts_per_token')}"
            f" (+{moe.get('shared_experts')} shared, {moe.get('dense_prefix_layers')} dense prefix)"
        )
    tokenizer = facts.get("tokenizer") or {}
    load = tokenizer.get("load") or {}
    how = f"loaded with {tokenizer.get('loaded_with')}"
    if tokenizer.get("available") is False:
        how = f"unknown ({(tokenizer.get('unavailable') or {}).get('reason')})"
    elif load.get("remedy"):
        how += f" (library failed: {load['remedy']})"
    # plan_values: the plan model_plan_info unwrapped once (module_utils/regen_plan.plan_values).
    values = facts.get("plan_values")
    if not isinstance(values, dict):
        return [
            ("model", shape),
            ("tokenizer", how),
            ("plan", "the facts file has no plan_values: re-run the introspect stage (--tags introspect)"),
        ]
    serving, drafter = values.get("serving") or {}, values.get("drafter") or {}
    generation = values.get("generation") or {}
    plan = facts.get("plan") if isinstance(facts.get("plan"), dict) else {}

    def shown(section: str, key: str, value: Any) -> str:
        # An unknown entry's null is not "none": say unknown.
        entry = (plan.get(section) or {}).get(key)
        return "unknown" if isinstance(entry, dict) and entry.get("unknown") is True else repr(value)

    rows = [
        ("model", shape),
        ("tokenizer", f"{how}; thinking switch "
                      f"{shown('generation', 'thinking_switch', generation.get('thinking_switch'))}"),
        (
            "plan",
            f"serve tp={serving.get('tp_size')} ep={serving.get('ep_size')} on {serving.get('device')}; "
            f"drafter layers {drafter.get('target_layer_ids')}, block {drafter.get('block_size')}, "
            f"mask id {shown('drafter', 'mask_token_id', drafter.get('mask_token_id'))}",
        ),
        *warning_lines(facts),
    ]
    length = values.get("length") or {}
    if length.get("budget"):
        method = (length.get("prompt_set") or {}).get("method")
        how = {"tokens": "counted", "utf8_bytes": "bounded by its bytes", "assumed": "assumed"}
        how = how.get(method, "?")
        rows.append((
            "budget",
            f"{length['budget']} tokens per sequence (longest prompt {length.get('prompt_tokens')} tokens, "
            f"{how}; max_tokens {length.get('max_tokens')} per turn); "
            f"{generation.get('concurrency')} requests in flight",
        ))
    # The run estimate (module_utils/regen_estimate.py), with its arithmetic, as the plan recorded it.
    run = ((plan.get("estimate") or {}).get("run") or {}) if isinstance(plan.get("estimate"), dict) else {}
    if isinstance(run, dict) and run.get("reason"):
        for part in str(run["reason"]).split("; disk, "):
            rows.append(("estimate", part))
    return rows


def warning_lines(facts: Record) -> list[tuple[str, str]]:
    """The facts' warnings a run must not bury: a tokenizer vocabulary that disagrees with the config's
    vocab_size beyond padding, and the plan's own (a mask id outside the embedding table, unknown parts)."""
    rows = []
    vocab = (facts.get("tokenizer") or {}).get("vocab") or {}
    if vocab.get("disagreement"):
        rows.append(("warning", f"vocabulary: {vocab['disagreement']}"))
    plan = facts.get("plan") if isinstance(facts.get("plan"), dict) else {}
    rows.extend(("warning", str(text)) for text in plan.get("warnings") or [])
    return rows


def serving_lines(
    launches: list[tuple[str, Record]], states: dict[str, Record] | None = None
) -> list[tuple[str, str]]:
    """One row per server; `states` (name -> state.json) says whether it was last seen running or stopped."""
    rows = []
    for name, launch in launches:
        state = ((states or {}).get(name) or {}).get("state")
        rows.append(
            (
                "serve",
                f"{name}: {launch.get('endpoint')} ({launch.get('backend')}, {launch.get('mode')} mode)"
                + (f", {state}" if state else ""),
            )
        )
    return rows


def generation_lines(statuses: list[tuple[str, Record]]) -> list[tuple[str, str]]:
    lines = []
    for name, status in statuses:
        p50 = status.get("latency_p50_s")
        latency = f", p50 {p50:.2f} s" if isinstance(p50, int | float) else ""
        lines.append(
            (
                "generate",
                f"{name}: {status.get('done')} done, {status.get('failed')} failed, "
                f"{status.get('truncated', 0)} hit max_tokens, tokens in/out "
                f"{status.get('tokens_in')}/{status.get('tokens')}{latency}"
                f" -> {status.get('output_dir')}",
            )
        )
    return lines


def tokenize_lines(stats: Record, histogram: Path | None) -> list[tuple[str, str]]:
    fraction = stats.get("supervised_fraction")
    share = f"{fraction:.1%} supervised" if isinstance(fraction, int | float) else "supervision unknown"
    text = (
        f"{stats.get('samples')} samples, {stats.get('tokens')} tokens, {share}, "
        f"{stats.get('dropped_total', 0)} dropped, {stats.get('rejected_total', 0)} rejected"
    )
    if histogram is not None:
        text += f"; histogram {histogram}"
    return [("tokenize", text)]


def exported_drafter(run_dir: Path) -> str | None:
    """The exported drafter's directory, as the SGLang flags the train stage recorded name it."""
    try:
        args = (run_dir / "sglang_dflash.args").read_text(encoding="utf-8").split()
    except OSError:
        return None
    flag = "--speculative-draft-model-path"
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def draw_loss_curve(curve: list, smoothing_steps: int, path: Path) -> Path | None:
    """The training loss against step (each step's and its moving average) as a PNG at `path`, rewritten
    only when its bytes change (a re-run stays changed=0); None without matplotlib or points to draw."""
    points = [(p[0], p[1]) for p in curve if isinstance(p, list | tuple) and len(p) == 2]
    if len(points) < 2:
        return None
    try:
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps, losses = zip(*points, strict=True)
    beta, raw, smoothed = 1.0 - 2.0 / (smoothing_steps + 1), 0.0, []
    for k, loss in enumerate(losses, start=1):
        raw = beta * raw + (1.0 - beta) * loss
        smoothed.append(raw / (1.0 - beta**k))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, color="lightgrey", linewidth=0.8, label="loss per step")
    ax.plot(steps, smoothed, linewidth=1.6, label=f"moving average (~{smoothing_steps} points)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Drafter training loss")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    try:
        if path.read_bytes() == data:
            return path
    except OSError:
        pass
    from regen.fsio import atomic_write_bytes

    atomic_write_bytes(path, data)
    return path


def training_lines(
    statuses: list[tuple[str, Record]], artifacts: Path | None = None
) -> list[tuple[str, str]]:
    lines = []
    for name, status in statuses:
        text = f"{name}: {status.get('state')}, step {status.get('done')}/{status.get('total')}"
        if isinstance(status.get("loss"), int | float):
            text += f", loss {status['loss']:.4f}"
        if isinstance(status.get("loss_smoothed"), int | float):
            steps = status.get("loss_smoothing_steps")
            text += f" (moving average over ~{steps} steps {status['loss_smoothed']:.4f})"
        if status.get("error"):
            text += f", error: {status['error']}"
        lines.append(("train", text))
        if artifacts is None:
            continue
        run_dir = artifacts / "drafter" / name
        drafter = exported_drafter(run_dir)
        if drafter:
            lines.append(("train", f"{name}: exported drafter {drafter}"))
        curve = status.get("loss_curve")
        if isinstance(curve, list) and run_dir.is_dir():
            steps = int(status.get("loss_smoothing_steps") or 20)
            picture = draw_loss_curve(curve, steps, run_dir / "loss_curve.png")
            if picture is not None:
                lines.append(("train", f"{name}: loss curve {picture}"))
    return lines


def evaluation_lines(report: Record) -> list[tuple[str, str]]:
    from regen.evaluate.report import headline

    return [("evaluate", headline(report))]


def _named(paths: list[Path]) -> list[tuple[str, Record]]:
    found = []
    for path in sorted(paths):
        record = _load(path)
        if record is not None:
            name = path.parent.name if path.stem in ("launch", "state", "status") else path.stem
            found.append((name.removeprefix("status-"), record))
    return found


def collect(artifacts: Path) -> list[tuple[str, str]]:
    """Summary rows (stage, text) for whatever the artifacts directory holds."""
    rows: list[tuple[str, str]] = []
    sections: list[tuple[str, Callable[[], list[tuple[str, str]]]]] = []
    facts = _load(artifacts / records.FACTS)
    if facts is not None:
        sections.append(("introspect", lambda: model_lines(facts)))
    launches = _named(records.find(artifacts, records.SERVING_LAUNCHES))
    if launches:
        states = {name: record for name, record in _named(records.find(artifacts, records.SERVING_STATES))}
        sections.append(("serve", lambda: serving_lines(launches, states)))
    statuses = _named(records.find(artifacts, records.GENERATION_STATUSES))
    if statuses:
        sections.append(("generate", lambda: generation_lines(statuses)))
    stats = _load(artifacts / records.TOKENIZE_STATS)
    if stats is not None:
        picture = artifacts / records.TOKENIZE_HISTOGRAM
        sections.append(("tokenize", lambda: tokenize_lines(stats, picture if picture.exists() else None)))
    training = _named(records.find(artifacts, records.TRAINING_STATUSES))
    if training:
        sections.append(("train", lambda: training_lines(training, artifacts)))
    evaluation = _load(artifacts / records.EVALUATION_REPORT)
    if evaluation is not None:
        sections.append(("evaluate", lambda: evaluation_lines(evaluation)))
    runs = provenance.run_dirs(artifacts)
    if runs:
        # The id of this run as `regen status` lists it (the history callback exports it), and the manifest
        # it recorded (a re-run that changed nothing keeps the last one): `regen compare` takes either.
        run_id = os.environ.get("REGEN_RUN_ID")
        line = (
            f"{run_id}, manifest {runs[-1].name} (regen status {run_id}; regen compare {run_id})"
            if run_id
            else f"{runs[-1].name} (regen compare: what changed since a run before)"
        )
        sections.append(("run", lambda: [("run", line)]))
    for stage, build in sections:
        try:
            rows.extend(build())
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            rows.append((stage, f"record unreadable ({error.__class__.__name__}: {error})"))
    return rows


def render(rows: list[tuple[str, str]], artifacts: Path) -> str:
    if not rows:
        return f"regen: no stage has recorded anything in {artifacts} yet"
    width = max(len(stage) for stage, _ in rows)
    body = "\n".join(f"  {stage:<{width}}  {text}" for stage, text in rows)
    return f"regen summary (artifacts in {artifacts})\n{body}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regen.summary", description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True, help="the run's artifacts directory")
    args = parser.parse_args(argv)
    print(render(collect(args.artifacts), args.artifacts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
