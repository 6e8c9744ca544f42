"""``regen``: run, watch and inspect the regen pipeline from a shell.

    regen run [STAGE ...] [-i INVENTORY] [-e k=v] [--check]   run stages (all of regen.yml by default)
    regen facts [-i INVENTORY] [--json]                         introspect only; print the facts and plan
    regen status [RUN]                                          what the last runs did
    regen plan [-i INVENTORY] [--offline]                       what a full run would do; changes nothing
    regen stages                                                the stages this checkout has

Exit codes (see :class:`regen.runner.ExitCode`): 0 ok, 1 error outside any task, 2 a task failed,
3 a host was unreachable, 4 bad usage or input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The command needs the controller packages (the `runner` extra: ansible-runner, rich, PyYAML); the
# package itself also runs as jobs on hosts without them, so a missing one is a message, not a traceback.
try:
    import yaml
    from rich.console import Console, Group
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree

    from regen.runner import (
        BadInput,
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
        discover_stages,
        history,
        load_run,
        plan,
        run_async,
    )
    from regen.runner.project import find_project
except ImportError as _exc:  # pragma: no cover - exercised only where the extra is not installed
    _MISSING: ImportError | None = _exc
else:
    _MISSING = None

EXIT_CODES = """exit codes:
  0    everything ran
  1    ansible or regen failed outside any task (the message says why)
  2    a task failed: its stage failed (the summary names stage, task, host and message)
  3    a host was unreachable
  4    bad usage or input: unknown stage, missing inventory, bad -e, a playbook that does not parse
  130  interrupted (Ctrl-C); jobs launched as services keep running and resume on the next run
