"""Run regen's pipeline through ansible-runner: :func:`run`, :func:`run_async` and the result they give.

How runner is configured, and why (each a deliberate choice; runner's defaults differ):

* ``ANSIBLE_CONFIG`` is the checkout's ``ansible.cfg`` (runner would not read it from the project dir),
  so roles, ``library/``, ``module_utils/`` and collections resolve as with ``ansible-playbook``.
* runner forces its ``awx_display`` stdout callback to get events; regen points it at the callback that
  ``ansible.cfg`` names (``ORIGINAL_STDOUT_CALLBACK``) so the recorded stdout reads the same.
* runner would move the fact cache into each run's artifact directory (then rotate it away); regen keeps
  the checkout's jsonfile cache (made absolute), shared with ``ansible-playbook`` and ``gathering=smart``.
* runner turns host key checking off unless told otherwise; regen keeps Ansible's default (on) or what
  ``ansible.cfg`` / the environment say.
* ``private_data_dir`` is absolute (default ``<checkout>/.cache/runner``), runner records are rotated
  (``rotate_artifacts``, 20 kept) and ``suppress_env_files`` keeps runner from writing extra vars,
  passwords and environment to ``env/``. Secrets go through :mod:`regen.runner.secrets`.
* regen passes its own ``cancel_callback``, so runner never installs SIGINT/SIGTERM handlers in the
  caller's process. Cancelling kills the ansible-playbook process group, then stops the jobs the run
  started on hosts the controller reads (SIGTERM: they keep what they wrote, the next run resumes them);
  jobs on remote hosts go on, and the result's warnings say so and how to stop them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets as _random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ansible_runner
import psutil

from regen import procs
from regen.fsio import atomic_write_text
from regen.runner import artifacts as _art
from regen.runner.errors import BadInput, ExitCode
from regen.runner.events import (
    Event,
    EventParser,
    FactsProduced,
    HostStats,
    JobProgress,
    NoHostsMatched,
    Output,
    RunStats,
    StageCounts,
    StageFinished,
    StageStarted,
    TaskResult,
    TaskStatus,
    parse_events,
    strip_ansi,
)
from regen.runner.progress import StatusWatcher
from regen.runner.project import Project, ansible_bin_dir, find_project
from regen.runner.secrets import VAULT_ID, VAULT_PROMPT, Redactor, encrypt_vars, scrub_command_file
from regen.runner.stages import Stage, discover_stages, play_stage_map, select_stages

log = logging.getLogger("regen.runner")

DATA_VARS = ("regen_artifacts_dir", "regen_work_dir")
_FILE_CACHES = {"jsonfile", "yaml", "pickle", "ansible.builtin.jsonfile"}
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# How long a job stopped by a cancel gets to write what it has before SIGKILL: the generate job's own
# --stop-grace (30 s by default) for the requests in flight, and a margin.
JOB_STOP_GRACE_S = 40.0


# --- results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailedTask:
    """The task that failed a host (or the host it could not reach), with Ansible's message."""

    stage: str | None
    play: str | None
    task: str
    host: str
    message: str
    action: str | None = None
    path: str | None = None
    unreachable: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StageSummary:
    """One stage of a run. ``status``: ok, changed, failed, canceled, no hosts, not run."""

    name: str
    status: str
    counts: StageCounts = field(default_factory=StageCounts)
    started: str | None = None
    finished: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "counts": dict(self.counts.__dict__),
            "started": self.started,
            "finished": self.finished,
        }


