"""The `regen` commands (run, facts, status, plan, compare, stages) and `main`."""

from __future__ import annotations

import argparse
import json
import queue
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from regen.cli.parser import build_parser, parse_extravars, parse_secret_env
from regen.cli.preflight import cmd_preflight
from regen.cli.views import (
    exit_line,
    facts_tree,
    make_console,
    plan_headline,
    plan_table,
    print_summary,
    run_row,
    styled,
    watch_run,
    when,
)
from regen.runner import (
    BadInput,
    Event,
    ExitCode,
    RunHandle,
    discover_stages,
    history,
    history_dirs,
    load_recorded_run,
    load_run,
    plan,
    run_async,
)
from regen.runner.project import find_project


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
    result = watch_run(
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


def cmd_facts(args: argparse.Namespace, console: Console) -> int:
    if args.model_path is not None:  # no checkout needed: the package carries the plan's code
        return _facts_of_model_dir(args, console)
    project = find_project(args.project)
    gpu_flags = (
        ("--gpus", args.gpus),
        ("--gpu-memory-gib", args.gpu_memory_gib),
        ("--compute-capability", args.compute_capability),
    )
    given = [flag for flag, value in gpu_flags if value is not None]
    if given or args.tokenizer_mode != "raw_files":
        raise BadInput(
            f"{', '.join(given) or '--tokenizer-mode'} only apply with --model-path DIR (without it, regen "
            "facts introspects the inventory's hosts, whose GPUs and tokenizer it reads itself)"
        )
    if not any(s.matches("introspect") for s in discover_stages(project.root)):
        names = ", ".join(s.name for s in discover_stages(project.root)) or "none"
        raise BadInput(f"this checkout has no introspect stage yet (regen.yml has: {names})")
    events: queue.Queue[Event] = queue.Queue()
    handle = _start(args, ["introspect"], events_queue=events)
    err = make_console(stderr=True)
    result = watch_run(
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
        console.print(plan_headline(result.facts))
    else:
        console.print(Text("no plan in the facts", style="dim"))
    if result.artifacts.facts:
        console.print(Text(f"facts file: {result.artifacts.facts[-1]}", style="dim"))
    return 0


def _facts_of_model_dir(args: argparse.Namespace, console: Console) -> int:
    """`regen facts --model-path DIR`: the module_utils functions called here, nothing run anywhere."""
    from regen.cli.local_facts import local_facts

    flags = (
        ("-i", args.inventory),
        ("-e", args.extra_vars),
        ("-l", args.limit),
        ("--secret-env", args.secret_env),
    )
    inventory_flags = [flag for flag, value in flags if value]
    if inventory_flags:
        raise BadInput(f"--model-path reads the directory on this machine: {', '.join(inventory_flags)} "
                       "would be ignored; drop them, or drop --model-path to introspect the inventory")
    facts = local_facts(
        args.model_path,
        gpus=args.gpus,
        memory_gib=args.gpu_memory_gib,
        capability=args.compute_capability,
        tokenizer_mode=args.tokenizer_mode,
        prompt_rows=getattr(args, "prompt_rows", None),
        simulation_csv=getattr(args, "simulation_csv", None),
    )
    if args.json:
        print(json.dumps(facts, indent=1, default=str))
        return 0
    shown = {k: v for k, v in facts.items() if k not in ("plan", "plan_values", "plan_unknown")}
    console.print(facts_tree(shown, f"model facts ({facts['model_path']}, read here)"))
    console.print(plan_table(facts["plan"]))
    console.print(plan_headline(facts))
    return 0


def _recorded_matches(root: Path, ref: str, artifacts: list[str] | None) -> list[Path]:
    """Run-history documents (any way of running) whose id is `ref` or starts with it."""
    from regen.provenance import history_records

    dirs = [Path(d) for d in artifacts] if artifacts else history_dirs(root)
    found = [p for d in dirs for p in history_records(d) if p.stem.startswith(ref)]
    exact = [p for p in found if p.stem == ref]
    return exact or found


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
        recorded = [] if matches else _recorded_matches(project.root, args.run, args.artifacts)
        if len(matches) + len(recorded) != 1:
            raise BadInput(
                f"{'no' if not matches + recorded else 'more than one'} run matches {args.run!r} in {base} "
                "or the run history (artifacts/runs/history); see `regen status` for the ids"
            )
        stages = discover_stages(project.root)
        if matches:
            result = load_run(matches[0], stages=stages)
        else:
            result = load_recorded_run(recorded[0], stages=stages)
            if result is None:
                raise BadInput(f"{recorded[0]} is not a run record (regen.run/1)")
        if args.json:
            print(json.dumps(result.to_dict(), indent=1, default=str))
        else:
            console.print(
                Text(
                    f"run {result.ident} · {when(result.started)} · "
                    f"{'check mode' if result.check else 'real run'} · inventory "
                    f"{', '.join(result.inventory) or '?'}",
                    style="bold",
                )
            )
            print_summary(console, result)
        return 0
    runs = history(
        project_dir=project.root, private_data_dir=pdd, limit=max(1, args.last), artifacts_dirs=args.artifacts
    )
    if args.json:
        print(json.dumps([r.to_dict(include_facts=False) for r in runs], indent=1, default=str))
        return 0
    if not runs:
        console.print(f"no runs recorded in {pdd} or artifacts/runs/history yet: start one with `regen run`")
        return 0
    title = f"last runs ({pdd} and artifacts/runs/history: regen run, make regen, ansible-playbook)"
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for column in ("when", "run", "stages", "outcome", "ok/chg/fail/unr", "took", "failed task"):
        # the id is what `regen status RUN` takes: never cut it
        table.add_column(column, no_wrap=column in ("when", "run", "ok/chg/fail/unr"))
    for result in runs:
        table.add_row(*run_row(result))
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
                styled(stage.state),
                "" if stage.would_change is None else str(stage.would_change),
                f"{when(last['when'])} {last['status']}" if last else "never",
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


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from regen import provenance

    artifacts = Path(args.artifacts) if args.artifacts else find_project(args.project).root / "artifacts"
    try:
        a, b = provenance.compare_runs(artifacts, list(args.runs))
    except provenance.ProvenanceError as exc:
        raise BadInput(str(exc)) from None
    if args.json:
        changes = provenance.compare(a, b)
        doc = {
            "a": a.get("run_id"),
            "b": b.get("run_id"),
            "changes": {k: [list(r) for r in v] for k, v in changes.items()},
        }
        print(json.dumps(doc, indent=1, default=str))
    else:
        console.print(escape(provenance.render_comparison(a, b)))
    return 0


COMMANDS = {
    "run": cmd_run,
    "facts": cmd_facts,
    "status": cmd_status,
    "plan": cmd_plan,
    "compare": cmd_compare,
    "stages": cmd_stages,
    "preflight": cmd_preflight,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``regen`` console script; returns the exit code (see ``regen --help``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = make_console()
    previous = _sigterm_as_interrupt()
    try:
        return COMMANDS[args.command](args, console)
    except BadInput as exc:
        # One line however long (a path, a variable name): a log is grepped, a wrapped message is not found.
        make_console(stderr=True).print(Text(f"regen: {exc}", style="bold red"), soft_wrap=True)
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
