"""Real ``ansible-playbook`` runs for tests: environment, the run and its PLAY RECAP, a localhost inventory.

``run_playbook("playbooks/x.yml", "--check")`` runs the project venv's ``ansible-playbook`` in the repo root
with ``ansible_env()`` and returns a `PlaybookRun`: the exit code, the output and the recap counts per host.
Asserting on them is left to the test. ``localhost_inventory(path, variables={...})`` writes an inventory
that names only localhost (connection local), so a run with it cannot reach any other host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the project venv's bin: ansible-playbook, ansible, ansible-doc

# One PLAY RECAP line: "host : ok=3 changed=1 unreachable=0 failed=0 skipped=2 rescued=0 ignored=0".
_RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*(?P<counts>ok=\d+\s+changed=\d+\s+unreachable=\d+\s+failed=\d+(?:[ \t]+\w+=\d+)*)",
    re.MULTILINE,
)
_COUNT = re.compile(r"(\w+)=(\d+)")


def local_inventory_vars(*names: str) -> dict[str, Any]:
    """The local inventory's values of ``names`` (inventory/local/group_vars/all.yml): what the demo model
    needs differently from a production model, for tests that serve it through an inventory of their own."""
    values = yaml.safe_load((ROOT / "inventory" / "local" / "group_vars" / "all.yml").read_text())
    return {name: values[name] for name in names}


# What serving the demo model needs (its answers cannot pass the quality gate's probes).
DEMO_MODEL_SERVING_VARS = ("sglang_server_quality_not_applicable_reason",)


def ansible_env(**extra: str) -> dict[str, str]:
    """The caller's environment plus the repo's ansible.cfg, the venv's bin first on PATH and no colour.

    ``extra`` adds or overrides variables, e.g. ``ANSIBLE_CALLBACK_RESULT_FORMAT="json"``.
    """
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        **extra,
    }


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """Counts per host from every PLAY RECAP line in ``output``; a host's last line wins.

    Keys are Ansible's own: ok, changed, unreachable, failed, skipped, rescued, ignored (``ok`` includes
    ``changed``). With several playbooks on one command line each recap counts the whole run so far, so the
    last one is the total.
    """
    return {
        m["host"]: {key: int(value) for key, value in _COUNT.findall(m["counts"])}
        for m in _RECAP.finditer(output)
    }


@dataclass(frozen=True)
class PlaybookRun:
    """One finished ``ansible-playbook`` run."""

    returncode: int
    stdout: str
    stderr: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def output(self) -> str:
        """stdout followed by stderr, where a failure's message may be."""
        return self.stdout + self.stderr

    def counts(self, host: str = "localhost") -> dict[str, int]:
        """The recap counts of ``host``; fails (with the output's tail) when the run printed none for it."""
        assert host in self.recap, self.output[-4000:]
        return self.recap[host]


def run_playbook(
    playbook: str | Path | Sequence[str | Path],
    *args: str,
    inventory: str | Path | None = "inventory/local",
    extra_vars: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> PlaybookRun:
    """Run ``ansible-playbook -i INVENTORY PLAYBOOK... [-e JSON] ARGS...`` in the repo root.

    ``playbook`` is one path or several (run in order, one command). ``inventory=None`` leaves ``-i`` to
    ``args`` (or to ansible.cfg's default). ``extra_vars`` goes as one JSON ``-e``, before ``args``, so a
    later ``-e`` in ``args`` overrides it. ``env`` defaults to `ansible_env()`; ``timeout`` (seconds)
    raises ``subprocess.TimeoutExpired``, None waits for as long as it takes.
    """
    playbooks = [playbook] if isinstance(playbook, str | Path) else list(playbook)
    command = [
        str(BIN / "ansible-playbook"),
        *(["-i", str(inventory)] if inventory is not None else []),
        *(str(path) for path in playbooks),
        *(["-e", json.dumps(dict(extra_vars))] if extra_vars is not None else []),
        *args,
    ]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env=dict(env) if env is not None else ansible_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    return PlaybookRun(
        returncode=result.returncode,
        stdout=result.stdout,
        stderr=result.stderr,
        recap=parse_recap(result.stdout + result.stderr),
    )


def localhost_inventory(
    path: Path,
    *,
    groups: Iterable[str] = ("regen_serve",),
    variables: Mapping[str, Any] | None = None,
    python: str | Path = sys.executable,
) -> Path:
    """Write a YAML inventory at ``path`` whose only host is localhost, and return ``path``.

    localhost uses the local connection and ``python`` (default: the interpreter running the tests) for
    modules; it is a member of each of ``groups``; ``variables`` become ``all`` vars.
    """
    localhost = {"ansible_connection": "local", "ansible_python_interpreter": str(python)}
    inventory = {
        "all": {
            "hosts": {"localhost": localhost},
            "children": {group: {"hosts": {"localhost": None}} for group in groups},
            "vars": dict(variables or {}),
        }
    }
    path.write_text(yaml.safe_dump(inventory))
    return path
