"""What a run left behind: regen's data artifacts, and ansible-runner's record of each run.

Data artifacts are what the stages record in ``regen_artifacts_dir`` on the controller (facts JSON,
environment manifests, the jobs' final status, tokenize stats, training records; `regen.records` is
the table of where): the listing reads those records, and follows them to what they name (the
generation job's output directory), instead of guessing from file names. Live job progress is read
from the work directory of hosts the controller can read directly (``connection: local``).

Runner records live in ``<private_data_dir>/artifacts/<ident>/`` (``status``, ``rc``, ``command``,
``job_events/``); regen adds ``regen_summary.json`` at the end of a run, and :func:`load_run` rebuilds
the same summary from the events when it is missing (a run that was killed).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from regen import records
from regen.fsio import read_json_object
from regen.runner.errors import BadInput, ExitCode

SUMMARY_FILE = "regen_summary.json"
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


@dataclass
class Artifacts:
    """Paths of what the stages recorded, found after a run (lists are sorted, possibly empty).

    `completions` are the generation jobs' output directories (from their recorded status), `tokenized`
    the tokenize stats and histograms, `checkpoints` the training runs' checkpoint lists.
    """

    facts: list[Path] = field(default_factory=list)
    environment_manifests: list[Path] = field(default_factory=list)
    completions: list[Path] = field(default_factory=list)
    tokenized: list[Path] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    status_files: list[Path] = field(default_factory=list)
    roots: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[str]]:
        return {k: [str(p) for p in v] for k, v in self.__dict__.items()}

    def __bool__(self) -> bool:
        return any(
            getattr(self, k)
            for k in (
                "facts",
                "environment_manifests",
                "completions",
                "tokenized",
                "checkpoints",
                "status_files",
            )
        )


def host_is_local(hostname: str, variables: Mapping[str, Any]) -> bool:
    if variables.get("ansible_connection") == "local":
        return True
    address = variables.get("ansible_host") or hostname
    return variables.get("ansible_connection") in (None, "") and address in _LOOPBACK


def inventory_query(
    inventory: Sequence[Path],
    *,
    env: Mapping[str, str],
    limit: str | None = None,
    extravars: Mapping[str, Any] | None = None,
    names: Iterable[str] = (),
    patterns: Iterable[str] = (),
    timeout: float = 60,
) -> dict[str, Any]:
    """Ask Ansible itself about the inventory (see ``_ansible_helper``): ``{"hosts": {host: {var: value}},
    "patterns": {pattern: [host, ...]}}``, variables templated, extra vars on top."""
    request = {
        "inventory": [str(p) for p in inventory],
        "limit": limit,
        "pattern": "all",
        "extravars": dict(extravars or {}),
        "patterns": list(patterns),
        "names": sorted({"ansible_connection", "ansible_host", *names}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "regen.runner._ansible_helper", "hostvars"],
        input=json.dumps(request, default=str),
        capture_output=True,
        text=True,
        env=dict(env),
        timeout=timeout,
        check=False,
    )
    if proc.returncode == ExitCode.BAD_INPUT:  # _ansible_helper: Ansible cannot parse the inventory
        # a broken inventory is the caller's input, not a passing trouble: no command goes on without it
        raise BadInput(proc.stderr.strip() or "the inventory cannot be read")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not read the inventory: {last}")
    return json.loads(proc.stdout)


def inventory_vars(
    inventory: Sequence[Path],
    *,
    env: Mapping[str, str],
    limit: str | None = None,
    extravars: Mapping[str, Any] | None = None,
    names: Iterable[str] = (),
) -> dict[str, dict[str, Any]]:
    """Inventory variables per host (see :func:`inventory_query`)."""
    return inventory_query(inventory, env=env, limit=limit, extravars=extravars, names=names)["hosts"]


def data_roots(hostvars: Mapping[str, Mapping[str, Any]]) -> tuple[list[Path], list[Path]]:
    """(controller artifact dirs, readable work dirs) from each host's ``regen_artifacts_dir`` and
    ``regen_work_dir``."""
    artifact_dirs: list[Path] = []
    work_dirs: list[Path] = []
    for host, variables in hostvars.items():
        art = variables.get("regen_artifacts_dir")
        if isinstance(art, str) and art and Path(art) not in artifact_dirs:
            artifact_dirs.append(Path(art))
        work = variables.get("regen_work_dir")
        if isinstance(work, str) and work and host_is_local(host, variables) and Path(work) not in work_dirs:
            work_dirs.append(Path(work))
    return artifact_dirs, work_dirs


def collect_artifacts(artifact_dirs: Iterable[Path]) -> Artifacts:
    """What the stages recorded in the controller's artifact directories (`regen.records` says where):
    facts, environment manifests, the job status files, and what they point at (the generation job's
    output directory), the tokenize stats and the training checkpoint lists. Nothing is guessed from
    file names, and no host's work directory is walked."""
    found = Artifacts()
    for root in artifact_dirs:
        if not root.is_dir():
            continue
        found.roots.append(root)
        found.facts += records.find(root, records.FACTS)
        found.environment_manifests += records.find(root, records.ENVIRONMENT_MANIFESTS)
        generation = records.find(root, records.GENERATION_STATUSES)
        found.status_files += generation + records.find(root, records.TRAINING_STATUSES)
        for path in generation:
            output_dir = (read_json_object(path) or {}).get("output_dir")
            if isinstance(output_dir, str) and Path(output_dir).is_dir():
                found.completions.append(Path(output_dir))
        found.tokenized += [p for pattern in records.RECORDS["tokenize"] for p in records.find(root, pattern)]
        found.checkpoints += records.find(root, records.TRAINING_CHECKPOINTS)
    for key in ("facts", "environment_manifests", "completions", "tokenized", "checkpoints", "status_files"):
        setattr(found, key, sorted(set(getattr(found, key))))
    return found


