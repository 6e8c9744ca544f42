"""Typed records of a regen run, parsed from ansible-runner's event stream.

ansible-runner emits one JSON event per callback (``playbook_on_play_start``, ``runner_on_ok``, ...).
:class:`EventParser` turns that stream into the records below, which is what ``on_event`` receives:

=====================  ==============================================================================
record                 when
=====================  ==============================================================================
:class:`PlaybookStarted`  the playbook starts (``playbook_on_start``)
:class:`StageStarted`     the first play of a stage starts (stages are the ``playbooks/<stage>.yml``)
:class:`StageFinished`    the next stage starts, or the run ends; carries the stage's task counts
:class:`TaskStarted`      a task (or handler) starts
:class:`TaskResult`       a host finished a task: ok, changed, failed, skipped or unreachable
:class:`TaskRetry`        an ``until`` loop tries again
:class:`JobProgress`      a long job reported progress (status file, or a task result carrying one)
:class:`FactsProduced`    a task set a ``regen_*`` fact (``regen_model_facts`` from introspection)
:class:`NoHostsMatched`   a play of a stage had no hosts in this inventory (or ``--limit``)
:class:`Output`           a warning, deprecation, error or verbose line from Ansible
:class:`RunStats`         the recap: per-host ok/changed/failed/unreachable/skipped counts
=====================  ==============================================================================

Counts in :class:`TaskResult` are exclusive (a changed result is not also ok); :class:`RunStats` keeps
Ansible's own meaning (``ok`` includes ``changed``) so it matches ``PLAY RECAP``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from regen.runner.progress import JobStatus, status_from_result

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "")


class TaskStatus(StrEnum):
    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"
    SKIPPED = "skipped"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every record: ``counter`` orders runner events (None for status-file readings)."""

    kind: ClassVar[str] = "event"
    counter: int | None = None
    created: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StrEnum):
                value = value.value
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            elif isinstance(value, Mapping):
                value = {
                    k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in value.items()
                }
            data[f.name] = value
        return data


@dataclass(frozen=True, kw_only=True)
class PlaybookStarted(Event):
    kind: ClassVar[str] = "playbook_started"
    playbook: str


@dataclass(frozen=True, kw_only=True)
class StageStarted(Event):
    kind: ClassVar[str] = "stage_started"
    stage: str
    play: str
    hosts: str


@dataclass(frozen=True)
class StageCounts:
    """Task results of one stage, exclusive: a changed result is counted once, under ``changed``; a
    failure the play ignored (``ignore_errors``) under ``ignored``; one a ``rescue`` handled (the host
    went on with the play) moves from ``failed`` to ``rescued``."""

    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: int = 0
    ignored: int = 0
    rescued: int = 0

    def add(self, status: TaskStatus, *, ignored: bool = False) -> StageCounts:
        if status is TaskStatus.FAILED and ignored:
            return dataclasses.replace(self, ignored=self.ignored + 1)
        name = status.value
        return dataclasses.replace(self, **{name: getattr(self, name) + 1})

    def rescue(self, count: int) -> StageCounts:
        return dataclasses.replace(self, failed=self.failed - count, rescued=self.rescued + count)

    @property
    def total(self) -> int:
        return (
            self.ok
            + self.changed
            + self.failed
            + self.skipped
            + self.unreachable
            + self.ignored
            + self.rescued
        )


@dataclass(frozen=True, kw_only=True)
class StageFinished(Event):
    kind: ClassVar[str] = "stage_finished"
    stage: str
    counts: StageCounts
    failed: bool


@dataclass(frozen=True, kw_only=True)
class TaskStarted(Event):
    kind: ClassVar[str] = "task_started"
    stage: str | None
    play: str | None
    task: str
    action: str | None = None
    role: str | None = None
    path: str | None = None
    handler: bool = False


@dataclass(frozen=True, kw_only=True)
class TaskResult(Event):
    """A host's result for a task. ``message`` is the failure (or skip) reason, or what a debug ("Show
    ...") task printed; empty for other results."""

    kind: ClassVar[str] = "task_result"
    stage: str | None
    play: str | None
    task: str
    host: str
    status: TaskStatus
    action: str | None = None
    role: str | None = None
    path: str | None = None
    message: str = ""
    ignored: bool = False
    duration: float | None = None