@dataclass
class RunResult:
    """What a run did. ``status`` is ansible-runner's (successful, failed, canceled, timeout) or ``error``."""

    ident: str
    status: str
    rc: int | None
    check: bool = False
    stages: list[StageSummary] = field(default_factory=list)
    hosts: dict[str, HostStats] = field(default_factory=dict)
    facts: dict[str, Any] | None = None
    facts_source: str | None = None
    regen_facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed_task: FailedTask | None = None
    failures: list[FailedTask] = field(default_factory=list)
    artifacts: _art.Artifacts = field(default_factory=_art.Artifacts)
    artifact_dir: Path | None = None
    events: list[Event] = field(default_factory=list)
    started: str | None = None
    finished: str | None = None
    duration: float | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    inventory: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "successful"

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan introspection derived: ``facts["plan"]``, or a separate ``regen_plan`` fact."""
        if isinstance(self.facts, Mapping) and isinstance(self.facts.get("plan"), Mapping):
            return dict(self.facts["plan"])
        for facts in self.regen_facts.values():
            if isinstance(facts.get("regen_plan"), Mapping):
                return dict(facts["regen_plan"])
        return None

    @property
    def exit_code(self) -> ExitCode:
        if self.status == "successful":
            return ExitCode.OK
        if self.status == "canceled":
            return ExitCode.CANCELED
        if any(not f.unreachable for f in self.failures):
            return ExitCode.TASK_FAILED
        if self.failures:
            return ExitCode.UNREACHABLE
        if self.rc in (4, 5):  # ansible-playbook: parser error, bad or incomplete options
            return ExitCode.BAD_INPUT
        return ExitCode.ERROR

    def to_dict(self, *, include_facts: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "ident": self.ident,
            "status": self.status,
            "rc": self.rc,
            "exit_code": int(self.exit_code),
            "check": self.check,
            "started": self.started,
            "finished": self.finished,
            "duration": self.duration,
            "inventory": self.inventory,
            "tags": self.tags,
            "stages": [s.to_dict() for s in self.stages],
            "hosts": {h: dict(s.__dict__) for h, s in self.hosts.items()},
            "failed_task": self.failed_task.to_dict() if self.failed_task else None,
            "failures": [f.to_dict() for f in self.failures],
            "artifacts": self.artifacts.to_dict(),
            "artifact_dir": str(self.artifact_dir) if self.artifact_dir else None,
            "error": self.error,
            "warnings": self.warnings,
        }
        if include_facts:
            data["facts"] = self.facts
            data["facts_source"] = self.facts_source
        return data


def _fatal_failures(records: Sequence[Event], hosts: Mapping[str, HostStats] | None) -> list[FailedTask]:
    """The failure that stopped each host: an unignored failed/unreachable result after which the host
    ran nothing more (Ansible stops a host there unless a ``rescue`` handles it).

    With a recap, only hosts it counts as failed or unreachable.
    """
    last: dict[str, TaskResult] = {}
    for record in records:
        if not isinstance(record, TaskResult):
            continue
        if not record.ignored and record.status in (TaskStatus.FAILED, TaskStatus.UNREACHABLE):
            last[record.host] = record
        else:
            last.pop(record.host, None)  # the host went on: its earlier failure was rescued
    if hosts is not None:
        last = {h: r for h, r in last.items() if h in hosts and (hosts[h].failed or hosts[h].unreachable)}
    ordered = sorted(last.values(), key=lambda r: r.counter or 0)
    return [
        FailedTask(
            stage=r.stage,
            play=r.play,
            task=r.task,
            host=r.host,
            message=r.message,
            action=r.action,
            path=r.path,
            unreachable=r.status is TaskStatus.UNREACHABLE,
        )
        for r in ordered
    ]


def summarize(
    records: Sequence[Event],
    *,
    status: str,
    rc: int | None,
    ident: str,
    selected: Sequence[str] = (),
    check: bool = False,
) -> RunResult:
    """Build a :class:`RunResult` (without artifacts) from a run's records and runner's status."""
    hosts: dict[str, HostStats] | None = None
    summaries: dict[str, StageSummary] = {}
    no_hosts: set[str] = set()
    last_started: str | None = None
    regen_facts: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    warnings: list[str] = []
    for record in records:
        if isinstance(record, StageStarted):
            summaries.setdefault(record.stage, StageSummary(record.stage, "running", started=record.created))
            last_started = record.stage
        elif isinstance(record, StageFinished):
            summary = summaries.setdefault(record.stage, StageSummary(record.stage, "running"))
            summary.counts = record.counts
            summary.finished = record.created
        elif isinstance(record, NoHostsMatched) and record.stage:
            no_hosts.add(record.stage)
        elif isinstance(record, RunStats):
            hosts = record.hosts
        elif isinstance(record, FactsProduced):
            regen_facts.setdefault(record.host, {})[record.name] = record.value
        elif isinstance(record, Output):
            if record.level == "error":
                errors.append(record.text)
            elif record.level in ("warning", "deprecated"):
                warnings.append(record.text)
    failures = _fatal_failures(records, hosts)
    failed_stages = {f.stage for f in failures}
    for name, summary in summaries.items():
        c = summary.counts
        if name in failed_stages:
            summary.status = "failed"
        elif status == "canceled" and name == last_started:
            summary.status = "canceled"
        elif name in no_hosts and not (c.ok or c.changed or c.failed or c.skipped or c.unreachable):
            summary.status = "no hosts"
        else:
            summary.status = "changed" if c.changed else "ok"
    stages = list(summaries.values())
    stages.extend(StageSummary(name, "not run") for name in selected if name not in summaries)
    facts_by_host = {
        h: f["regen_model_facts"]
        for h, f in regen_facts.items()
        if isinstance(f.get("regen_model_facts"), Mapping)
    }
    facts = next(iter(facts_by_host.values()), None)
    started = next((r.created for r in records if r.created), None)
    finished = next((r.created for r in reversed(records) if r.created), None)
    error = None
    if status not in ("successful", "canceled") and not failures:
        tail = [r.text for r in records if isinstance(r, Output) and r.level in ("error", "verbose")][-8:]
        error = "\n".join(errors or tail) or f"ansible-playbook exited with rc={rc}"
    return RunResult(
        ident=ident,
        status=status,
        rc=rc,
        check=check,
        stages=stages,
        hosts=hosts or {},
        facts=dict(facts) if facts is not None else None,
        facts_source="run" if facts else None,
        regen_facts=regen_facts,
        failed_task=failures[0] if failures else None,
        failures=failures,
        events=list(records),
        started=started,
        finished=finished,
        error=error,
        warnings=warnings,
    )


# --- the run itself -------------------------------------------------------------------------------


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


def _check_vars(name: str, variables: Mapping[str, Any] | None) -> dict[str, Any]:
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise BadInput(
            f"{name} must be a mapping of variable names to values, got {type(variables).__name__}"
        )
    for key in variables:
        if not isinstance(key, str) or not _VAR_NAME.fullmatch(key):
            raise BadInput(f"{name}: {key!r} is not a valid Ansible variable name")
    try:
        json.dumps(dict(variables))
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{name} must be JSON-serialisable: {exc}") from None
    return dict(variables)


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in (p.strip() for p in value.split(",")) if v]
    return [str(v) for v in value if str(v).strip()]


def _make_ident(stage_names: Sequence[str]) -> str:
    label = "-".join(stage_names)[:40] if stage_names else "all"
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{re.sub(r'[^A-Za-z0-9_-]', '_', label)}-{_random.token_hex(2)}"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_text(path, text, mode=0o600, durable=False)


class RunHandle:
    """A run in progress (from :func:`run_async`). ``cancel()`` stops it; ``wait()`` gives its result."""

    def __init__(
        self,
        *,
        project: Project,
        stages: list[Stage],
        playbook: Path,
        runner_kwargs: dict[str, Any],
        env: dict[str, str],
        inventory: list[Path],
        limit: str | None,
        extravars: dict[str, Any],
        on_event: Callable[[Event], None] | None,
        redactor: Redactor,
        secret_values: list[str],
        secret_file: Path | None,
        check: bool,
        tags: list[str],
        watch_interval: float,
        selected: bool,
    ) -> None:
        self.project = project
        self.stages = stages
        self.playbook = playbook
        self.ident: str = runner_kwargs["ident"]
        self.private_data_dir = Path(runner_kwargs["private_data_dir"])
        self.artifact_dir = self.private_data_dir / "artifacts" / self.ident
        self._kwargs = runner_kwargs
        self._env = env
        self._inventory = inventory
        self._limit = limit
        self._extravars = extravars
        self._on_event = on_event
        self._redactor = redactor
        self._secret_values = secret_values
        self._secret_file = secret_file
        self._check = check
        self._tags = tags
        self._watch_interval = watch_interval
        self._parser = EventParser(
            play_stage_map(discover_stages(project.root)),
            selected=[s.name for s in stages] if selected else None,
        )
        self._lock = threading.Lock()
        self._emit_lock = threading.Lock()
        self._events: list[Event] = []
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._runner_done = threading.Event()
        self._hostvars: dict[str, dict[str, Any]] | None = None
        self._hostvars_ready = threading.Event()
        self._ansible_pid: int | None = None
        self._doomed: list[psutil.Process] | None = None
        # status files of jobs this run was seen running on hosts the controller reads (path -> pid)
        self._jobs: dict[Path, int] = {}
        self._job_notes: list[str] = []
        self._stdout = None
        self._result: RunResult | None = None
        self._started = time.time()
        self._thread = threading.Thread(target=self._main, name=f"regen-run-{self.ident}", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name=f"regen-watch-{self.ident}", daemon=True)

    # public -----------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the run to stop; it ends within about half a second with status ``canceled``."""
        self._cancel.set()

    @property
    def canceled(self) -> bool:
        return self._cancel.is_set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends and return its :class:`RunResult` (TimeoutError if it does not)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"run {self.ident} still running after {timeout} s")
        assert self._result is not None
        return self._result

    @property
    def result(self) -> RunResult | None:
        return self._result

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    # internals --------------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread.start()
        self._watcher.start()

    def _emit(self, records: Iterable[Event]) -> None:
        # Two threads produce records (runner's events, the status-file watcher): one at a time, so
        # ``events`` and the ``on_event`` calls see the same order.
        for record in records:
            with self._emit_lock:
                with self._lock:
                    self._events.append(record)
                if self._on_event is not None:
                    try:
                        self._on_event(record)
                    except Exception:  # a broken callback must not break the run
                        log.exception("on_event callback raised on %s", record.kind)

    def _runner_event(self, data: dict[str, Any]) -> bool:
        if self._ansible_pid is None and isinstance(data.get("pid"), int):
            self._ansible_pid = data["pid"]  # the callback runs in ansible-playbook's main process
        self._redactor.scrub(data)
        text = data.get("stdout")
        if text and self._stdout is not None:
            self._stdout.write(strip_ansi(text) + "\n")
            self._stdout.flush()
        self._emit(self._parser.feed(data))
        return True

    def _should_cancel(self) -> bool:
        """runner's cancel_callback: on cancel, note ansible-playbook's workers before runner kills it."""
        if not self._cancel.is_set():
            return False
        if self._doomed is None and self._ansible_pid is not None:
            self._doomed = procs.descendants(self._ansible_pid)
        return True

    def _runner_status(self, data: dict[str, Any], runner_config: Any = None) -> None:
        # runner has just written artifacts/<ident>/command with the whole environment: mask secrets in it.
        if data.get("status") == "running":
            scrub_command_file(self.artifact_dir / "command", self._secret_values)

    def _resolve_hostvars(self) -> dict[str, dict[str, Any]]:
        if not self._hostvars_ready.is_set():
            try:
                self._hostvars = _art.inventory_vars(
                    self._inventory,
                    env=self._env,
                    limit=self._limit,
                    extravars=self._extravars,
                    names=DATA_VARS,
                )
            except Exception as exc:
                log.debug("inventory variables unavailable: %s", exc)
                self._hostvars = {}
            self._hostvars_ready.set()
        return self._hostvars or {}

    def _watch(self) -> None:
        hostvars = self._resolve_hostvars()
        _, work_dirs = _art.data_roots(hostvars)
        local_hosts = [h for h, v in hostvars.items() if _art.host_is_local(h, v)]
        watcher = StatusWatcher(work_dirs, since=self._started)
        host = local_hosts[0] if len(local_hosts) == 1 else None
        while True:
            stop = self._runner_done.wait(self._watch_interval)
            try:
                changes = watcher.poll()
            except OSError:
                changes = []
            with self._lock:
                for path, status in changes:
                    if not status.finished and status.pid:
                        self._jobs[path] = int(status.pid)
            self._emit(
                JobProgress(created=_now_iso(), job=status.job, host=host, status=status, source=str(path))
                for path, status in changes
            )
            if stop:
                return

    def _main(self) -> None:
        status, rc, error = "error", None, None
        try:
            self.artifact_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._stdout = open(self.artifact_dir / "stdout", "w", encoding="utf-8")  # noqa: SIM115
            os.chmod(self.artifact_dir / "stdout", 0o600)
            if self._cancel.is_set():
                status = "canceled"
            else:
                runner = ansible_runner.run(
                    **self._kwargs,
                    event_handler=self._runner_event,
                    status_handler=self._runner_status,
                    cancel_callback=self._should_cancel,
                )
                status, rc = runner.status, runner.rc
                if self._doomed:
                    procs.terminate(self._doomed)
                if status == "canceled":
                    self._stop_jobs()
        except Exception as exc:  # runner could not start: report it as the run's error, not a traceback
            log.debug("ansible-runner failed", exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._runner_done.set()
            if self._stdout is not None:
                self._stdout.close()
            self._scrub_unread_partials()
            if self._secret_file is not None:
                with contextlib.suppress(OSError):
                    self._secret_file.unlink()
        self._emit(self._parser.close(created=_now_iso()))
        self._watcher.join(timeout=30)
        result = summarize(
            self.events,
            status=status,
            rc=rc,
            ident=self.ident,
            selected=[s.name for s in self.stages],
            check=self._check,
        )
        if error:
            result.error = error
        result.warnings.extend(self._job_notes)
        result.artifact_dir = self.artifact_dir
        result.inventory = [str(p) for p in self._inventory]
        result.tags = self._tags
        result.started = result.started or datetime.fromtimestamp(self._started, UTC).isoformat()
        result.finished = _now_iso()
        result.duration = round(time.time() - self._started, 3)
        try:
            self._attach_artifacts(result)
        except Exception as exc:  # artifacts are a convenience; the run's outcome stands without them
            result.warnings.append(f"could not list artifacts: {exc}")
        with contextlib.suppress(OSError):
            _write_private(
                self.artifact_dir / _art.SUMMARY_FILE,
                json.dumps(result.to_dict(include_facts=False), indent=1, default=str),
            )
        self._result = result
        self._finished.set()

    def _stop_jobs(self) -> None:
        """After a cancel: stop the jobs this run started on hosts the controller reads (SIGTERM: a job
        writes what it has and marks its status ``interrupted``; the next run resumes it), and say plainly
        that jobs on other hosts go on, and how to stop them. Notes go to the result's warnings."""
        from regen.runner.progress import find_status_files, read_status_file

        hostvars = self._resolve_hostvars()
        _, work_dirs = _art.data_roots(hostvars)
        with self._lock:
            jobs = dict(self._jobs)
        for path in find_status_files(work_dirs):  # a job that started after the watcher's last look
            status = read_status_file(path)
            if status is not None and not status.finished and status.pid and path not in jobs:
                jobs[path] = int(status.pid)
        for path, pid in sorted(jobs.items()):
            try:
                proc = psutil.Process(pid)
                ours = proc.create_time() >= self._started - 1  # started by this run, not an older one
            except psutil.Error:
                continue
            if not ours or not procs.still_running(proc):
                continue
            procs.terminate([proc], grace=JOB_STOP_GRACE_S)
            after = read_status_file(path)
            state = after.state if after is not None else "unknown"
            self._job_notes.append(
                f"stopped the {after.job if after else 'job'} job this run started (pid {pid}; {path}: "
                f"{state}); it keeps what it wrote and the next run resumes it"
            )
        remote = sorted(h for h, v in hostvars.items() if not _art.host_is_local(h, v))
        if remote:
            self._job_notes.append(
                f"jobs this run started on {', '.join(remote)} (generate, tokenize, training) go on until "
                "they end: the next run waits for them or resumes them; to stop one now, send it SIGTERM on "
                "its host (`kill -TERM PID`, the pid is in the job's status.json under regen_work_dir): it "
                "keeps what it wrote"
            )

    def _scrub_unread_partials(self) -> None:
        # runner's callback writes each event's data to job_events/<uuid>-partial.json before runner reads,
        # scrubs (through _runner_event) and removes it; a run that was cancelled or died leaves the last
        # ones behind unscrubbed.
        if not self._redactor:
            return
        for path in (self.artifact_dir / "job_events").glob("*-partial.json*"):
            with contextlib.suppress(OSError, ValueError):
                data = self._redactor.scrub(json.loads(path.read_text(encoding="utf-8")))
                _write_private(path, json.dumps(data))

    def _attach_artifacts(self, result: RunResult) -> None:
        hostvars = self._resolve_hostvars()
        artifact_dirs, _work_dirs = _art.data_roots(hostvars)
        result.artifacts = _art.collect_artifacts(artifact_dirs)
        if result.facts is None and result.artifacts.facts:
            newest = max(result.artifacts.facts, key=lambda p: p.stat().st_mtime)
            facts = _art.read_facts_file(newest)
            if facts is not None:
                result.facts, result.facts_source = facts, str(newest)


def _environment(
    project: Project, envvars: Mapping[str, str] | None, fact_cache_dir: Path | None
) -> dict[str, str]:
    """The variables regen sets for ansible-playbook (on top of the caller's environment)."""
    env: dict[str, str] = {"ANSIBLE_CONFIG": str(project.ansible_cfg)}
    bin_dir = ansible_bin_dir()
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    callback = project.cfg_value("stdout_callback")
    if callback and "ANSIBLE_STDOUT_CALLBACK" not in os.environ:
        env["ORIGINAL_STDOUT_CALLBACK"] = callback
    # runner sets ANSIBLE_CALLBACK_PLUGINS (to add its own directory), which hides ansible.cfg's
    # callback_plugins: name the checkout's again, so the callback ansible.cfg names is found.
    plugins = project.cfg_path("callback_plugins")
    if plugins is not None:
        present = os.environ.get("ANSIBLE_CALLBACK_PLUGINS", "")
        env["ANSIBLE_CALLBACK_PLUGINS"] = os.pathsep.join(p for p in (present, str(plugins)) if p)
    if "ANSIBLE_HOST_KEY_CHECKING" not in os.environ:
        env["ANSIBLE_HOST_KEY_CHECKING"] = project.cfg_value("host_key_checking") or "True"
    plugin = project.cfg_value("fact_caching")
    if fact_cache_dir is not None:
        env["ANSIBLE_CACHE_PLUGIN"] = plugin if plugin in _FILE_CACHES else "jsonfile"
        env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(Path(fact_cache_dir).resolve())
    elif plugin in _FILE_CACHES and "ANSIBLE_CACHE_PLUGIN_CONNECTION" not in os.environ:
        connection = project.cfg_path("fact_caching_connection")
        if connection is not None:
            env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(connection)
    env.update({k: str(v) for k, v in (envvars or {}).items()})
    return env


def run_async(
    stages: str | Iterable[str] | None = None,
    *,
    inventory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    extravars: Mapping[str, Any] | None = None,
    limit: str | Iterable[str] | None = None,
    check: bool = False,
    diff: bool = False,
    tags: str | Iterable[str] | None = None,
    skip_tags: str | Iterable[str] | None = None,
    on_event: Callable[[Event], None] | None = None,
    secrets: Mapping[str, str] | None = None,
    passwords: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    envvars: Mapping[str, str] | None = None,
    project_dir: str | os.PathLike[str] | None = None,
    ansible_cfg: str | None = None,
    private_data_dir: str | os.PathLike[str] | None = None,
    fact_cache_dir: str | os.PathLike[str] | None = None,
    ident: str | None = None,
    rotate_artifacts: int = 20,
    timeout: int | None = None,
    verbosity: int = 0,
    watch_interval: float = 1.0,
    hostvars: Mapping[str, Mapping[str, Any]] | None = None,
) -> RunHandle:
    """Start a run in the background; see :func:`run` for the arguments. Returns a :class:`RunHandle`.

    Bad input (unknown stage, missing inventory, bad variables) raises :class:`BadInput` here, before
    anything starts.
    """
    project = find_project(project_dir, ansible_cfg=ansible_cfg)
    all_stages = discover_stages(project.root)
    wanted = _as_list(stages)
    chosen = select_stages(all_stages, wanted) if wanted else [s for s in all_stages if not s.standalone]
    if len(chosen) == 1 and chosen[0].standalone:
        playbook, stage_tags = chosen[0].playbook, []
    else:
        playbook, stage_tags = project.pipeline, [s.tag for s in chosen] if wanted else []
    run_tags = list(dict.fromkeys([*stage_tags, *_as_list(tags)]))
    extravars = _check_vars("extravars", extravars)
    secrets = _check_vars("secrets", secrets)
    overlap = sorted(set(extravars) & set(secrets))
    if overlap:
        raise BadInput(f"{', '.join(overlap)} given both as extra var and as secret: pass it once")
    inventories = inventory if isinstance(inventory, list | tuple) else [inventory]
    inventory_paths = [project.resolve_inventory(i) for i in inventories]
    limit_text = ",".join(_as_list(limit)) or None
    if rotate_artifacts < 1:
        raise BadInput("rotate_artifacts must keep at least 1 run (runner's 0 would keep every run forever)")

    pdd = (
        Path(private_data_dir).expanduser().resolve()
        if private_data_dir
        else project.default_private_data_dir
    )
    pdd.mkdir(parents=True, exist_ok=True, mode=0o700)
    # runner drops settings passed as an argument when env/settings is absent, so they go in that file:
    # our own stdout file (scrubbed), and a short pexpect timeout so a cancel lands within ~0.5 s.
    _write_private(
        pdd / "env" / "settings",
        json.dumps({"suppress_output_file": True, "pexpect_timeout": 0.5, "pexpect_use_poll": True}),
    )
    env = _environment(project, envvars, Path(fact_cache_dir) if fact_cache_dir else None)
    ident = ident or _make_ident([s.name for s in chosen] if wanted else [])
    # One id per run wherever it is shown: the history callback (plugins/callback/regen_history.py) records
    # this run under runner's ident, and the manifest the summary stage writes names it too.
    env["REGEN_RUN_ID"] = ident

    cmdline: list[str] = []
    if check:
        cmdline.append("--check")
    if diff:
        cmdline.append("--diff")
    pw = dict(passwords or {})
    secret_file: Path | None = None
    if secrets:
        secret_dir = pdd / "secrets"
        _prune_old(secret_dir)
        secret_file = secret_dir / f"{ident}.vault.yml"
        helper_env = {**os.environ, **env}
        pw[VAULT_PROMPT] = encrypt_vars(secrets, secret_file, env=helper_env)
        cmdline += ["--vault-id", f"{VAULT_ID}@prompt", "-e", f"@{secret_file}"]
    cmdline += list(extra_args)

    runner_kwargs: dict[str, Any] = {
        "private_data_dir": str(pdd),
        "project_dir": str(project.root),
        "playbook": str(playbook),
        "inventory": [str(p) for p in inventory_paths],
        "extravars": extravars or None,
        "limit": limit_text,
        "tags": ",".join(run_tags) or None,
        "skip_tags": ",".join(_as_list(skip_tags)) or None,
        "cmdline": " ".join(_quote(a) for a in cmdline) or None,
        "passwords": pw or None,
        "envvars": env,
        "ident": ident,
        "rotate_artifacts": rotate_artifacts,
        "suppress_env_files": True,
        "quiet": True,
        "fact_cache_type": "ansible.cfg",  # anything but runner's "jsonfile": keep the checkout's cache
        "timeout": timeout,
        "verbosity": verbosity or None,
    }
    secret_values = [str(v) for v in secrets.values()] + [str(v) for v in (passwords or {}).values()]
    if secret_values:
        secret_values.append(pw.get(VAULT_PROMPT, ""))
    handle = RunHandle(
        project=project,
        stages=chosen,
        playbook=playbook,
        runner_kwargs=runner_kwargs,
        env=env,
        inventory=inventory_paths,
        limit=limit_text,
        extravars=extravars,
        on_event=on_event,
        redactor=Redactor(secret_values),
        secret_values=secret_values,
        secret_file=secret_file,
        check=check,
        tags=run_tags,
        watch_interval=watch_interval,
        selected=bool(wanted),
    )
    if hostvars is not None:  # the caller already asked Ansible for regen_work_dir/regen_artifacts_dir
        handle._hostvars = {h: dict(v) for h, v in hostvars.items()}
        handle._hostvars_ready.set()
    handle._start()
    return handle


def run(stages: str | Iterable[str] | None = None, **kwargs: Any) -> RunResult:
    """Run regen stages (all of ``regen.yml`` when ``stages`` is None) and return a :class:`RunResult`.

    ``stages``: stage names or tags (``"demo"``, ``"introspect"``, ...), as ``regen.yml`` defines them.
    ``inventory``: a path (or list) — default the one ``ansible.cfg`` names (``inventory/local``).
    ``extravars``: extra variables (``-e``). ``secrets``: extra variables that must not be written or
    logged in the clear (vault-encrypted for the run, scrubbed from events). ``limit``: hosts (``--limit``).
    ``check``/``diff``: ``--check``/``--diff``. ``tags``/``skip_tags``: more tags on top of the stages'.
    ``on_event``: called with each :mod:`regen.runner.events` record, one at a time, from background
    threads (keep it quick; a queue is a good target).
    ``passwords``: prompt regex -> answer (e.g. with ``extra_args=["--ask-become-pass"]``).
    ``project_dir``: the checkout (default: found from the cwd). ``private_data_dir``: runner's directory
    (default ``<checkout>/.cache/runner``). ``rotate_artifacts``: runner records kept. ``timeout``: seconds.
    ``fact_cache_dir``: a fact cache of its own (default: the one ``ansible.cfg`` names). ``hostvars``:
    each host's ``regen_work_dir``/``regen_artifacts_dir`` when the caller already has them (else asked
    from the inventory).
    """
    return run_async(stages, **kwargs).wait()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _prune_old(directory: Path, max_age: float = 86400) -> None:
    # A killed run cannot delete its ciphertext; its one-time password died with it, but tidy up anyway.
    if not directory.is_dir():
        return
    for path in directory.glob("*.vault.yml"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > max_age:
                path.unlink()


# --- reading earlier runs ---------------------------------------------------------------------------


def _selected_stages(info: Mapping[str, Any], stages: Sequence[Stage]) -> list[Stage] | None:
    """The stages a recorded command line ran: by its playbook (standalone) or its --tags; None for all."""
    playbook = info.get("playbook")
    for stage in stages:
        if stage.standalone and playbook and Path(playbook).resolve() == stage.playbook.resolve():
            return [stage]
    tags = set(info.get("tags") or [])
    if not tags:
        return None
    return [s for s in stages if not s.standalone and (s.name in tags or set(s.tags) & tags)]


def load_run(artifact_dir: Path, *, stages: Sequence[Stage] = ()) -> RunResult:
    """Rebuild a run's result from runner's record of it (``regen status``); ``stages`` maps plays to
    stages (see :func:`regen.runner.discover_stages`)."""
    info = _art.command_info(artifact_dir)
    # runner writes `status` when the run ends: without it the run is still going, or was killed
    status = _art._read_text(artifact_dir / "status") or (
        "running" if time.time() - _art.last_activity(artifact_dir) < 120 else "unknown"
    )
    rc_text = _art._read_text(artifact_dir / "rc")
    rc = int(rc_text) if rc_text and rc_text.lstrip("-").isdigit() else None
    summary = None
    summary_path = artifact_dir / _art.SUMMARY_FILE
    if summary_path.is_file():
        with contextlib.suppress(OSError, ValueError):
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
    selected = _selected_stages(info, stages) if stages else None
    names = [s.name for s in selected] if selected is not None else None
    result = summarize(
        parse_events(_art.load_job_events(artifact_dir), play_stage_map(stages), names),
        status=status,
        rc=rc,
        ident=artifact_dir.name,
        selected=names or (),
        check=bool(info.get("check")),
    )
    result.artifact_dir = artifact_dir
    result.inventory = list(info.get("inventory") or [])
    result.tags = list(info.get("tags") or [])
    if summary:
        result.started = summary.get("started") or result.started
        result.finished = summary.get("finished") or result.finished
        result.duration = summary.get("duration")
        result.error = result.error or summary.get("error")
        if summary.get("status"):
            result.status = summary["status"]
    if result.started is None:
        result.started = _art.file_time(artifact_dir)
    return result


def _stage_status(counts: StageCounts) -> str:
    if counts.failed or counts.unreachable:
        return "failed"
    if counts.changed:
        return "changed"
    if counts.ok:
        return "ok"
    return "skipped" if counts.skipped else "not run"  # a play --tags left without a task


def load_recorded_run(path: Path, *, stages: Sequence[Stage] = ()) -> RunResult | None:
    """A run from the run history (``ARTIFACTS/runs/history/<id>.json``, written by the regen_history
    callback for every ansible-playbook run, ``make regen`` and plain ``ansible-playbook`` included), or
    None when ``path`` is no such document. A run still marked running whose process is gone was
    interrupted: ``canceled``."""
    from regen.fsio import read_json_object

    doc = read_json_object(path)
    if not doc or doc.get("schema") != "regen.run/1":
        return None
    status = str(doc.get("status") or "unknown")
    pid = doc.get("pid")
    if status == "running" and not (isinstance(pid, int) and psutil.pid_exists(pid)):
        status = "canceled"
    by_play = play_stage_map(stages)
    summaries: dict[str, StageSummary] = {}
    for play in doc.get("plays") or []:
        name = by_play.get(str(play.get("name")), str(play.get("name")))
        summary = summaries.setdefault(name, StageSummary(name=name, status="not run"))
        counts = {k: summary.counts.__dict__[k] + int((play.get("counts") or {}).get(k, 0))
                  for k in ("ok", "changed", "failed", "unreachable", "skipped")}
        summary.counts = StageCounts(**counts)
        summary.status = _stage_status(summary.counts)
        summary.started = summary.started or play.get("started")
        summary.finished = play.get("finished") or summary.finished
    ordered = [summaries.pop(s.name) for s in stages if s.name in summaries] + list(summaries.values())
    failures = [
        FailedTask(
            stage=by_play.get(str(f.get("play"))), play=f.get("play"), task=str(f.get("task")),
            host=str(f.get("host")), message=str(f.get("message") or ""), action=f.get("action"),
            unreachable=bool(f.get("unreachable")),
        )
        for f in doc.get("failures") or []
    ]
    result = RunResult(
        ident=str(doc.get("ident") or path.stem),
        status=status,
        rc=doc.get("rc"),
        check=bool(doc.get("check")),
        stages=ordered,
        hosts={h: HostStats(**c) for h, c in (doc.get("hosts") or {}).items()},
        failed_task=failures[0] if failures else None,
        failures=failures,
        started=doc.get("started"),
        finished=doc.get("finished"),
        duration=doc.get("duration"),
        inventory=list(doc.get("inventory") or []),
        tags=list(doc.get("tags") or []),
    )
    result.artifact_dir = path
    return result


def history_dirs(root: Path) -> list[Path]:
    """The artifacts directories of a checkout whose run history `regen status` reads: ``artifacts/``
    and one level below it (an inventory whose ``regen_artifacts_dir`` is ``artifacts/<inventory>``)."""
    base = root / "artifacts"
    below = sorted(p.parent.parent for p in base.glob("*/runs/history")) if base.is_dir() else []
    return [base, *below]


def history(
    *,
    project_dir: str | os.PathLike[str] | None = None,
    private_data_dir: str | os.PathLike[str] | None = None,
    limit: int = 10,
    artifacts_dirs: Sequence[str | os.PathLike[str]] | None = None,
) -> list[RunResult]:
    """The last ``limit`` runs, newest first: those runner recorded in ``private_data_dir`` (``regen run``)
    and those of the run history in ``artifacts_dirs`` (default :func:`history_dirs`) that runner did not
    (``make regen``, ``ansible-playbook``). A run ``regen run`` started is in both under one id."""
    project = find_project(project_dir)
    pdd = (
        Path(private_data_dir).expanduser().resolve()
        if private_data_dir
        else project.default_private_data_dir
    )
    stages = discover_stages(project.root)
    runs = [load_run(d, stages=stages) for d in _art.run_dirs(pdd)[:limit]]
    known = {r.ident for r in runs}
    dirs = [Path(d) for d in artifacts_dirs] if artifacts_dirs is not None else history_dirs(project.root)
    from regen.provenance import history_records

    for directory in dirs:
        for path in history_records(directory)[-limit:]:
            if path.stem not in known:
                recorded = load_recorded_run(path, stages=stages)
                if recorded is not None:
                    runs.append(recorded)
                    known.add(recorded.ident)
    runs.sort(key=lambda r: _started_key(r.started), reverse=True)
    return runs[:limit]


def _started_key(started: str | None) -> float:
    try:
        return datetime.fromisoformat(str(started)).timestamp()
    except ValueError:
        return 0.0
