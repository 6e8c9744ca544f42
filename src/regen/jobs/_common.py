"""Shared plumbing for regen jobs: clear errors, hashes, streaming JSONL, logging, status, progress.

Files are written through `regen.fsio` (atomic, durable); the status document's keys are `regen.jobs.status`.

Everything here is standard library (plus tqdm, a core dependency) so that any job can use it on a host
whose venv carries nothing else.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from regen.fsio import atomic_write_json

log = logging.getLogger("regen.jobs")

# Exit codes shared by the jobs; scripts and the roles rely on them.
EXIT_OK = 0
EXIT_FAILED_RECORDS = 1  # the job ran, some records ended in the errors file
EXIT_USAGE = 2  # bad arguments or bad input that stops the whole job (argparse uses 2 as well)
EXIT_UNAVAILABLE = 3  # the job stopped early because what it depends on stayed down
EXIT_INTERRUPTED = 130


class JobError(Exception):
    """A problem the user can fix; the message names what is wrong and how to fix it."""


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a job's main, turning a `JobError` into one readable line instead of a traceback."""
    try:
        return main(argv)
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


# --------------------------------------------------------------------------------------------------
# Hashes
# --------------------------------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, UTF-8. Used for content hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Streaming JSONL
# --------------------------------------------------------------------------------------------------


def open_binary(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a (possibly gzip-compressed) file for binary streaming."""
    path = os.fspath(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb", buffering=1 << 20)


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Yield (1-based line number, raw line without the newline) for non-blank lines, never loading the
    whole file. A final line without a newline is yielded too (input files need not end with one)."""
    with open_binary(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.rstrip(b"\r\n")
            if line.strip():
                yield lineno, line


def count_lines(path: str | os.PathLike[str], chunk: int = 1 << 22) -> int:
    """Count non-empty lines quickly (newline count plus an unterminated last line); used for ETA only."""
    n = 0
    last = b"\n"
    with open_binary(path) as fh:
        while block := fh.read(chunk):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (0 if last == b"\n" else 1)


def decode_json_line(raw: bytes) -> tuple[Any, str | None]:
    """Parse one JSONL line; return (value, None) or (None, reason)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} at column {exc.colno}"


# --------------------------------------------------------------------------------------------------
# Logging, status file, progress
# --------------------------------------------------------------------------------------------------


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extra = getattr(record, "kv", None) or {}
        tail = "".join(f" {k}={_kv(v)}" for k, v in extra.items())
        return f"{ts} {record.levelname.lower():7s} {record.name}: {record.getMessage()}{tail}"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(getattr(record, "kv", None) or {})
        return json.dumps(doc, default=str)


def _kv(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Structured logs on stderr: `key=value` text for people, JSON lines for machines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _KeyValueFormatter())
    root = logging.getLogger("regen")
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.propagate = False


def job_parser(
    prog: str, description: str | None, *, status: bool, progress: bool
) -> argparse.ArgumentParser:
    """The parser of a job CLI, with the flags every job shares from one parent parser.

    Always --log-level/--log-format (pass them to `setup_logging`) and --version; with `status`,
    --status-file/--status-interval (the job's `StatusFile`, OUTPUT_DIR/status.json by default); with
    `progress`, --progress/--no-progress (see `want_progress`).
    """
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common_flags(status=status, progress=progress)],
    )


def _common_flags(*, status: bool, progress: bool) -> argparse.ArgumentParser:
    from regen import package_version

    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("logging, status and progress")
    group.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    group.add_argument("--log-format", default="text", choices=("text", "json"))
    group.add_argument("--version", action="version", version=f"regen {package_version()}")
    if status:
        group.add_argument("--status-file", type=Path, help="status JSON (default: OUTPUT_DIR/status.json)")
        group.add_argument(
            "--status-interval", type=float, default=2.0, help="seconds between status updates (default 2)"
        )
    if progress:
        bar = group.add_mutually_exclusive_group()
        bar.add_argument(
            "--progress",
            dest="progress",
            action="store_true",
            default=None,
            help="progress bar (default: when stderr is a terminal)",
        )
        bar.add_argument("--no-progress", dest="progress", action="store_false")
    return parent


def kv(**fields: Any) -> dict[str, Any]:
    """`log.info("msg", extra=kv(a=1))` attaches structured fields to a log line."""
    return {"kv": fields}


class StatusFile:
    """A JSON status document, atomically replaced at most every `interval` seconds (and on demand).

    Not fsync'd on each update: it is a progress report, rewritten constantly; the final write is durable.
    """

    def __init__(self, path: str | os.PathLike[str] | None, interval: float = 2.0):
        self.path = Path(path) if path else None
        self.interval = interval
        self._last = 0.0

    def maybe_write(
        self, build: Callable[[], dict[str, Any]], *, force: bool = False, durable: bool = False
    ) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        try:
            atomic_write_json(self.path, build(), durable=durable)
        except OSError as exc:  # a full disk must not kill the job over a progress report
            log.warning("could not write status file", extra=kv(path=str(self.path), error=str(exc)))


def want_progress(flag: bool | None) -> bool:
    """Progress bar when asked, or by default when a person watches a terminal."""
    if flag is not None:
        return flag
    return sys.stderr.isatty()


def make_progress(enabled: bool, total: int | None, desc: str, unit: str = "rec"):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, smoothing=0.05, file=sys.stderr)


class Reservoir:
    """Latency samples for p50/p99 in bounded memory: exact up to `size` samples, a uniform sample after."""

    def __init__(self, size: int = 100_000, seed: int = 0):
        self.size = size
        self.samples: list[float] = []
        self.count = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.count += 1
        if len(self.samples) < self.size:
            self.samples.append(value)
            return
        j = self._rng.randrange(self.count)
        if j < self.size:
            self.samples[j] = value

    def quantile(self, q: float) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        # nearest-rank: the smallest value with at least q of the samples at or below it
        rank = max(1, math.ceil(q * len(ordered)))
        return ordered[rank - 1]


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s"