@dataclass(frozen=True, kw_only=True)
class TaskRetry(Event):
    """An ``until`` loop failed its check and will try again: ``attempt`` of at most ``retries``."""

    kind: ClassVar[str] = "task_retry"
    stage: str | None
    task: str
    host: str
    attempt: int | None
    retries: int | None


@dataclass(frozen=True, kw_only=True)
class JobProgress(Event):
    """A job's progress; ``source`` is the status file's path, or ``"task:<task name>"`` from an event."""

    kind: ClassVar[str] = "job_progress"
    job: str
    host: str | None
    status: JobStatus
    source: str

    @property
    def done(self) -> float | None:
        return self.status.done

    @property
    def total(self) -> float | None:
        return self.status.total


@dataclass(frozen=True, kw_only=True)
class FactsProduced(Event):
    kind: ClassVar[str] = "facts_produced"
    stage: str | None
    host: str
    name: str
    value: Any


@dataclass(frozen=True, kw_only=True)
class NoHostsMatched(Event):
    kind: ClassVar[str] = "no_hosts_matched"
    stage: str | None
    play: str | None


@dataclass(frozen=True, kw_only=True)
class Output(Event):
    """Text from Ansible outside task results: ``level`` is warning, deprecated, error or verbose."""

    kind: ClassVar[str] = "output"
    level: str
    text: str


@dataclass(frozen=True)
class HostStats:
    """Ansible's recap for one host (``ok`` includes ``changed``, as in ``PLAY RECAP``)."""

    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass(frozen=True, kw_only=True)
class RunStats(Event):
    kind: ClassVar[str] = "run_stats"
    hosts: dict[str, HostStats]


_RECAP_KEYS = {
    "ok": "ok",
    "changed": "changed",
    "failures": "failed",
    "dark": "unreachable",
    "skipped": "skipped",
    "rescued": "rescued",
    "ignored": "ignored",
}


def host_stats(event_data: Mapping[str, Any]) -> dict[str, HostStats]:
    hosts: dict[str, dict[str, int]] = {}
    for key, name in _RECAP_KEYS.items():
        per_host = event_data.get(key) or {}
        if isinstance(per_host, Mapping):
            for host, count in per_host.items():
                hosts.setdefault(str(host), {})[name] = int(count or 0)
    for host in event_data.get("processed") or {}:
        hosts.setdefault(str(host), {})
    return {host: HostStats(**counts) for host, counts in hosts.items()}


def failure_message(res: object, *, limit: int = 2000) -> str:
    """The readable reason of a failed/unreachable/skipped result: ``msg``, stderr's tail, a loop item."""
    if not isinstance(res, Mapping):
        return ""
    if res.get("censored"):
        return str(res["censored"])
    parts: list[str] = []
    msg = res.get("msg") or res.get("skip_reason") or res.get("reason")
    if msg:
        parts.append(msg if isinstance(msg, str) else repr(msg))
    for key in ("stderr", "module_stderr"):
        text = res.get(key)
        if isinstance(text, str) and text.strip() and text.strip() not in parts:
            tail = "\n".join(text.strip().splitlines()[-12:])
            parts.append(f"{key}: {tail}")
            break
    if not parts and isinstance(res.get("results"), list):
        for item in res["results"]:
            if isinstance(item, Mapping) and (item.get("failed") or item.get("unreachable")):
                parts.append(failure_message(item, limit=limit))
                break
    text = "\n".join(p for p in parts if p)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_RESULT_EVENTS = {
    "runner_on_ok": None,  # ok or changed, decided from res["changed"]
    "runner_on_failed": TaskStatus.FAILED,
    "runner_on_skipped": TaskStatus.SKIPPED,
    "runner_on_unreachable": TaskStatus.UNREACHABLE,
    "runner_on_async_ok": None,
    "runner_on_async_failed": TaskStatus.FAILED,
}
_ALWAYS_ACTIONS = {"ansible.builtin.validate_argument_spec", "validate_argument_spec"}
# The "Show ..." tasks: what they print is for people, in `regen run` as in ansible-playbook's output.
_DEBUG_ACTIONS = {"ansible.builtin.debug", "debug"}


