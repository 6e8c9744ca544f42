"""The README's first command, end to end: the whole pipeline on the embedded default, twice.

The first run builds the demo model and runs every stage on localhost; the second must find all of it
done and report changed=0 on every host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e

RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unr>\d+)"
    r"\s+failed=(?P<failed>\d+)",
    re.MULTILINE,
)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
    }


def _playbook(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "inventory/local", path],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def _run_pipeline() -> tuple[str, dict[str, dict[str, int]]]:
    result = _playbook("regen.yml")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    counters = ("ok", "changed", "unr", "failed")
    recap = {m["host"]: {key: int(m[key]) for key in counters} for m in RECAP.finditer(output)}
    assert recap, output[-3000:]
    return output, recap


def test_pipeline_runs_and_second_run_changes_nothing(stop_local_server_afterwards) -> None:
    output, first = _run_pipeline()
    assert all(stats["failed"] == 0 and stats["unr"] == 0 for stats in first.values()), first
    # The run ends with the summary table, one row per stage that produced something.
    summary = output[output.index("regen summary") :]
    for row in ("model", "plan", "serve", "generate", "tokenize", "train"):
        assert re.search(rf"^\s+{row}\s", summary, re.MULTILINE), (row, summary[:2000])
    output, second = _run_pipeline()
    assert all(stats["changed"] == 0 for stats in second.values()), (second, output[-6000:])
