"""Job progress: the status documents the generation, tokenize and training jobs write as they run.

The jobs run on the target host and rewrite a small JSON status file as they go. Its keys are the one
schema the jobs own, `regen.status` (`job`, `state`, `item`, `done`, `total`, `failed`, `tokens`,
`tokens_per_s`, `eta_s`, `line`, ...): this module reads those keys and nothing else. A file that is
missing, half-written, not JSON or not a status document is skipped until it parses.

Two sources feed the same :class:`JobStatus` (the schema's `Status`):

* status files under the work directory of a host the controller can read (``connection: local``),
  watched by :class:`StatusWatcher`;
* task results in the event stream: a role that polls a status file on a remote host (``slurp`` in an
  ``until`` loop, an ``async_status``, a module or command printing the document) puts the same
  document in its result, and :func:`status_from_result` finds it there.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from regen.status import Status, from_document

#: One reading of a job's progress.
JobStatus = Status

#: File names the watcher reads as job status files.
STATUS_FILE = re.compile(r"^(?:.*[._-])?(?:status|progress)\.json$")


def parse_status(obj: object) -> JobStatus | None:
    """The :class:`JobStatus` of one decoded status document, or None when it is not one."""
    return from_document(obj)


def read_status_file(path: Path) -> JobStatus | None:
    """Read one status file; None when it is missing, partial, not JSON or not a status document."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1_000_000)
        obj = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return parse_status(obj)


def _decoded_candidates(res: Mapping) -> Iterator[object]:
    yield res  # a module that returns the document itself
    if isinstance(res.get("status"), Mapping):  # a registered or published document
        yield res["status"]
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


def status_from_result(res: object) -> JobStatus | None:
    """Progress carried by a task result (see the module docstring), or None."""
    if not isinstance(res, Mapping):
        return None
    for candidate in _decoded_candidates(res):
        status = parse_status(candidate)
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