def shown_message(res: object) -> str:
    """The text a debug task printed (its `msg`: a string, lines of a list, or JSON), else ''."""
    if not isinstance(res, Mapping) or "msg" not in res:
        return ""
    msg = res["msg"]
    if isinstance(msg, str):
        return msg
    if isinstance(msg, list) and all(isinstance(line, str) for line in msg):
        return "\n".join(msg)
    return json.dumps(msg, indent=1, default=str)


_OUTPUT_EVENTS = ("warning", "deprecated", "error", "system_warning", "verbose", "debug")


@dataclass
class _StageState:
    name: str
    counts: StageCounts = field(default_factory=StageCounts)
    # Failures per host not yet known to be fatal: Ansible runs no further task of the play on a host
    # whose failure was not rescued, so a later result for that host means a rescue handled it.
    pending: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(self.pending.values()) or self.counts.unreachable > 0


class EventParser:
    """Turns raw ansible-runner events (dicts) into records, in order. Keeps the current stage.

    ``stage_of_play`` maps a play's name to its stage (see :func:`regen.runner.stages.play_stage_map`);
    a play it does not know is its own stage, named after the play.
    """

    def __init__(
        self,
        stage_of_play: Mapping[str, str] | Callable[[str], str | None] | None = None,
        selected: Iterable[str] | None = None,
    ) -> None:
        # With --tags, Ansible still starts the plays of stages that were not asked for (and runs none of
        # their tasks): such a stage is announced only if one of its tasks does run (an `always` task).
        self.selected = set(selected) if selected is not None else None
        self._pending: StageStarted | None = None
        if stage_of_play is None:
            self._stage_of = lambda play: None
        elif isinstance(stage_of_play, Mapping):
            self._stage_of = stage_of_play.get
        else:
            self._stage_of = stage_of_play
        self.stage: _StageState | None = None
        self.stages: dict[str, _StageState] = {}
        self.play: str | None = None
        self.finished = False

    def _stage_for_play(self, play: str) -> str:
        return self._stage_of(play) or play

    def _finish_stage(self, counter: int | None, created: str | None) -> list[Event]:
        if self.stage is None:
            return []
        state, self.stage = self.stage, None
        if self._pending is not None:  # never announced: nothing of it ran
            self._pending = None
            return []
        return [
            StageFinished(
                counter=counter, created=created, stage=state.name, counts=state.counts, failed=state.failed
            )
        ]

    def feed(self, raw: Mapping[str, Any]) -> list[Event]:
        """Records for one raw event (possibly none)."""
        name = raw.get("event")
        data = raw.get("event_data") or {}
        counter = raw.get("counter")
        created = raw.get("created")
        base = {"counter": counter, "created": created}
        stage = self.stage.name if self.stage else None
        if name == "playbook_on_start":
            return [PlaybookStarted(**base, playbook=str(data.get("playbook", "")))]
        if name == "playbook_on_play_start":
            play = str(data.get("name") or data.get("pattern") or "")
            self.play = play
            stage_name = self._stage_for_play(play)
            records: list[Event] = []
            if self.stage is None or self.stage.name != stage_name:
                records.extend(self._finish_stage(counter, created))
                self.stage = self.stages.setdefault(stage_name, _StageState(stage_name))
                started = StageStarted(
                    **base, stage=stage_name, play=play, hosts=str(data.get("pattern", ""))
                )
                if self.selected is None or stage_name in self.selected:
                    records.append(started)
                else:
                    self._pending = started
            return records
        if name in ("playbook_on_task_start", "playbook_on_handler_task_start"):
            return [
                *self._announce(data),
                TaskStarted(
                    **base,
                    stage=stage,
                    play=self.play,
                    task=str(data.get("task") or data.get("name", "")),
                    action=data.get("task_action"),
                    role=data.get("role") or None,
                    path=data.get("task_path"),
                    handler=name == "playbook_on_handler_task_start",
                ),
            ]
        if name in _RESULT_EVENTS:
            return [*self._announce(data), *self._result(name, data, base, stage)]
        if name == "runner_retry":
            res = data.get("res") if isinstance(data.get("res"), Mapping) else {}
            records = [
                TaskRetry(
                    **base,
                    stage=stage,
                    task=str(data.get("task", "")),
                    host=str(data.get("host", "")),
                    attempt=_int(res.get("attempts")),
                    retries=_int(res.get("retries")),
                )
            ]
            records.extend(self._progress(data, base))
            return records
        if name == "runner_on_async_poll":
            return self._progress(data, base)
        if name in ("playbook_on_no_hosts_matched", "playbook_on_no_hosts_remaining"):
            if name == "playbook_on_no_hosts_remaining" or self._pending is not None:
                return []
            return [NoHostsMatched(**base, stage=stage, play=self.play)]
        if name == "playbook_on_stats":
            records = self._finish_stage(counter, created)
            self.finished = True
            records.append(RunStats(**base, hosts=host_stats(data)))
            return records
        if name in _OUTPUT_EVENTS:
            text = strip_ansi(str(raw.get("stdout") or "")).strip()
            if not text or (name in ("verbose", "debug") and _is_noise(text)):
                return []
            level = "warning" if name == "system_warning" else ("verbose" if name == "debug" else name)
            return [Output(**base, level=level, text=text)]
        return []

    def _announce(self, data: Mapping[str, Any]) -> list[Event]:
        # A role's argument check is tagged `always`: it runs under any --tags and is no sign of the stage.
        if data.get("task_action") in _ALWAYS_ACTIONS:
            return []
        pending, self._pending = self._pending, None
        return [pending] if pending is not None else []

    def _result(self, name: str, data: Mapping[str, Any], base: dict, stage: str | None) -> list[Event]:
        res = data.get("res") or {}
        status = _RESULT_EVENTS[name]
        if status is None:
            status = TaskStatus.CHANGED if isinstance(res, Mapping) and res.get("changed") else TaskStatus.OK
        ignored = bool(data.get("ignore_errors")) and status is TaskStatus.FAILED
        message = (
            failure_message(res)
            if status in (TaskStatus.FAILED, TaskStatus.UNREACHABLE, TaskStatus.SKIPPED)
            else shown_message(res) if data.get("task_action") in _DEBUG_ACTIONS
            else ""
        )  # fmt: skip
        host = str(data.get("host", ""))
        task = str(data.get("task", ""))
        records: list[Event] = [
            TaskResult(
                **base,
                stage=stage,
                play=self.play,
                task=task,
                host=host,
                status=status,
                action=data.get("task_action"),
                role=data.get("role") or None,
                path=data.get("task_path"),
                message=message,
                ignored=ignored,
                duration=data.get("duration"),
            )
        ]
        if self.stage is not None:
            state = self.stage
            rescued = state.pending.pop(host, 0)
            if rescued:
                state.counts = state.counts.rescue(rescued)
            state.counts = state.counts.add(status, ignored=ignored)
            if status is TaskStatus.FAILED and not ignored:
                state.pending[host] = 1
        if isinstance(res, Mapping):
            facts = res.get("ansible_facts")
            if isinstance(facts, Mapping):
                for key, value in facts.items():
                    if str(key).startswith("regen_"):
                        records.append(
                            FactsProduced(**base, stage=stage, host=host, name=str(key), value=value)
                        )
        records.extend(self._progress(data, base))
        return records

    def _progress(self, data: Mapping[str, Any], base: dict) -> list[Event]:
        task = str(data.get("task", ""))
        status = status_from_result(data.get("res"))
        if status is None:
            return []
        return [
            JobProgress(
                **base,
                job=status.job,
                host=str(data.get("host", "")) or None,
                status=status,
                source=f"task:{task}",
            )
        ]

    def feed_all(self, raws: Iterable[Mapping[str, Any]]) -> list[Event]:
        records: list[Event] = []
        for raw in raws:
            records.extend(self.feed(raw))
        return records

    def close(self, counter: int | None = None, created: str | None = None) -> list[Event]:
        """Records that end a stream cut short (a canceled run has no recap): the open stage's finish."""
        return self._finish_stage(counter, created)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_noise(text: str) -> bool:
    # The vault prompt regen answers, and runner's own blank lines, are not worth a record.
    return text.startswith("Vault password") or not text.strip()


def parse_events(
    raws: Iterable[Mapping[str, Any]],
    stage_of_play: Mapping[str, str] | Callable[[str], str | None] | None = None,
    selected: Iterable[str] | None = None,
) -> list[Event]:
    """Parse a whole recorded stream (e.g. a run's ``job_events``), closing an unfinished stage."""
    parser = EventParser(stage_of_play, selected)
    records = parser.feed_all(sorted(raws, key=lambda r: r.get("counter") or 0))
    records.extend(parser.close())
    return records
