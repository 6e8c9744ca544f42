"""Job progress: what the generation, tokenize and training jobs report in their status files.

The jobs run on the target host and write a small JSON status file as they go (atomically, but regen
does not rely on it). Its exact fields belong to each job, so it is read defensively: any JSON object
with a numeric ``done`` (or ``completed``/``processed``/``step``) and/or ``total`` (or ``total_steps``)
counts as progress; ``tokens``/``tokens_out``, ``tokens_per_s``/``tokens_out_per_s``, ``failed``,
``state``, ``eta_s``, ``line`` and ``job`` are picked up when present, anything else is ignored, and a
file that is missing, half-written or not JSON is skipped until it parses. That covers the generation
job's ``status.json`` (``done``/``total``/``tokens_out_per_s``) and the training launcher's status
(``step``/``total_steps``/``eta_s``/``line``) without either having to know about the runner.

Two sources feed the same :class:`JobStatus`:

* status files under the work directory of a host the controller can read (``connection: local``),
  watched by :class:`StatusWatcher`;
* task results in the event stream: a role that polls a status file on a remote host (``slurp`` in an
  ``until`` loop, an ``async_status``, a custom module returning ``status``) puts the same object in its
  result, and :func:`status_from_result` finds it there.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

_DONE_KEYS = ("done", "completed", "processed", "finished", "step", "current")
_TOTAL_KEYS = ("total", "total_steps", "max_steps", "steps")
_TOKENS_KEYS = ("tokens", "tokens_out", "output_tokens", "completion_tokens")
_RATE_KEYS = ("tokens_per_s", "tokens_out_per_s", "tokens_per_second", "tok_per_s")
_FAILED_KEYS = ("failed", "errors", "error_count")
_STATE_KEYS = ("state", "status", "phase")
_ETA_KEYS = ("eta_s", "eta_seconds", "eta")
_LINE_KEYS = ("line", "summary", "message")
_JOB_KEYS = ("job", "name", "kind")
_NESTED_KEYS = ("progress", "counts", "stats", "status")

#: File names the watcher reads as job status files.
STATUS_FILE = re.compile(r"^(?:.*[._-])?(?:status|progress)\.json$")


@dataclass(frozen=True)
class JobStatus:
    """One reading of a job's progress. Counts are None when the job did not report them."""

    job: str
    done: float | None = None
    total: float | None = None
    tokens: float | None = None
    tokens_per_s: float | None = None
    failed: float | None = None
    state: str | None = None
    eta_s: float | None = None
    line: str | None = None

    @property
    def fraction(self) -> float | None:
        if self.done is None or not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def finished(self) -> bool:
        if self.state and self.state.lower() in {
            "done",
            "finished",
            "complete",
            "completed",
            "succeeded",
            "success",
        }:
            return True
        return self.done is not None and self.total is not None and self.total > 0 and self.done >= self.total


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if math.isnan(value) or math.isinf(value) or value < 0:
        return None
    return float(value)


def _first(obj: Mapping, keys: Iterable[str], convert=_number):
    for key in keys:
        if key in obj:
            value = convert(obj[key])
            if value is not None:
                return value
    return None


def _text(value: object) -> str | None:
    return value.strip()[:80] or None if isinstance(value, str) else None


def _line(value: object) -> str | None:
    return value.strip().splitlines()[0][:200] or None if isinstance(value, str) and value.strip() else None


def parse_status(obj: object, *, default_job: str = "job") -> JobStatus | None:
    """A :class:`JobStatus` from one decoded status document, or None when it carries no progress."""
    if not isinstance(obj, Mapping):
        return None
    layers = [obj] + [obj[k] for k in _NESTED_KEYS if isinstance(obj.get(k), Mapping)]
    fields: dict[str, object] = {}
    for layer in layers:
        for name, keys, convert in (
            ("done", _DONE_KEYS, _number),
            ("total", _TOTAL_KEYS, _number),
            ("tokens", _TOKENS_KEYS, _number),
            ("tokens_per_s", _RATE_KEYS, _number),
            ("failed", _FAILED_KEYS, _number),
            ("state", _STATE_KEYS, _text),
            ("eta_s", _ETA_KEYS, _number),
            ("line", _LINE_KEYS, _line),
            ("job", _JOB_KEYS, _text),
        ):
            if fields.get(name) is None:
                fields[name] = _first(layer, keys, convert)
    if fields["done"] is None and fields["total"] is None:
        return None
    job = fields.pop("job") or default_job
    return JobStatus(job=str(job), **fields)  # type: ignore[arg-type]


