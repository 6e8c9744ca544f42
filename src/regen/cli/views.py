"""What `regen` prints: tables, trees, the live and plain views of a run, the run summary."""

from __future__ import annotations

import json
import os
import queue
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from regen.jobs.eta import fmt_eta
from regen.runner import (
    Event,
    ExitCode,
    JobProgress,
    NoHostsMatched,
    Output,
    RunHandle,
    RunResult,
    StageFinished,
    StageStarted,
    TaskResult,
    TaskRetry,
    TaskStarted,
    TaskStatus,
)


def make_console(*, stderr: bool = False) -> Console:
    """A console; when output goes to a file or pipe (a log), 120 columns unless $COLUMNS says otherwise."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=120)
    return console


_STATUS_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "bold red",
    "canceled": "magenta",
    "no hosts": "dim",
    "not run": "dim",
    "running": "cyan",
    "done": "green",
    "would change": "yellow",
    "would fail": "bold red",
    "blocked": "red",
    "not reached": "dim",
    "not checked": "dim",
    "successful": "green",
    "timeout": "red",
    "error": "bold red",
}
_RESULT_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "bold red",
    "skipped": "cyan",
    "unreachable": "bold red",
}


def styled(status: str) -> Text:
    return Text(status, style=_STATUS_STYLE.get(status, ""))


def _fmt_num(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s"


def _iso_seconds(a: str | None, b: str | None) -> float | None:
    from datetime import datetime

    try:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds() if a and b else None
    except ValueError:
        return None


def when(iso: str | None) -> str:
    from datetime import datetime

    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%m-%d %H:%M:%S")
    except ValueError:
        return iso


def stage_table(result: RunResult) -> Table:
    table = Table(title="stages", title_justify="left", show_edge=False, pad_edge=False)
    columns = (
        "stage",
        "status",
        "ok",
        "changed",
        "failed",
        "skipped",
        "unreachable",
        "rescued",
        "ignored",
        "time",
    )
    for column in columns:
        table.add_column(column, justify="right" if column not in ("stage", "status") else "left")
    for stage in result.stages:
        c = stage.counts
        counts = (c.ok, c.changed, c.failed, c.skipped, c.unreachable, c.rescued, c.ignored)
        table.add_row(
            stage.name,
            styled(stage.status),
            *(str(n) for n in counts),
            _duration(_iso_seconds(stage.started, stage.finished)),
        )
    return table


def host_table(result: RunResult) -> Table:
    table = Table(title="hosts (PLAY RECAP)", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("host", "ok", "changed", "failed", "unreachable", "skipped", "rescued", "ignored"):
        table.add_column(column, justify="left" if column == "host" else "right")
    for host, s in sorted(result.hosts.items()):
        table.add_row(
            host,
            *(str(v) for v in (s.ok, s.changed, s.failed, s.unreachable, s.skipped, s.rescued, s.ignored)),
        )
    return table


def stages_that_ran(result: RunResult) -> str:
    """Which stages ran: all of them, or (a run narrowed by --tags or a stage list) those that ran and those
    that did not, so `regen run --tags X` never reads as a whole run."""
    def ran_tasks(stage: Any) -> bool:  # a play --tags left without a task starts and ends, running nothing
        return any(vars(stage.counts).values()) or stage.status in ("failed", "canceled")

    ran = [s.name for s in result.stages if s.status not in ("not run", "no hosts") and ran_tasks(s)]
    idle = [s.name for s in result.stages if s.status != "no hosts" and s.name not in ran]
    tags = f" (--tags {','.join(result.tags)})" if result.tags else ""
    if not idle:
        return f"stages ran: {', '.join(ran)}{tags}" if tags else "all stages ran"
    return f"stages ran: {', '.join(ran) or 'none'}; not run: {', '.join(idle)}{tags}"


def exit_line(result: RunResult) -> Text:
    code = result.exit_code
    if code is ExitCode.OK:
        what = "check mode: nothing was changed" if result.check else stages_that_ran(result)
    elif code is ExitCode.CANCELED:
        what = "canceled"
    elif code in (ExitCode.TASK_FAILED, ExitCode.UNREACHABLE) and result.failed_task:
        f = result.failed_task
        what = f"{'host unreachable' if f.unreachable else 'task failed'} in stage {f.stage or '?'}"
    else:
        what = result.error.splitlines()[0] if result.error else result.status
    style = "bold green" if code is ExitCode.OK else "bold red"
    return Text(f"regen: exit {int(code)} ({code.name.lower()}): {what}", style=style)


def print_summary(console: Console, result: RunResult) -> None:
    console.print()
    if result.stages:
        console.print(stage_table(result))
    if result.hosts:
        console.print(host_table(result))
    for failure in result.failures:
        label = "UNREACHABLE" if failure.unreachable else "FAILED"
        console.print(
            Text(
                f"{label}: stage {failure.stage} · task {failure.task!r} · host {failure.host}",
                style="bold red",
            )
        )
        if failure.path:
            console.print(Text(f"  at {failure.path}", style="dim"))
        for line in (failure.message or "(no message)").splitlines():
            console.print(Text(f"  {line}"))
    if result.error and not result.failures:
        console.print(Text("error:", style="bold red"))
        for line in result.error.splitlines()[-15:]:
            console.print(Text(f"  {line}"))
    for warning in result.warnings:
        console.print(Text(f"note: {warning}", style="yellow"))
    artifacts = result.artifacts
    listed = [
        (name, getattr(artifacts, name))
        for name in ("facts", "environment_manifests", "completions", "tokenized", "checkpoints")
    ]
    if any(paths for _, paths in listed):
        console.print(Text("artifacts:", style="bold"))
        for name, paths in listed:
            if paths:
                shown = ", ".join(str(p) for p in paths[:3]) + (
                    f" (+{len(paths) - 3} more)" if len(paths) > 3 else ""
                )
                console.print(Text(f"  {name.replace('_', ' ')}: {shown}"))
    for line in evaluation_headlines(artifacts.roots):
        console.print(Text(line, style="bold"))
    if result.artifact_dir:
        console.print(Text(f"run record: {result.artifact_dir}", style="dim"))
    console.print(exit_line(result))


def evaluation_headlines(roots: Sequence[Path]) -> list[str]:
    """The evaluate stage's headline from each artifacts directory that holds a report."""
    from regen import records
    from regen.evaluate.report import headline
    from regen.fsio import read_json_object

    lines = []
    for root in roots:
        report = read_json_object(Path(root) / records.EVALUATION_REPORT)
        if report is not None:
            try:
                lines.append(f"evaluation: {headline(report)}")
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                lines.append(f"evaluation: report unreadable ({exc.__class__.__name__}: {exc})")
    return lines


