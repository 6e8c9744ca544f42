"""Run, watch and inspect regen runs from Python, on top of ansible-runner.

>>> from regen.runner import run
>>> result = run(stages=["demo", "introspect"], inventory="inventory/local")
>>> print(result.status, result.exit_code, result.plan)

:func:`run` blocks and returns a :class:`RunResult`; :func:`run_async` returns a :class:`RunHandle` that
can be cancelled. ``on_event`` receives typed records from :mod:`regen.runner.events` as the run goes.
"""

from regen.runner.api import (
    FailedTask,
    RunHandle,
    RunResult,
    StageSummary,
    history,
    history_dirs,
    load_recorded_run,
    load_run,
    run,
    run_async,
    summarize,
)
from regen.runner.artifacts import Artifacts
from regen.runner.errors import BadInput, ExitCode, RegenRunnerError
from regen.runner.events import (
    Event,
    EventParser,
    FactsProduced,
    HostStats,
    JobProgress,
    NoHostsMatched,
    Output,
    PlaybookStarted,
    RunStats,
    StageCounts,
    StageFinished,
    StageStarted,
    TaskResult,
    TaskRetry,
    TaskStarted,
    TaskStatus,
    parse_events,
)
from regen.runner.planning import PlanReport, StagePlan, plan
from regen.runner.progress import JobStatus
from regen.runner.stages import Stage, discover_stages

__all__ = [
    "Artifacts",
    "BadInput",
    "Event",
    "EventParser",
    "ExitCode",
    "FactsProduced",
    "FailedTask",
    "HostStats",
    "JobProgress",
    "JobStatus",
    "NoHostsMatched",
    "Output",
    "PlanReport",
    "PlaybookStarted",
    "RegenRunnerError",
    "RunHandle",
    "RunResult",
    "RunStats",
    "Stage",
    "StageCounts",
    "StageFinished",
    "StagePlan",
    "StageStarted",
    "StageSummary",
    "TaskResult",
    "TaskRetry",
    "TaskStarted",
    "TaskStatus",
    "discover_stages",
    "history",
    "history_dirs",
    "load_recorded_run",
    "load_run",
    "parse_events",
    "plan",
    "run",
    "run_async",
    "summarize",
]