def read_status_file(path: Path, *, default_job: str | None = None) -> JobStatus | None:
    """Read one status file; None when it is missing, partial, not JSON or carries no progress."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1_000_000)
        obj = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return parse_status(obj, default_job=default_job or job_name_for(path))


def job_name_for(path: Path) -> str:
    """A job's name from its status file path: ``generate/status.json`` -> ``generate``."""
    stem = re.sub(r"[._-]?(status|progress)$", "", path.stem)
    return stem or path.parent.name or "job"


def _decoded_candidates(res: Mapping) -> Iterator[object]:
    yield res
    for key in ("status", "json", "job", "progress", "result"):
        if isinstance(res.get(key), Mapping):
            yield res[key]
    content = res.get("content")
    if isinstance(content, str) and res.get("encoding") == "base64":  # ansible.builtin.slurp
        try:
            text = base64.b64decode(content, validate=False).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            text = None
        if text is not None:
            yield _json_or_none(text)
    stdout = res.get("stdout")
    if isinstance(stdout, str) and stdout.lstrip().startswith("{"):
        yield _json_or_none(stdout)


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def status_from_result(res: object, *, default_job: str) -> JobStatus | None:
    """Progress carried by a task result (see the module docstring), or None."""
    if not isinstance(res, Mapping):
        return None
    for candidate in _decoded_candidates(res):
        # A task result's own fields (changed, rc, ...) are not progress unless done/total are there.
        if candidate is res and not any(k in res for k in ("done", "total")):
            continue
        status = parse_status(candidate, default_job=default_job)
        if status is not None:
            return status
    return None


_SKIP_DIRS = {"__pycache__", "node_modules", ".git", "site-packages", "models", "hf_cache", ".cache"}


def find_status_files(roots: Iterable[Path], *, max_depth: int = 4, max_entries: int = 20000) -> list[Path]:
    """Status files under ``roots``: shallow, skipping virtualenvs, model weights and caches."""
    found: list[Path] = []
    seen = 0
    for root in roots:
        if not root.is_dir():
            continue
        base_depth = len(root.parts)
        for dirpath, dirnames, filenames in os.walk(root):
            seen += len(dirnames) + len(filenames)
            if seen > max_entries:
                return found
            here = Path(dirpath)
            if "pyvenv.cfg" in filenames or len(here.parts) - base_depth >= max_depth:
                dirnames[:] = []
                if "pyvenv.cfg" in filenames:
                    continue
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            found.extend(here / f for f in filenames if STATUS_FILE.match(f))
    return found


class StatusWatcher:
    """Reports status files that changed since the last poll (and since ``since``, a start time)."""

    def __init__(self, roots: Iterable[Path], *, since: float | None = None) -> None:
        self.roots = [Path(r) for r in roots]
        self.since = since if since is not None else time.time()
        self._seen: dict[Path, tuple[int, int]] = {}
        self._files: list[Path] = []
        self._last_scan = 0.0

    def poll(self, *, rescan_every: float = 5.0) -> list[tuple[Path, JobStatus]]:
        now = time.monotonic()
        if not self._files or now - self._last_scan >= rescan_every:
            self._files = find_status_files(self.roots)
            self._last_scan = now
        changed: list[tuple[Path, JobStatus]] = []
        for path in self._files:
            try:
                stat = path.stat()
            except OSError:
                continue
            # A status file older than the run belongs to an earlier run; it is not this run's progress.
            if stat.st_mtime < self.since - 1:
                continue
            key = (stat.st_mtime_ns, stat.st_size)
            if self._seen.get(path) == key:
                continue
            status = read_status_file(path)
            if status is None:
                continue  # half-written: read it again at the next poll
            self._seen[path] = key
            changed.append((path, status))
        return changed