class LiveView:
    """State of a run as the events arrive: stages, the current task, one progress bar per job."""

    def __init__(self, stages: Sequence[str], title: str) -> None:
        self.title = title
        self.stage_state: dict[str, str] = dict.fromkeys(stages, "pending")
        self.stage_counts: dict[str, str] = {}
        self.current_task: str | None = None
        self.task_started = 0.0
        self.retry: str | None = None
        self.progress = Progress(
            TextColumn("  {task.description}"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            auto_refresh=False,
        )
        self._jobs: dict[tuple[str, str], TaskID] = {}
        self.notes: dict[str, Text] = {}
        self.shown: list[Text] = []  # "Show ..." task messages, printed above the live view

    def handle(self, event: Event) -> None:
        if isinstance(event, StageStarted):
            self.stage_state[event.stage] = "running"
        elif isinstance(event, StageFinished):
            c = event.counts
            self.stage_state[event.stage] = "failed" if event.failed else ("changed" if c.changed else "ok")
            self.stage_counts[event.stage] = (
                f"ok={c.ok} changed={c.changed} failed={c.failed} skipped={c.skipped}"
            )
            self.current_task = None
        elif isinstance(event, NoHostsMatched) and event.stage:
            self.stage_counts[event.stage] = "no hosts matched"
        elif isinstance(event, TaskStarted):
            self.current_task = f"{event.role + ' : ' if event.role else ''}{event.task}"
            self.task_started = time.monotonic()
            self.retry = None
        elif isinstance(event, TaskRetry):
            self.retry = (
                f"attempt {event.attempt}/{event.retries}" if event.retries else f"attempt {event.attempt}"
            )
        elif isinstance(event, TaskResult):
            if event.status in (TaskStatus.OK, TaskStatus.CHANGED) and event.message:
                self.shown.append(
                    Text("\n".join([f"{event.host} · {event.task}:"] + [
                        f"  {line}" for line in event.message.splitlines()[:SHOWN_LINES]
                    ]))
                )  # fmt: skip
            # A host that goes on after a failure had it rescued: its note goes away.
            self.notes.pop(event.host, None)
            if event.status in (TaskStatus.FAILED, TaskStatus.UNREACHABLE) and not event.ignored:
                first_line = event.message.splitlines()[0] if event.message else ""
                self.notes[event.host] = Text(
                    f"{event.status.value}: {event.host} · {event.task}: {first_line}", style="red"
                )
        elif isinstance(event, JobProgress):
            self._job(event)

    def _job(self, event: JobProgress) -> None:
        status = event.status
        key = (status.job, event.host or "")
        label = f"{status.job}@{event.host}" if event.host else status.job
        count = f"{_fmt_num(status.done)}/{_fmt_num(status.total)}"
        rate = f"{status.tokens_per_s:.1f} tok/s" if status.tokens_per_s is not None else ""
        if status.eta_s is not None and not status.finished:
            rate += f" · eta {fmt_eta(status.eta_s)}"
        if status.failed:
            count += f" ({_fmt_num(status.failed)} failed)"
        task_id = self._jobs.get(key)
        if task_id is None:
            task_id = self.progress.add_task(label, total=status.total, count=count, rate=rate)
            self._jobs[key] = task_id
        self.progress.update(task_id, total=status.total, completed=status.done or 0, count=count, rate=rate)

    def render(self) -> Group:
        table = Table.grid(padding=(0, 2))
        for name, state in self.stage_state.items():
            marker = {"running": "▶", "ok": "✓", "changed": "✓", "failed": "✗"}.get(state, "·")
            table.add_row(
                Text(marker, style=_STATUS_STYLE.get(state, "dim")),
                name,
                styled(state),
                Text(self.stage_counts.get(name, ""), style="dim"),
            )
        parts: list[Any] = [Text(self.title, style="bold"), table]
        if self.current_task:
            elapsed = time.monotonic() - self.task_started
            suffix = f" · {self.retry}" if self.retry else ""
            parts.append(Text(f"  task: {self.current_task} ({elapsed:.0f}s{suffix})", style="cyan"))
        if self._jobs:
            parts.append(self.progress)
        parts.extend(list(self.notes.values())[-3:])
        return Group(*parts)


class PlainView:
    """Line-by-line output for logs and pipes (no cursor movement)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._last_job: dict[tuple[str, str], tuple[float | None, float]] = {}

    def handle(self, event: Event) -> None:
        def out(text: Text) -> None:
            self.console.print(text, soft_wrap=True)  # one event, one line: logs stay greppable

        if isinstance(event, StageStarted):
            out(Text(f"== stage {event.stage} (hosts: {event.hosts})", style="bold"))
        elif isinstance(event, StageFinished):
            c = event.counts
            out(
                Text(
                    f"== stage {event.stage} {'FAILED' if event.failed else 'done'}: "
                    f"ok={c.ok} changed={c.changed} "
                    f"failed={c.failed} skipped={c.skipped} unreachable={c.unreachable}"
                    + (f" rescued={c.rescued}" if c.rescued else "")
                    + (f" ignored={c.ignored}" if c.ignored else ""),
                    style="red" if event.failed else "green",
                )
            )
        elif isinstance(event, NoHostsMatched):
            out(Text(f"   no hosts matched for {event.play}", style="dim"))
        elif isinstance(event, TaskResult):
            if event.status is TaskStatus.SKIPPED:
                return
            line = Text(
                f"   {event.status.value:<11} {event.host}  {event.task}",
                style=_RESULT_STYLE.get(event.status, ""),
            )
            if event.ignored:
                line.append(" (ignored)", style="dim")
            out(line)
            if event.status in (TaskStatus.FAILED, TaskStatus.UNREACHABLE) and event.message:
                for text in event.message.splitlines()[:10]:
                    out(Text(f"      {text}", style="red"))
            elif event.message:  # a "Show ..." task: its numbers, as ansible-playbook prints them
                for text in event.message.splitlines()[:SHOWN_LINES]:
                    out(Text(f"      {text}"))
        elif isinstance(event, JobProgress):
            s = event.status
            key = (s.job, event.host or "")
            last_done, last_time = self._last_job.get(key, (None, 0.0))
            now = time.monotonic()
            if s.done == last_done or (now - last_time < 5 and not s.finished):
                return
            self._last_job[key] = (s.done, now)
            pct = f" ({s.fraction:.0%})" if s.fraction is not None else ""
            rate = f", {s.tokens_per_s:.1f} tok/s" if s.tokens_per_s is not None else ""
            if s.eta_s is not None and not s.finished:
                rate += f", eta {fmt_eta(s.eta_s)}"
            out(
                Text(
                    f"   job {s.job}{'@' + event.host if event.host else ''}: "
                    f"{_fmt_num(s.done)}/{_fmt_num(s.total)}{pct}{rate}",
                    style="cyan",
                )
            )
        elif isinstance(event, Output) and event.level in ("warning", "error", "deprecated"):
            out(Text(f"   [{event.level}] {event.text}", style="yellow" if event.level != "error" else "red"))


# Lines of a "Show ..." task's message that `regen run` prints (the rest is in the run's stdout record).
SHOWN_LINES = 40


def _print_shown(live: Any, view: Any) -> None:
    """Print what "Show ..." tasks printed above the live view (it stays on the terminal)."""
    while view.shown:
        live.console.print(view.shown.pop(0))


def watch_run(
    handle: RunHandle,
    console: Console,
    *,
    plain: bool,
    events_json: bool,
    title: str,
    stages: Sequence[str],
    events_queue: queue.Queue[Event],
) -> RunResult:
    """Drive a view from the main thread until the run ends; Ctrl-C cancels the run."""
    from rich.live import Live

    def drain(view: Any) -> None:
        while True:
            try:
                event = events_queue.get_nowait()
            except queue.Empty:
                return
            if events_json:
                print(json.dumps(event.to_dict(), default=str), flush=True)
            if view is not None:
                view.handle(event)

    try:
        if events_json:
            while not handle.done():
                drain(None)
                time.sleep(0.1)
            drain(None)
        elif plain or not console.is_terminal:
            view = PlainView(console)
            console.print(Text(title, style="bold"))
            while not handle.done():
                drain(view)
                time.sleep(0.1)
            drain(view)
        else:
            live_view = LiveView(stages, title)
            with Live(live_view.render(), console=console, refresh_per_second=8, transient=False) as live:
                while not handle.done():
                    drain(live_view)
                    _print_shown(live, live_view)
                    live.update(live_view.render())
                    time.sleep(0.12)
                drain(live_view)
                _print_shown(live, live_view)
                live.update(live_view.render())
    except KeyboardInterrupt:
        console.print(Text("interrupted: canceling the run…", style="magenta"))
        handle.cancel()
    # The cancel lands within about a second; a second Ctrl-C must not leave ansible-playbook running.
    while True:
        try:
            return handle.wait()
        except KeyboardInterrupt:
            handle.cancel()


def _plan_rows(
    plan_doc: Mapping[str, Any], prefix: str = "", _said: set[str] | None = None
) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    said = set() if _said is None else _said  # unknown entries share one long reason: print it once
    for key, value in plan_doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "value" in value and value.get("unknown") is True:
            # Unknown is not null: a null value is a decision ("no reasoning parser"), this is a gap.
            reason = f"{value.get('reason') or ''}; fix: {value.get('remedy') or '?'}"
            rows.append((name, "unknown", reason if reason not in said else "unknown: as above"))
            said.add(reason)
        elif isinstance(value, Mapping) and "value" in value:
            reason = value.get("reason") or ""
            rows.append((name, json.dumps(value["value"], default=str), str(reason)))
        elif isinstance(value, Mapping):
            reason = str(value.get("reason", "")) if isinstance(value.get("reason"), str) else ""
            scalars = {k: v for k, v in value.items() if not isinstance(v, Mapping) and k != "reason"}
            if scalars and not any(isinstance(v, Mapping) for v in value.values()):
                rows.append((name, json.dumps(scalars, default=str), reason))
            else:
                rows.extend(_plan_rows(value, f"{name}.", said))
        else:
            rows.append((name, json.dumps(value, default=str), ""))
    return rows


def plan_table(plan_doc: Mapping[str, Any]) -> Table:
    table = Table(title="plan", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("setting")
    table.add_column("value")
    table.add_column("why", style="dim")
    for name, value, reason in _plan_rows(plan_doc):
        table.add_row(name, escape(value), escape(reason))
    return table


def plan_headline(facts: Mapping[str, Any]) -> Group:
    """The plan at a glance: layout, attention backend, context length, drafter, what is unknown, warnings."""
    from regen.cli.local_facts import planned_context_length

    plan = facts.get("plan") if isinstance(facts.get("plan"), Mapping) else {}

    def value(section: str, key: str) -> str:
        entry = (plan.get(section) or {}).get(key)
        if isinstance(entry, Mapping) and entry.get("unknown") is True:
            return "unknown"
        shown = entry.get("value") if isinstance(entry, Mapping) else entry
        return shown if isinstance(shown, str) else json.dumps(shown, default=str)

    lines = [Text("at a glance", style="bold")]
    lines.append(Text(
        f"  serving: {value('serving', 'device')} · TP {value('serving', 'tp_size')} · EP "
        f"{value('serving', 'ep_size')} · DP {value('serving', 'dp_size')} · attention DP "
        f"{value('serving', 'attn_dp_size')} · fits {value('serving', 'fits')}"
    ))
    backend = (plan.get("serving") or {}).get("attention_backend") or {}
    why = str(backend.get("reason") or "")
    if ", sources: " in why:  # the table row's sources are in the plan table above
        why = why.split(", sources: ")[0] + ")"
    lines.append(Text(f"  attention backend: {value('serving', 'attention_backend')} ({_short(why, 300)})"))
    lines.extend(_kernel_and_memory_lines(facts, plan, value))
    length, where, reason = planned_context_length(plan)
    if where:
        why = f": {reason}" if reason else ""
        lines.append(Text(f"  context length: {json.dumps(length)} ({where}{why})"))
    else:
        maximum = (facts.get("architecture") or {}).get("max_position_embeddings")
        lines.append(Text(
            f"  context length: not planned (the plan has no length budget); SGLang would take the model's "
            f"own maximum, {maximum}"
        ))
    lines.append(Text(
        f"  drafter: target layers {value('drafter', 'target_layer_ids')} · block "
        f"{value('drafter', 'block_size')} · mask id {value('drafter', 'mask_token_id')}"
    ))
    unknown = {
        f"{section}.{key}": entry
        for section, entries in plan.items() if isinstance(entries, Mapping)
        for key, entry in entries.items() if isinstance(entry, Mapping) and entry.get("unknown") is True
    }
    if unknown:
        first = next(iter(unknown.values()))
        lines.append(Text(f"  unknown without the tokenizer: {', '.join(sorted(unknown))}", style="yellow"))
        why_unknown = str(first.get("reason") or "").removeprefix("unknown: ")
        lines.append(Text(f"    why: {why_unknown}", style="yellow"))
        lines.append(Text(f"    fix: {first.get('remedy')}", style="yellow"))
    vocab = ((facts.get("tokenizer") or {}).get("vocab") or {}).get("disagreement")
    # The unknown parts are listed above: their plan warning would say it twice.
    said_above = "tokenizer facts unknown" if unknown else None
    warnings = [w for w in plan.get("warnings") or [] if not (said_above and str(w).startswith(said_above))]
    for warning in ([f"vocabulary: {vocab}"] if vocab else []) + warnings:
        lines.append(Text(f"  warning: {warning}", style="yellow"))
    return Group(*lines)


def _why(entry: Any, limit: int = 240) -> str:
    reason = str(entry.get("reason") or "") if isinstance(entry, Mapping) else ""
    return _short(reason.split(" (MoE table row")[0].split(" (KV dtype table row")[0], limit)


def _kernel_and_memory_lines(facts: Mapping[str, Any], plan: Mapping[str, Any], value: Any) -> list[Text]:
    """Weights, KV pool and concurrency; the MoE kernels and (backend, KV dtype) pair from the tables; the
    CUDA graphs; the NCCL decision per process; the run estimate (each only when the plan has it)."""
    serving = plan.get("serving") or {}
    arch = facts.get("architecture") or {}
    lines = []
    memory = serving.get("memory")
    memory = memory.get("value") if isinstance(memory, Mapping) else None
    if arch.get("weight_bytes"):
        text = (f"  weights: {arch['weight_bytes'] / 2**30:,.1f} GiB ({arch.get('weight_bytes_source')}"
                + (f": {(arch.get('weight_estimate') or {}).get('reason')}" if arch.get("weight_bytes_source")
                   == "estimate" else "") + ")")
        lines.append(Text(_short(text, 400)))
    if isinstance(memory, Mapping):
        lines.append(Text(
            f"  KV pool: {memory.get('tokens'):,} tokens "
            f"({memory.get('kv_pool_bytes_per_gpu', 0) / 2**30:,.1f} GiB per GPU at "
            f"{memory.get('kv_bytes_per_token'):,} B/token) · concurrency "
            f"{value('generation', 'concurrency')}"))
    if "moe_runner_backend" in serving:
        lines.append(Text(
            f"  MoE kernels: --quantization {value('serving', 'quantization')} --moe-runner-backend "
            f"{value('serving', 'moe_runner_backend')} ({_why(serving.get('moe_runner_backend'))})"))
    kv = serving.get("kv_cache_dtype")
    if isinstance(kv, Mapping) and kv.get("pair"):
        lines.append(Text(f"  (attention backend, KV dtype): ({kv['pair'][0]}, {kv['pair'][1]}) "
                          f"({_why(kv)})"))
    if "cuda_graph_max_bs" in serving:
        lines.append(Text(
            f"  CUDA graphs: decode batch {value('serving', 'cuda_graph_max_bs')} · mem fraction "
            f"{value('serving', 'mem_fraction_static')} ({_why(serving.get('cuda_graph_max_bs'), 300)})"))
    risk = serving.get("ep_risk")
    risk = risk.get("value") if isinstance(risk, Mapping) else None
    if risk:
        lines.append(Text(f"  risk: {_short(risk, 300)}", style="yellow"))
    for key in ("serving", "capture", "training"):
        entry = (plan.get("nccl") or {}).get(key)
        if isinstance(entry, Mapping):
            lines.append(Text(f"  NCCL {key}: {json.dumps(entry.get('value'))} ({_why(entry, 200)})"))
    run = (plan.get("estimate") or {}).get("run")
    if isinstance(run, Mapping) and run.get("reason"):
        lines.append(Text("  run estimate:"))
        text = str(run["reason"]).replace("; disk, ", "\n").replace("; capture: ", "\ncapture: ")
        for piece in text.split("\n"):
            lines.append(Text(f"    {_short(piece, 400)}"))
    return lines


def facts_tree(facts: Mapping[str, Any], label: str = "facts") -> Tree:
    """Nested facts as a tree; small flat mappings (a module's import status, say) on one line each."""
    tree = Tree(Text(label, style="bold"))

    def add(node: Tree, key: str | None, value: Any) -> None:
        head = Text(f"{key}: ", style="bold") if key is not None else Text()
        compact = _compact(value)
        if compact is not None:
            node.add(head + Text(compact))
        elif isinstance(value, Mapping):
            child = node.add(Text(str(key), style="bold")) if key is not None else node
            for k, v in value.items():
                add(child, str(k), v)
        else:  # a list of mappings or lists
            child = node.add(Text(str(key), style="bold")) if key is not None else node
            for i, item in enumerate(value):
                add(child, f"[{i}]", item)

    add(tree, None, facts)
    return tree


def _compact(value: Any, limit: int = 110) -> str | None:
    """One line for a scalar, a list of scalars or a small mapping of those; None when it needs a subtree."""
    if not isinstance(value, Mapping | list) or not value or _is_scalar_list(value):
        return _short(value)
    if isinstance(value, Mapping) and all(
        not isinstance(v, Mapping | list) or _is_scalar_list(v) for v in value.values()
    ):
        line = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in value.items())
        return line if len(line) <= limit else None
    return None


def _is_scalar_list(value: Any) -> bool:
    return isinstance(value, list) and all(not isinstance(v, Mapping | list) for v in value)


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_row(result: RunResult) -> list[Any]:
    stages = " ".join(s.name for s in result.stages if s.status != "not run") or (
        ",".join(result.tags) or "-"
    )
    totals = [
        sum(getattr(h, k) for h in result.hosts.values()) for k in ("ok", "changed", "failed", "unreachable")
    ]
    failed = f"{result.failed_task.stage}: {result.failed_task.task}" if result.failed_task else ""
    outcome = styled(result.status)
    if result.check:
        outcome.append(" (check)", style="dim")
    return [
        when(result.started),
        result.ident,
        stages,
        outcome,
        "/".join(str(n) for n in totals),
        _duration(result.duration),
        failed,
    ]
