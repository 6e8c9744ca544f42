"""``regen``: run, watch and inspect the regen pipeline from a shell.

    regen run [STAGE ...] [-i INVENTORY] [-e k=v] [--check]   run stages (all of regen.yml by default)
    regen facts [-i INVENTORY] [--json]                         introspect only; print the facts and plan
    regen status [RUN]                                          what the last runs did
    regen plan [-i INVENTORY] [--offline]                       what a full run would do; changes nothing
    regen compare [RUN_A [RUN_B]]                               what changed between two runs
    regen stages                                                the stages this checkout has

Exit codes (see :class:`regen.runner.ExitCode`): 0 ok, 1 error outside any task, 2 a task failed,
3 a host was unreachable, 4 bad usage or input, 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# The command needs the controller packages (the `runner` extra: ansible-runner, rich, PyYAML); the
# package itself also runs as jobs on hosts without them, so a missing one is a message, not a traceback.
try:
    from regen.cli.commands import COMMANDS, main
    from regen.cli.parser import build_parser, parse_extravars, parse_secret_env
    from regen.cli.views import LiveView, PlainView, _plan_rows, facts_tree, plan_table
except ImportError as _missing:  # pragma: no cover - exercised only where the extra is not installed
    _MISSING = _missing

    def main(argv: Sequence[str] | None = None) -> int:
        print(
            f"regen: the command needs the controller packages; {_MISSING.name or _MISSING} is missing. "
            "Install them with `pip install 'regen[runner]'` (or scripts/bootstrap.sh for the project venv).",
            file=sys.stderr,
        )
        return 1


__all__ = [
    "COMMANDS",
    "LiveView",
    "PlainView",
    "_plan_rows",
    "build_parser",
    "facts_tree",
    "main",
    "parse_extravars",
    "parse_secret_env",
    "plan_table",
]
