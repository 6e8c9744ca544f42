"""`regen preflight`: run the preflight stage alone and print its table (a verdict and the fix per line)."""

from __future__ import annotations

import argparse
import json
import queue
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

VERDICT_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


def add_parser(sub: Any) -> None:
    """Register `regen preflight` on the subcommand set of regen's parser."""
    from regen.cli.parser import EXIT_CODES, _common, _inventory_args

    p = sub.add_parser(
        "preflight",
        help="check every host against what a run needs (GPUs, driver, devices, /dev/shm, memlock, disk, "
        "ports, network): one table with a verdict and the fix per line; changes nothing",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _inventory_args(p)
    p.add_argument("--json", action="store_true", help="print the tables as JSON")
    p.add_argument("--plain", action="store_true", help="plain lines instead of the live view")
    _common(p)


def read_tables(report_dir: Path) -> list[dict[str, Any]]:
    """The per-host tables the preflight role wrote (one JSON document per host), by host name."""
    tables = []
    for path in sorted(report_dir.glob("*.json")):
        tables.append(json.loads(path.read_text(encoding="utf-8")))
    return tables


def render(console: Console, tables: list[dict[str, Any]]) -> None:
    for doc in tables:
        table = Table(
            title=f"preflight · {doc['host']} · {doc['verdict']}",
            title_justify="left",
            show_edge=False,
            pad_edge=False,
        )
        for column in ("check", "verdict", "value", "need", "fix"):
            table.add_column(column, overflow="fold")
        for row in doc["rows"]:
            table.add_row(
                row["check"],
                Text(row["verdict"], style=VERDICT_STYLE.get(row["verdict"], "")),
                row["value"],
                row.get("need", ""),
                row.get("fix", ""),
            )
        console.print(table)


def cmd_preflight(args: argparse.Namespace, console: Console) -> int:
    from regen.cli.commands import _start
    from regen.cli.views import make_console, print_summary, watch_run
    from regen.runner import Event

    with tempfile.TemporaryDirectory(prefix="regen-preflight-") as tmp:
        report_dir = Path(tmp)
        args.extra_vars = [*args.extra_vars, json.dumps({"preflight_report_dir": str(report_dir)})]
        events: queue.Queue[Event] = queue.Queue()
        handle = _start(args, ["preflight"], events_queue=events)
        err_console = make_console(stderr=True) if args.json else console
        result = watch_run(
            handle,
            err_console,
            plain=args.plain or args.json,
            events_json=False,
            title="regen preflight",
            stages=[s.name for s in handle.stages],
            events_queue=events,
        )
        tables = read_tables(report_dir)
    if args.json:
        print(json.dumps(tables, indent=1))
    elif tables:
        render(console, tables)
    if not tables or int(result.exit_code):
        print_summary(err_console, result)
    return int(result.exit_code)
