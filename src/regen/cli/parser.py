"""The `regen` command line: its parser, flags and the parsing of -e and --secret-env values."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from regen import package_version
from regen.runner import (
    BadInput,
    ExitCode,
)

EXIT_CODES = """exit codes:
  0    everything ran
  1    ansible or regen failed outside any task (the message says why)
  2    a task failed: its stage failed (the summary names stage, task, host and message)
  3    a host was unreachable
  4    bad usage or input: unknown stage, missing inventory, bad -e, a playbook that does not parse
  130  interrupted (Ctrl-C): the jobs the run started on this machine are stopped (they keep what
       they wrote; the next run resumes them); on remote hosts they go on, and regen says how to stop them
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
    parser.add_argument("--version", action="version", version=f"regen {package_version()}")
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
        help="run introspection only and print the model facts and plan (or, with --model-path, read a "
        "model directory here: no inventory, no SSH, no GPU)",
        description="Without --model-path: run the introspect stage on the inventory and print its facts "
        "and plan. With --model-path DIR: read DIR on this machine (config.json is enough; the "
        "tokenizer-dependent parts are then unknown) and plan it for the GPUs given by --gpus, "
        "--gpu-memory-gib and --compute-capability (none: the CPU), without any playbook run.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _inventory_args(p_facts)
    p_facts.add_argument(
        "--model-path",
        metavar="DIR",
        help="a model directory on this machine: print its facts and plan without inventory, SSH or GPU",
    )
    p_facts.add_argument(
        "--gpus", type=int, metavar="N", help="with --model-path: plan for N GPUs (default: none, the CPU)"
    )
    p_facts.add_argument(
        "--gpu-memory-gib", type=float, metavar="G", help="with --model-path: memory of each GPU in GiB"
    )
    p_facts.add_argument(
        "--compute-capability",
        metavar="X.Y",
        help="with --model-path: the GPUs' compute capability, e.g. 12.0 (RTX PRO 6000), 10.0 (B200), 9.0",
    )
    p_facts.add_argument(
        "--prompt-rows",
        type=int,
        metavar="N",
        help="with --model-path: the number of prompts the run will regenerate, for the run estimate "
        "(the prompts stage's manifest gives it in a real run)",
    )
    p_facts.add_argument(
        "--simulation-csv",
        metavar="FILE",
        help="with --model-path: an aiconfigurator best_config_topn.csv for these GPUs, shown beside the "
        "plan's layout and used for the run estimate's throughput",
    )
    p_facts.add_argument(
        "--tokenizer-mode",
        choices=("raw_files", "auto", "library"),
        default="raw_files",
        help="with --model-path: read the tokenizer from its files (default; runs no model code), or try "
        "transformers first (auto), or require it (library)",
    )
    p_facts.add_argument("--json", action="store_true", help="print the facts document as JSON")
    _common(p_facts)

    p_status = sub.add_parser(
        "status", help="what the last runs did (regen run, make regen, ansible-playbook: one history)"
    )
    p_status.add_argument(
        "run", nargs="?", metavar="RUN", help="one run's id (or a unique prefix) for details"
    )
    p_status.add_argument(
        "-n", "--last", type=int, default=10, metavar="N", help="how many runs (default 10)"
    )
    p_status.add_argument("--json", action="store_true", help="print JSON")
    p_status.add_argument(
        "--artifacts",
        metavar="DIR",
        action="append",
        help="an artifacts directory whose run history (runs/history: make regen and ansible-playbook runs "
        "too) to list beside runner's records (repeatable; default: the checkout's artifacts/ and the "
        "directories one level below it)",
    )
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

    p_compare = sub.add_parser(
        "compare",
        help="what changed between two runs' manifests (inputs, settings, versions, results, timings)",
    )
    p_compare.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="run ids under ARTIFACTS/runs (or unique prefixes, or manifest paths); none: the last two; "
        "one: that run against the latest",
    )
    p_compare.add_argument(
        "--artifacts",
        metavar="DIR",
        help="the artifacts directory (default: the checkout's artifacts/, the embedded default's)",
    )
    p_compare.add_argument("--json", action="store_true", help="print the changes as JSON")
    _common(p_compare)

    p_stages = sub.add_parser("stages", help="list the stages of this checkout and their tags")
    p_stages.add_argument("--json", action="store_true", help="print JSON")
    _common(p_stages)

    from regen.cli.preflight import add_parser as add_preflight_parser

    add_preflight_parser(sub)
    return parser
