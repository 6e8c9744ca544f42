"""The status-file schema: the one set of keys every regen job's status document carries.

A long job (generation, tokenization, drafter training) rewrites a small JSON document as it runs:
`OUTPUT_DIR/status.json` for the jobs, the training launcher's `--status` file. The roles read it to
decide and report, `regen` reads it for its progress bars (`regen.runner.progress`), people `cat` it.
Every document holds the keys of `Status` below, under these names and no others; what else a job
reports (endpoint health, latency quantiles, loss, ...) sits beside them under keys of its own that no
reader other than the job's own role relies on. `validate` says what a document gets wrong; a test runs
each job on tiny inputs and validates the status file it really wrote.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from regen import procs

SCHEMA = "regen.status/1"

# Every state a job reports. "lost" is the training launcher's verdict on a supervisor that vanished
# without a final state.
RUNNING_STATES = ("starting", "running")
FINAL_STATES = ("done", "succeeded", "failed", "stopped", "interrupted", "endpoints_down", "lost")
STATES = RUNNING_STATES + FINAL_STATES
# States that mean "finished well".
SUCCESS_STATES = ("done", "succeeded")


@dataclass(frozen=True)
class Status:
    """The keys every status document carries; counts are None where a job cannot know them (yet)."""

    job: str  # "generate", "tokenize", "train"
    state: str  # one of STATES
    item: str  # what `done`/`total` count: "record", "row", "step"
    line: str  # one human-readable line: what `regen`, the roles and people show
    done: float | None = None
    total: float | None = None
    failed: int | None = None  # units that ended in failure (the errors file), None where none can
    tokens: int | None = None  # tokens the job produced (generate) or wrote (tokenize)
    tokens_per_s: float | None = None
    eta_s: float | None = None
    exit_code: int | None = None  # set once the job has ended
    error: str | None = None  # why it failed, when it knows
    pid: int | None = field(default_factory=os.getpid)
    updated_at: float = field(default_factory=time.time)

    def document(self, **detail: Any) -> dict[str, Any]:
        """The status document: the schema's keys plus the job's own `detail` keys (never one of them)."""
        clash = sorted(set(detail) & (KEYS | {"schema"}))
        if clash:
            raise ValueError(f"job detail may not reuse the schema's keys: {', '.join(clash)}")
        return {"schema": SCHEMA, **asdict(self), **detail}

    @property
    def fraction(self) -> float | None:
        if self.done is None or not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def finished(self) -> bool:
        return self.state in FINAL_STATES


KEYS = frozenset(f.name for f in fields(Status))
_REQUIRED = ("job", "state", "item", "line")
_NUMBERS = ("done", "total", "failed", "tokens", "tokens_per_s", "eta_s", "exit_code", "pid", "updated_at")
_INTEGERS = ("failed", "tokens", "exit_code", "pid")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate(doc: object) -> list[str]:
    """What `doc` gets wrong against the schema (an empty list when nothing)."""
    if not isinstance(doc, Mapping):
        return [f"a status document is a JSON object, not {type(doc).__name__}"]
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    problems += [f"lacks {key!r}" for key in sorted(KEYS) if key not in doc]
    for key in _REQUIRED:
        if key in doc and not (isinstance(doc[key], str) and doc[key].strip()):
            problems.append(f"{key!r} must be a non-empty string, not {doc[key]!r}")
    if isinstance(doc.get("state"), str) and doc["state"] not in STATES:
        problems.append(f"state {doc['state']!r} is none of {', '.join(STATES)}")
    for key in _NUMBERS:
        value = doc.get(key)
        if value is None:
            if key == "updated_at" and key in doc:
                problems.append("'updated_at' must be a time, not null")
            continue
        if not _is_number(value) or value < 0:
            problems.append(f"{key!r} must be a finite number >= 0 or null, not {value!r}")
        elif key in _INTEGERS and not isinstance(value, int):
            problems.append(f"{key!r} must be a whole number, not {value!r}")
    if doc.get("error") is not None and not isinstance(doc.get("error"), str):
        problems.append(f"'error' must be a string or null, not {doc['error']!r}")
    return problems


def from_document(doc: object) -> Status | None:
    """The `Status` a valid document holds, or None for anything else (half-written, foreign, old)."""
    if validate(doc):
        return None
    assert isinstance(doc, Mapping)
    return Status(**{key: doc[key] for key in KEYS})


def liveness(doc: Mapping[str, Any], now: float | None = None, *, grace: float = 3.0) -> str:
    """What a reader on the job's host can tell from a status document:

    `finished` (a final state), `alive` (its pid runs and the heartbeat is fresh), `silent` (its pid runs
    but no heartbeat for `grace` heartbeats: stuck, or the disk refuses the file), `dead` (its pid is gone
    without a final state: killed, e.g. SIGKILL or the OOM killer). The heartbeat interval is the job's
    own `heartbeat_s` where it reports one.
    """
    if doc.get("state") in FINAL_STATES:
        return "finished"
    pid = doc.get("pid")
    if not isinstance(pid, int) or not procs.alive(pid):
        return "dead"
    beat = doc.get("heartbeat_s")
    interval = beat if _is_number(beat) and beat > 0 else 2.0
    age = (time.time() if now is None else now) - float(doc.get("updated_at") or 0)
    return "alive" if age <= grace * interval + 1.0 else "silent"
