"""``regen plan``: what a full run would do on an inventory, without changing anything.

Three sources, none of which writes anything:

* the stages ``regen.yml`` imports, and the hosts each stage's plays select in this inventory;
* a check-mode run of the whole pipeline (``--check``; the roles are check-mode safe): a stage whose
  tasks report no change is already done and a real run would leave it alone; one that reports changes
  would do work; a stage that fails in check mode after an earlier stage would change is *blocked* (it
  needs that stage's output first), otherwise it *would fail* and the message says why;
* the facts introspection produced (from that check run, or the newest ``model_facts*.json`` in the
  artifacts) and the plan inside them, plus the last real run of each stage from runner's records.

With ``offline=True`` the check run is skipped: nothing connects to any host.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regen.runner import artifacts as _art
from regen.runner.api import RunResult, _environment, history, history_dirs, run
from regen.runner.errors import BadInput
from regen.runner.events import Event
from regen.runner.project import find_project
from regen.runner.stages import discover_stages


@dataclass
class StagePlan:
    """One stage in the plan. ``state``: done, would change, would fail, blocked, not reached, no hosts,
    not checked (offline)."""

    name: str
    tag: str
    hosts: list[str]
    state: str
    would_change: int | None = None
    message: str | None = None
    last_run: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PlanReport:
    stages: list[StagePlan] = field(default_factory=list)
    facts: dict[str, Any] | None = None
    facts_source: str | None = None
    inventory: list[str] = field(default_factory=list)
    check_run: RunResult | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def plan(self) -> dict[str, Any] | None:
        if isinstance(self.facts, Mapping) and isinstance(self.facts.get("plan"), Mapping):
            return dict(self.facts["plan"])
        if self.check_run is not None:
            return self.check_run.plan
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "inventory": self.inventory,
            "stages": [s.to_dict() for s in self.stages],
            "facts_source": self.facts_source,
            "plan": self.plan,
            "facts": self.facts,
            "check_run": self.check_run.ident if self.check_run else None,
            "check_status": self.check_run.status if self.check_run else None,
            "warnings": self.warnings,
        }


def same_inventory(recorded: Sequence[str], inventory: Path) -> bool:
    """Whether a run recorded with inventories `recorded` (runner's `-i` arguments) ran on `inventory`
    alone."""
    try:
        return bool(recorded) and {Path(p).expanduser().resolve() for p in recorded} == {inventory.resolve()}
    except (OSError, RuntimeError):
        return False


def _runs_of(
    project_dir: Path, private_data_dir: Path | None, inventory: Path, artifacts_dirs: Sequence[Path] = ()
) -> list[RunResult]:
    """The recorded runs (newest first) of this inventory only, however they were started (runner's records
    and the run history in the checkout's and the inventory's artifacts directories): runs of another
    inventory that share the runner's records or the artifacts directory say nothing about this one."""
    dirs = list(dict.fromkeys([*history_dirs(project_dir), *artifacts_dirs]))
    return [
        past
        for past in history(
            project_dir=project_dir, private_data_dir=private_data_dir, limit=50, artifacts_dirs=dirs
        )
        if same_inventory(past.inventory, inventory)
    ]


def facts_belong(
    facts: Mapping[str, Any], hostvars: Mapping[str, Mapping[str, Any]], runs: Sequence[RunResult]
) -> bool:
    """Whether a facts document describes this inventory: its host is one of the inventory's (introspecting
    the model the inventory names there), or, for documents without a host, a run of this inventory
    produced exactly it."""
    host = facts.get("host")
    if isinstance(host, str):
        if host not in hostvars:
            return False
        model = hostvars[host].get("regen_model_path")
        return not (isinstance(model, str) and model and facts.get("model_path") not in (None, model))
    return any(past.facts == facts for past in runs)


def _last_runs(runs: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    last: dict[str, dict[str, Any]] = {}
    for past in runs:
        if past.check:
            continue
        for stage in past.stages:
            if stage.name not in last and stage.status not in ("not run", "no hosts"):
                last[stage.name] = {
                    "ident": past.ident,
                    "when": stage.finished or past.started,
                    "status": stage.status,
                }
    return last


def plan(
    *,
    inventory: str | os.PathLike[str] | None = None,
    extravars: Mapping[str, Any] | None = None,
    limit: str | None = None,
    offline: bool = False,
    on_event: Callable[[Event], None] | None = None,
    project_dir: str | os.PathLike[str] | None = None,
    private_data_dir: str | os.PathLike[str] | None = None,
    **run_kwargs: Any,
) -> PlanReport:
    """What a full run would do (see the module docstring). Changes nothing, on any host."""
    project = find_project(project_dir)
    stages = [s for s in discover_stages(project.root) if not s.standalone]
    inventory_path = project.resolve_inventory(inventory)
    report = PlanReport(inventory=[str(inventory_path)])
    env = {**os.environ, **_environment(project, None, None)}
    patterns = sorted({p.hosts for s in stages for p in s.plays})
    try:
        query = _art.inventory_query(
            [inventory_path],
            env=env,
            limit=limit,
            extravars=extravars,
            names=("regen_artifacts_dir", "regen_work_dir", "regen_model_path"),
            patterns=patterns,
        )
    except BadInput:
        raise  # an inventory Ansible cannot parse: the plan of it would be a plan of nothing
    except Exception as exc:
        report.warnings.append(str(exc))
        query = {"hosts": {}, "patterns": {}}
    hosts_of = {
        s.name: sorted({h for p in s.plays for h in query["patterns"].get(p.hosts, [])}) for s in stages
    }
    pdd = Path(private_data_dir).expanduser().resolve() if private_data_dir else None
    runs = _runs_of(project.root, pdd, inventory_path, _art.data_roots(query["hosts"])[0])
    last = _last_runs(runs)

    check: RunResult | None = None
    if not offline:
        check = run(
            None,
            inventory=inventory_path,
            extravars=extravars,
            limit=limit,
            check=True,
            on_event=on_event,
            project_dir=project.root,
            private_data_dir=pdd,
            hostvars=query["hosts"] if query["hosts"] else None,
            **run_kwargs,
        )
        report.check_run = check
    by_name = {s.name: s for s in check.stages} if check else {}
    earlier_changes: list[str] = []
    for stage in stages:
        entry = StagePlan(
            name=stage.name,
            tag=stage.tag,
            hosts=hosts_of.get(stage.name, []),
            state="not checked",
            last_run=last.get(stage.name),
        )
        if not entry.hosts and query["patterns"]:
            entry.state = "no hosts"
        elif check is not None:
            summary = by_name.get(stage.name)
            if summary is None or summary.status == "not run":
                entry.state = "not reached"
            elif summary.status == "no hosts":
                entry.state = "no hosts"
            elif summary.status in ("failed", "canceled"):
                failure = next((f for f in check.failures if f.stage == stage.name), None)
                entry.message = failure.message if failure else check.error
                entry.state = "blocked" if earlier_changes else "would fail"
                if earlier_changes:
                    entry.message = (
                        f"needs {', '.join(earlier_changes)} first; in check mode: {entry.message}"
                    )
            else:
                entry.would_change = summary.counts.changed
                entry.state = "would change" if summary.counts.changed else "done"
                if summary.counts.changed:
                    earlier_changes.append(stage.name)
        report.stages.append(entry)

    if check is not None and check.facts is not None:
        report.facts, report.facts_source = (
            check.facts,
            "check run" if check.facts_source == "run" else check.facts_source,
        )
    else:
        _offline_facts(report, query["hosts"], runs, inventory_path)
    return report


def _offline_facts(
    report: PlanReport, hostvars: Mapping[str, Mapping[str, Any]], runs: Sequence[RunResult], inventory: Path
) -> None:
    """The facts of this inventory without a check run: the newest facts file in its artifacts directories
    when it describes this inventory, else the newest facts a recorded run of this inventory produced.
    Both inventories of a checkout write `<checkout>/artifacts` by default, so the file alone proves
    nothing."""
    artifact_dirs, _ = _art.data_roots(hostvars)
    found = _art.collect_artifacts(artifact_dirs).facts
    foreign = None
    if found:
        newest = max(found, key=lambda p: p.stat().st_mtime)
        facts = _art.read_facts_file(newest)
        if facts is not None and facts_belong(facts, hostvars, runs):
            report.facts, report.facts_source = facts, str(newest)
            return
        if facts is not None:
            foreign = (newest, facts)
    for past in runs:
        if past.facts is not None:
            report.facts, report.facts_source = dict(past.facts), f"run {past.ident} ({past.artifact_dir})"
            break
    if foreign is not None:
        path, facts = foreign
        report.warnings.append(
            f"{path} describes {facts.get('host') or 'another run'} "
            f"({facts.get('model_path') or 'model ?'}), not a run of {inventory}: it is not used; run "
            f"`regen facts -i {inventory}` to introspect this inventory"
        )