"""


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage; regen keeps 2 for a failed task and uses 4 for bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.BAD_INPUT), f"{self.prog}: error: {message}\n")


# --- argument helpers -----------------------------------------------------------------------------


def parse_extravars(items: Sequence[str]) -> dict[str, Any]:
    """``-e`` values as Ansible takes them: ``k=v`` pairs (strings), ``@file`` (YAML/JSON) or a mapping."""
    result: dict[str, Any] = {}
    for item in items:
        text = item.strip()
        if text.startswith("@"):
            path = Path(text[1:]).expanduser()
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            except OSError as exc:
                raise BadInput(f"-e {item}: cannot read {path}: {exc.strerror}") from None
            except yaml.YAMLError as exc:
                raise BadInput(f"-e {item}: {path} is not YAML/JSON: {exc}") from None
            if not isinstance(data, dict):
                raise BadInput(f"-e {item}: {path} must hold a mapping of variables")
            result.update(data)
        elif text.startswith("{"):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise BadInput(f"-e {item!r} is not a JSON/YAML mapping: {exc}") from None
            if not isinstance(data, dict):
                raise BadInput(f"-e {item!r} must be a mapping")
            result.update(data)
        else:
            try:
                pairs = shlex.split(text)
            except ValueError as exc:
                raise BadInput(f"-e {item!r}: {exc}") from None
            for pair in pairs:
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise BadInput(f"-e {pair!r}: expected NAME=VALUE, @FILE or a JSON mapping")
                result[key] = value
    return result


def parse_secret_env(items: Sequence[str]) -> dict[str, str]:
    """``--secret-env NAME=ENVVAR``: secret variable NAME takes its value from environment variable ENVVAR."""
    secrets: dict[str, str] = {}
    for item in items:
        name, sep, env_name = item.partition("=")
        env_name = env_name or name
        if not name or (sep and not env_name):
            raise BadInput(f"--secret-env {item!r}: expected NAME=ENVVAR")
        if env_name not in os.environ:
            raise BadInput(f"--secret-env {item}: environment variable {env_name} is not set")
        secrets[name] = os.environ[env_name]
    return secrets


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--project", metavar="DIR", help="the regen checkout (default: found from the cwd)")
    parser.add_argument(
        "--private-data-dir",
        metavar="DIR",
        help="ansible-runner's directory for run records (default: <checkout>/.cache/runner)",
    )


def _inventory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i",
        "--inventory",
        action="append",
        metavar="INVENTORY",
        help="inventory path (repeatable; default: the one ansible.cfg names, inventory/local)",
    )
    parser.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        default=[],
        metavar="VARS",
        help="extra variables: NAME=VALUE, @FILE (YAML/JSON) or a JSON mapping (repeatable)",
    )
    parser.add_argument("-l", "--limit", metavar="HOSTS", help="limit to these hosts (ansible --limit)")
    parser.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME=ENVVAR",
        help="pass variable NAME with the value of environment variable ENVVAR, encrypted for "
        "the run and never written or logged in the clear (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="regen",
        description="Run, watch and inspect the regen pipeline (ansible-runner).",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p_run = sub.add_parser(
        "run",
        help="run stages (all of regen.yml by default) with a live view",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_run.add_argument(
        "stages",
        nargs="*",
        metavar="STAGE",
        help="stage names or tags, e.g. demo introspect generate (see `regen stages`)",
    )
    _inventory_args(p_run)
    p_run.add_argument("-C", "--check", action="store_true", help="check mode: report what would change")
    p_run.add_argument("-D", "--diff", action="store_true", help="record file differences (in stdout)")
    p_run.add_argument("-t", "--tags", help="more tags on top of the stages' (comma-separated)")
    p_run.add_argument("--skip-tags", help="tags to skip (comma-separated)")
    p_run.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    p_run.add_argument("--events", action="store_true", help="stream every event record as a JSON line")
    p_run.add_argument("--plain", action="store_true", help="plain lines instead of the live view")
    p_run.add_argument("-v", "--verbose", action="count", default=0, help="ansible verbosity (-v, -vv, ...)")
    _common(p_run)

    p_facts = sub.add_parser(
        "facts",
        help="run introspection only and print the model facts and plan",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _inventory_args(p_facts)
    p_facts.add_argument("--json", action="store_true", help="print the facts document as JSON")
    _common(p_facts)

    p_status = sub.add_parser("status", help="what the last runs did (from runner's records)")
    p_status.add_argument(
        "run", nargs="?", metavar="RUN", help="one run's id (or a unique prefix) for details"
    )
    p_status.add_argument(
        "-n", "--last", type=int, default=10, metavar="N", help="how many runs (default 10)"
    )
    p_status.add_argument("--json", action="store_true", help="print JSON")
    _common(p_status)

    p_plan = sub.add_parser(
        "plan",
        help="what a full run would do here, without changing anything",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _inventory_args(p_plan)
    p_plan.add_argument(
        "--offline",
        action="store_true",
        help="connect to nothing: read the inventory and earlier runs only (no check-mode run)",
    )
    p_plan.add_argument("--json", action="store_true", help="print JSON")
    _common(p_plan)

    p_stages = sub.add_parser("stages", help="list the stages of this checkout and their tags")
    p_stages.add_argument("--json", action="store_true", help="print JSON")
    _common(p_stages)
    return parser


# --- rendering ------------------------------------------------------------------------------------


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


def _styled(status: str) -> Text:
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


def _when(iso: str | None) -> str:
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
            _styled(stage.status),
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


def exit_line(result: RunResult) -> Text:
    code = result.exit_code
    if code is ExitCode.OK:
        what = "check mode: nothing was changed" if result.check else "all stages ran"
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
    if result.artifact_dir:
        console.print(Text(f"run record: {result.artifact_dir}", style="dim"))
    console.print(exit_line(result))


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
                _styled(state),
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
            out(
                Text(
                    f"   job {s.job}{'@' + event.host if event.host else ''}: "
                    f"{_fmt_num(s.done)}/{_fmt_num(s.total)}{pct}{rate}",
                    style="cyan",
                )
            )
        elif isinstance(event, Output) and event.level in ("warning", "error", "deprecated"):
            out(Text(f"   [{event.level}] {event.text}", style="yellow" if event.level != "error" else "red"))


def _watch(
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
                    live.update(live_view.render())
                    time.sleep(0.12)
                drain(live_view)
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


# --- commands -------------------------------------------------------------------------------------


def _start(
    args: argparse.Namespace,
    stages: list[str] | None,
    *,
    check: bool = False,
    events_queue: queue.Queue[Event] | None = None,
    **extra: Any,
) -> RunHandle:
    inventory = args.inventory if args.inventory else None
    return run_async(
        stages,
        inventory=inventory,
        extravars=parse_extravars(args.extra_vars),
        limit=args.limit,
        check=check,
        secrets=parse_secret_env(args.secret_env) or None,
        on_event=events_queue.put if events_queue else None,
        project_dir=args.project,
        private_data_dir=args.private_data_dir,
        **extra,
    )


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    events: queue.Queue[Event] = queue.Queue()
    handle = _start(
        args,
        args.stages or None,
        check=args.check,
        events_queue=events,
        diff=args.diff,
        tags=args.tags,
        skip_tags=args.skip_tags,
        verbosity=args.verbose,
    )
    names = [s.name for s in handle.stages]
    inv = ", ".join(args.inventory) if args.inventory else "default inventory"
    title = f"regen run · {' '.join(names) or 'all stages'} · {inv}{' · check mode' if args.check else ''}"
    err_console = make_console(stderr=True) if (args.json or args.events) else console
    result = _watch(
        handle,
        err_console,
        plain=args.plain or args.json,
        events_json=args.events,
        title=title,
        stages=names,
        events_queue=events,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
    elif not args.events:
        print_summary(console, result)
    else:
        print_summary(err_console, result)
    return int(result.exit_code)


def _plan_rows(plan_doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for key, value in plan_doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "value" in value:
            reason = value.get("reason") or value.get("why") or ""
            rows.append((name, json.dumps(value["value"], default=str), str(reason)))
        elif isinstance(value, Mapping):
            reason = str(value.get("reason", "")) if isinstance(value.get("reason"), str) else ""
            scalars = {k: v for k, v in value.items() if not isinstance(v, Mapping) and k != "reason"}
            if scalars and not any(isinstance(v, Mapping) for v in value.values()):
                rows.append((name, json.dumps(scalars, default=str), reason))
            else:
                rows.extend(_plan_rows(value, f"{name}."))
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


def cmd_facts(args: argparse.Namespace, console: Console) -> int:
    project = find_project(args.project)
    if not any(s.matches("introspect") for s in discover_stages(project.root)):
        names = ", ".join(s.name for s in discover_stages(project.root)) or "none"
        raise BadInput(f"this checkout has no introspect stage yet (regen.yml has: {names})")
    events: queue.Queue[Event] = queue.Queue()
    handle = _start(args, ["introspect"], events_queue=events)
    err = make_console(stderr=True)
    result = _watch(
        handle,
        err,
        plain=True,
        events_json=False,
        title="regen facts · introspect",
        stages=["introspect"],
        events_queue=events,
    )
    if not result.ok:
        print_summary(err, result)
        return int(result.exit_code)
    if result.facts is None:
        err.print(
            Text(
                "introspect ran but published no regen_model_facts fact and wrote no model_facts.json",
                style="bold red",
            )
        )
        return int(ExitCode.ERROR)
    if args.json:
        print(json.dumps(result.facts, indent=1, default=str))
        return 0
    facts = {k: v for k, v in result.facts.items() if k != "plan"}
    console.print(
        facts_tree(
            facts, f"model facts ({result.facts_source if result.facts_source != 'run' else 'this run'})"
        )
    )
    if result.plan:
        console.print(plan_table(result.plan))
    else:
        console.print(Text("no plan in the facts", style="dim"))
    if result.artifacts.facts:
        console.print(Text(f"facts file: {result.artifacts.facts[-1]}", style="dim"))
    return 0


def _run_row(result: RunResult) -> list[Any]:
    stages = " ".join(s.name for s in result.stages if s.status != "not run") or (
        ",".join(result.tags) or "-"
    )
    totals = [
        sum(getattr(h, k) for h in result.hosts.values()) for k in ("ok", "changed", "failed", "unreachable")
    ]
    failed = f"{result.failed_task.stage}: {result.failed_task.task}" if result.failed_task else ""
    outcome = _styled(result.status)
    if result.check:
        outcome.append(" (check)", style="dim")
    return [
        _when(result.started),
        result.ident,
        stages,
        outcome,
        "/".join(str(n) for n in totals),
        _duration(result.duration),
        failed,
    ]


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    project = find_project(args.project)
    pdd = (
        Path(args.private_data_dir).expanduser().resolve()
        if args.private_data_dir
        else project.default_private_data_dir
    )
    if args.run:
        base = pdd / "artifacts"
        matches = sorted(p for p in base.glob(f"{args.run}*") if p.is_dir()) if base.is_dir() else []
        if len(matches) != 1:
            raise BadInput(
                f"{'no' if not matches else 'more than one'} run matches {args.run!r} in {base}; "
                "see `regen status` for the ids"
            )
        result = load_run(matches[0], stages=discover_stages(project.root))
        if args.json:
            print(json.dumps(result.to_dict(), indent=1, default=str))
        else:
            console.print(
                Text(
                    f"run {result.ident} · {_when(result.started)} · "
                    f"{'check mode' if result.check else 'real run'} · inventory "
                    f"{', '.join(result.inventory) or '?'}",
                    style="bold",
                )
            )
            print_summary(console, result)
        return 0
    runs = history(project_dir=project.root, private_data_dir=pdd, limit=max(1, args.last))
    if args.json:
        print(json.dumps([r.to_dict(include_facts=False) for r in runs], indent=1, default=str))
        return 0
    if not runs:
        console.print(f"no runs recorded in {pdd} yet: start one with `regen run`")
        return 0
    table = Table(title=f"last runs ({pdd})", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("when", "run", "stages", "outcome", "ok/chg/fail/unr", "took", "failed task"):
        # the id is what `regen status RUN` takes: never cut it
        table.add_column(column, no_wrap=column in ("when", "run", "ok/chg/fail/unr"))
    for result in runs:
        table.add_row(*_run_row(result))
    console.print(table)
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    inventory = args.inventory[0] if args.inventory else None
    if args.inventory and len(args.inventory) > 1:
        raise BadInput("regen plan takes one inventory")
    if not args.offline:
        make_console(stderr=True).print(
            Text("regen plan · a check-mode run of the whole pipeline (changes nothing)…", style="dim")
        )
    report = plan(
        inventory=inventory,
        extravars=parse_extravars(args.extra_vars),
        limit=args.limit,
        offline=args.offline,
        project_dir=args.project,
        private_data_dir=args.private_data_dir,
        secrets=parse_secret_env(args.secret_env) or None,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        table = Table(
            title=f"stages ({', '.join(report.inventory)})",
            title_justify="left",
            show_edge=False,
            pad_edge=False,
        )
        for column in ("stage", "tag", "hosts", "state", "changes", "last real run", "note"):
            table.add_column(column)
        for stage in report.stages:
            last = stage.last_run
            table.add_row(
                stage.name,
                stage.tag,
                ", ".join(stage.hosts) or "-",
                _styled(stage.state),
                "" if stage.would_change is None else str(stage.would_change),
                f"{_when(last['when'])} {last['status']}" if last else "never",
                escape((stage.message or "").splitlines()[0][:100]) if stage.message else "",
            )
        console.print(table)
        if report.plan:
            console.print(plan_table(report.plan))
        else:
            console.print(
                Text("no facts yet: the plan appears once introspection has run (`regen facts`)", style="dim")
            )
        if report.facts_source:
            console.print(Text(f"facts from: {report.facts_source}", style="dim"))
        for warning in report.warnings:
            console.print(Text(f"warning: {warning}", style="yellow"))
    check = report.check_run
    if (
        check is not None and check.exit_code in (ExitCode.UNREACHABLE, ExitCode.BAD_INPUT, ExitCode.CANCELED)
    ) or (check is not None and check.exit_code is ExitCode.ERROR and not check.failures):
        if not args.json:
            console.print(exit_line(check))
        return int(check.exit_code)
    return 0


def cmd_stages(args: argparse.Namespace, console: Console) -> int:
    project = find_project(args.project)
    stages = discover_stages(project.root)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": s.name,
                        "tag": s.tag,
                        "tags": list(s.tags),
                        "playbook": str(s.playbook),
                        "standalone": s.standalone,
                        "hosts": [p.hosts for p in s.plays],
                    }
                    for s in stages
                ],
                indent=1,
            )
        )
        return 0
    table = Table(title=f"stages of {project.root}", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("stage", "tag", "hosts", "playbook", "note"):
        table.add_column(column)
    for s in stages:
        table.add_row(
            s.name,
            s.tag,
            ", ".join(sorted({p.hosts for p in s.plays})),
            str(s.playbook.relative_to(project.root))
            if s.playbook.is_relative_to(project.root)
            else str(s.playbook),
            "runs on its own" if s.standalone else "",
        )
    console.print(table)
    return 0


COMMANDS = {"run": cmd_run, "facts": cmd_facts, "status": cmd_status, "plan": cmd_plan, "stages": cmd_stages}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``regen`` console script; returns the exit code (see ``regen --help``)."""
    if _MISSING is not None:
        print(
            f"regen: the command needs the controller packages; {_MISSING.name or _MISSING} is missing. "
            "Install them with `pip install 'regen[runner]'` (or scripts/bootstrap.sh for the project venv).",
            file=sys.stderr,
        )
        return 1
    parser = build_parser()
    args = parser.parse_args(argv)
    console = make_console()
    previous = _sigterm_as_interrupt()
    try:
        return COMMANDS[args.command](args, console)
    except BadInput as exc:
        make_console(stderr=True).print(Text(f"regen: {exc}", style="bold red"))
        return int(ExitCode.BAD_INPUT)
    except KeyboardInterrupt:
        make_console(stderr=True).print(Text("regen: interrupted", style="magenta"))
        return int(ExitCode.CANCELED)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sigterm_as_interrupt() -> Any:
    """A scheduler stops jobs with SIGTERM: treat it like Ctrl-C, so the run is cancelled, not orphaned
    (ansible-playbook runs in its own session and would outlive us otherwise). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    sys.exit(main())