def read_facts_file(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --- runner records -------------------------------------------------------------------------------


def load_job_events(artifact_dir: Path) -> list[dict[str, Any]]:
    """A run's raw events in order; unreadable (partial) event files are skipped."""
    events_dir = artifact_dir / "job_events"
    events: list[dict[str, Any]] = []
    if not events_dir.is_dir():
        return events
    for path in events_dir.glob("*.json"):
        if path.name.endswith("-partial.json"):
            continue
        try:
            events.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    events.sort(key=lambda e: e.get("counter") or 0)
    return events


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def run_dirs(private_data_dir: Path) -> list[Path]:
    """Runner artifact directories, newest first."""
    base = private_data_dir / "artifacts"
    if not base.is_dir():
        return []
    dirs = [p for p in base.iterdir() if p.is_dir()]
    return sorted(dirs, key=lambda p: p.stat().st_mtime, reverse=True)


def command_info(artifact_dir: Path) -> dict[str, Any]:
    """Tags, check mode, inventory, limit and playbook from runner's recorded command line."""
    try:
        command = json.loads((artifact_dir / "command").read_text(encoding="utf-8")).get("command") or []
    except (OSError, ValueError):
        return {}
    info: dict[str, Any] = {
        "check": "--check" in command or "-C" in command,
        "tags": [],
        "inventory": [],
        "limit": None,
        "playbook": command[-1] if command else None,
    }
    for flag, value in itertools.pairwise(command):
        if flag == "--tags":
            info["tags"].extend(t for t in value.split(",") if t)
        elif flag == "-i":
            info["inventory"].append(value)
        elif flag == "--limit":
            info["limit"] = value
    return info


def last_activity(artifact_dir: Path) -> float:
    """When a run last wrote an event (or its record was created), as a timestamp."""
    times = [artifact_dir.stat().st_mtime] if artifact_dir.exists() else [0.0]
    events = artifact_dir / "job_events"
    if events.is_dir():
        times.append(events.stat().st_mtime)
    return max(times)


def file_time(path: Path) -> str | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")
    except OSError:
        return None
