"""Shared plumbing for regen jobs: clear errors, hashes, streaming JSONL, logging, status, progress.

Files are written through `regen.fsio` (atomic, durable); the status document's keys are `regen.status`.

Everything here is standard library (plus tqdm, a core dependency) so that any job can use it on a host
whose venv carries nothing else.
"""

from __future__ import annotations

import argparse
import array
import errno
import fcntl
import gzip
import json
import logging
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

# The jobs import the user-error and its exit code (2) from here, beside the other codes below.
from regen.errors import EXIT_USAGE as EXIT_USAGE
from regen.errors import JobError
from regen.fsio import atomic_write_json, json_text
from regen.module_utils.regen_files import file_sha256
from regen.module_utils.regen_secrets import API_KEY_ENV, SecretFileError, read_api_key

log = logging.getLogger("regen.jobs")

# Exit codes shared by the jobs; scripts and the roles rely on them (docs/stages.md, "Exit codes of the
# jobs").
EXIT_OK = 0
EXIT_FAILED_RECORDS = 1  # the job ran, some records ended in the errors file
EXIT_UNAVAILABLE = 3  # the job stopped early because what it depends on stayed down
EXIT_CRASHED = 4  # an unexpected error (a bug): the traceback is on stderr, the reason in status.json
EXIT_OUTPUT = 5  # the output cannot be written: not a directory, read-only, or the disk is full
EXIT_INTERRUPTED = 130  # SIGINT; SIGTERM is 143
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the job is (after `stop_on_sigterm`), so it unwinds like Ctrl-C: temporary
    files are dropped, the status file says `interrupted`, the exit code is 143."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def stop_on_sigterm() -> None:
    """A synchronous job's SIGTERM unwinds it (`Terminated`) instead of killing it mid-write."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def stop_signals_done() -> None:
    """The job's end is decided (its output committed, its final status about to be written): a SIGTERM
    or SIGINT from here on changes nothing, so it is ignored instead of turning a finished run into a
    killed one (exit -15 or 143 beside a status file that says `done`). Only in a job's own process: a
    caller that runs a job's main in-process (tests) keeps its handlers."""
    if _OWN_PROCESS:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class OutputError(JobError):
    """The output cannot be written (a file in the way, a read-only filesystem, a full disk)."""

    exit_code = EXIT_OUTPUT


_OWN_PROCESS = False  # set by the job CLIs' entry points: the process is the job's own


def run_main(
    main: Callable[[list[str] | None], int], argv: list[str] | None = None, *, own_process: bool = False
) -> int:
    """Run a job's main: a `JobError` becomes one readable line, anything else a crash (exit 4).

    Either way the job's status file (every `StatusFile` that `arm()`ed itself) is rewritten to say
    `failed`, with the reason and the exit code, so that no reader is left with `running`.
    `own_process`: the entry point of a job's CLI (`python -m regen.jobs.X`), see `stop_signals_done`.
    """
    global _OWN_PROCESS
    _OWN_PROCESS = _OWN_PROCESS or own_process
    try:
        try:
            return main(argv)
        except Exception as exc:
            interrupt = interrupt_behind(exc)
            if interrupt is None:
                raise
            # A signal's exception is raised wherever the main thread is, including inside the standard
            # library's own bookkeeping (threading's locks, asyncio's executor), whose unwinding can then
            # fail with an error of its own ("release unlocked lock"). The run was stopped by the signal:
            # that is what it reports, not a crash; the secondary error is kept for --log-level debug.
            log.debug("an error while unwinding after a signal", exc_info=exc)
            raise interrupt from None
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _fail_status_files(str(exc), exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
        print("terminated" if code == EXIT_TERMINATED else "interrupted", file=sys.stderr)
        _fail_status_files("stopped by a signal; run again to continue", code, state="interrupted")
        return code
    except BrokenPipeError:
        return EXIT_OK
    except OSError as exc:
        described = describe_os_error(exc)
        if described is None:
            return _crashed(exc)
        print(f"error: {described}", file=sys.stderr)
        _fail_status_files(described, EXIT_OUTPUT)
        return EXIT_OUTPUT
    except Exception as exc:  # the last line of defence: report, never pass silently
        return _crashed(exc)


_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def control_character(text: str) -> str | None:
    """The first control character (C0 or DEL) in `text`, None when there is none: an id must not hold
    one, since a NUL or a control character reads as another id in logs, file names and terminals."""
    found = _CONTROL_CHARACTER.search(text)
    return found.group() if found else None


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (`Terminated`) that `exc` was raised while handling, if any."""
    seen: set[int] = set()
    context: BaseException | None = exc
    while context is not None and id(context) not in seen:
        if isinstance(context, KeyboardInterrupt):
            return context
        seen.add(id(context))
        context = context.__context__
    return None


def _crashed(exc: BaseException) -> int:
    traceback.print_exc(file=sys.stderr)
    reason = f"the job crashed: {type(exc).__name__}: {exc}"
    print(f"error: {reason} (a bug: please report it with the traceback above)", file=sys.stderr)
    _fail_status_files(reason, EXIT_CRASHED)
    return EXIT_CRASHED


# Errors of the filesystem that the user fixes (not bugs), and what to do about each.
_OS_ERRORS = {
    errno.ENOSPC: "the disk is full; free space there (or choose another output directory) and run again",
    errno.EDQUOT: "the disk quota is exhausted; free space there and run again",
    errno.EROFS: "the filesystem is read-only; choose a writable output directory",
    errno.EACCES: "permission denied; choose a directory this user can write, or fix its permissions",
    errno.EPERM: "permission denied; choose a directory this user can write, or fix its permissions",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "it is a directory where a file was expected",
}


def describe_os_error(exc: OSError) -> str | None:
    """One line for a filesystem error a user can fix (full disk, read-only, in the way), else None."""
    hint = _OS_ERRORS.get(exc.errno or -1)
    if hint is None:
        return None
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}: {hint}"


def prepare_output_dir(path: str | os.PathLike[str], flag: str = "--output-dir") -> Path:
    """Create the output directory, or say exactly why it cannot be written (an `OutputError`)."""
    out = Path(path)
    for parent in [out, *out.parents]:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                where = "is" if parent == out else f"lies under {parent}, which is"
                raise OutputError(f"{flag} {out} {where} a file, not a directory; choose another path")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
        # os.access ignores what root may do on a read-only mount; a real file says it as it is
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        hint = _OS_ERRORS.get(exc.errno or -1, "choose another path")
        raise OutputError(f"{flag} {out} cannot be written: {exc.strerror or exc}: {hint}") from None
    return out


class DirectoryLock:
    """One job per output directory: an advisory `flock` on DIR/NAME that holds the holder's pid.

    The kernel releases it when the process dies, so a killed job never leaves a stale lock.
    """

    def __init__(self, directory: str | os.PathLike[str], what: str, name: str = ".lock"):
        self.path = Path(directory) / name
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JobError(
                f"another {self.what} job (pid {holder}) is writing {self.path.parent}; wait for it to "
                "finish or stop it, then run again"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------
# Hashes
# --------------------------------------------------------------------------------------------------


def serving_api_key(path: str | None, name: str = API_KEY_ENV) -> str | None:
    """The model server's API key from the serve stage's env file (`REGEN_SERVING_API_KEY=`), or None
    when no file is given (a server without a key); a JobError when the file lacks it."""
    try:
        return read_api_key(path, name)
    except SecretFileError as exc:
        raise JobError(str(exc)) from None


def json_object_arg(text: str, flag: str) -> dict[str, Any]:
    """A command-line flag that takes a JSON object (--chat-template-kwargs, --extra-body), or a JobError
    that says what is wrong with it and what it should look like."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise JobError(
            f"{flag} is not valid JSON ({exc}); pass an object such as '{{\"thinking\": true}}'"
        ) from None
    if not isinstance(value, dict):
        example = '{"thinking": true}'
        raise JobError(f"{flag} must be a JSON object such as '{example}', got {type(value).__name__}")
    return value


# json.dumps with any option builds a new encoder per call; a hot path (a key per record) keeps one
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, UTF-8. Used for content hashes."""
    return _CANONICAL.encode(obj).encode()


# The jobs' name for module_utils' one file digest.
sha256_file = file_sha256


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
    whole file. A final line without a newline is yielded too (input files need not end with one).
    A compressed file cut short raises a `JobError` naming it (not gzip's bare `EOFError`)."""
    with readable_input(path), open_binary(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.rstrip(b"\r\n")
            if line.strip():
                yield lineno, line


def count_lines(path: str | os.PathLike[str], chunk: int = 1 << 22) -> int:
    """Count non-empty lines quickly (newline count plus an unterminated last line); reads the whole
    file, so a compressed file cut short is found here (a `JobError`), before any work starts."""
    n = 0
    last = b"\n"
    with readable_input(path), open_binary(path) as fh:
        while block := fh.read(chunk):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (0 if last == b"\n" else 1)


class readable_input:
    """Turns the errors of a damaged compressed file into a `JobError` that names the file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, EOFError | gzip.BadGzipFile | zlib.error):
            raise JobError(
                f"{self.path} is cut short or damaged ({type(exc).__name__}: {exc or 'unexpected end'}); "
                "copy or build it again (gzip -t checks a .gz file)"
            ) from None
        return False


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


_ARMED: weakref.WeakSet[StatusFile] = weakref.WeakSet()


def _fail_status_files(error: str, exit_code: int, state: str = "failed") -> None:
    for status in list(_ARMED):
        status.finish(state=state, error=error, exit_code=exit_code)


class StatusFile:
    """A JSON status document, atomically replaced at most every `interval` seconds (and on demand).

    Not fsync'd on each update: it is a progress report, rewritten constantly; the final write is durable.
    Once `arm()`ed, a job that ends by an error (`run_main`) gets its document rewritten as `failed`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        interval: float = 2.0,
        *,
        job: str | None = None,
        item: str = "record",
    ):
        self.path = Path(path) if path else None
        self.interval = interval
        self.job = job
        self.item = item
        self._last = 0.0
        self._build: Callable[[], dict[str, Any]] | None = None
        self._doc: dict[str, Any] | None = None

    def arm(self) -> StatusFile:
        """Report this job's end in this file even when it ends by an exception (see `run_main`)."""
        _ARMED.add(self)
        return self

    def disarm(self) -> None:
        _ARMED.discard(self)

    def maybe_write(
        self, build: Callable[[], dict[str, Any]], *, force: bool = False, durable: bool = False
    ) -> None:
        if self.path is None:
            return
        self._build = build
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        self._write(build(), durable=durable)

    def _write(self, doc: dict[str, Any], *, durable: bool) -> None:
        self._doc = doc
        try:
            atomic_write_json(self.path, doc, durable=durable)
        except OSError as exc:  # a full disk must not kill the job over a progress report
            if durable and self._overwrite_in_place(doc):
                return
            log.warning("could not write status file", extra=kv(path=str(self.path), error=str(exc)))

    def _overwrite_in_place(self, doc: dict[str, Any]) -> bool:
        """The final document on a full disk: the temporary file of an atomic write finds no free block,
        but the old document's own blocks are there to reuse. Not atomic; better than a stale `running`."""
        assert self.path is not None
        data = json_text(doc).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except OSError:
            return False
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def finish(self, *, state: str, error: str | None, exit_code: int) -> None:
        """The final document of a job that ended by an error: its last counts, the state and the reason."""
        self.disarm()
        if self.path is None:
            return
        from regen.status import Status

        doc: dict[str, Any] | None = None
        if self._build is not None:
            try:
                doc = self._build()
            except Exception:  # the job is already failing; fall back to the last document
                doc = self._doc
        if doc is None:
            doc = Status(job=self.job or "job", state=state, item=self.item, line="").document()
        job = doc.get("job") or self.job or "job"
        doc = dict(
            doc,
            state=state,
            error=error,
            exit_code=exit_code,
            line=f"{job}: state={state} exit_code={exit_code}: {error}",
            pid=os.getpid(),
            updated_at=time.time(),
        )
        self._write(doc, durable=True)


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
        # 8 bytes a sample (a list of floats takes 32): the reservoir is the biggest thing a long run keeps
        self.samples = array.array("d")
        self.count = 0
        self._rng = random.Random(seed)
        self._sorted = True  # `samples` is in order (a reservoir's positions mean nothing): sorted in
        # place when a quantile is asked after new samples, so one sort serves p50 and p99, and the next
        # sort finds the list mostly in order

    def add(self, value: float) -> None:
        self.count += 1
        self._sorted = False
        if len(self.samples) < self.size:
            self.samples.append(value)
            return
        j = self._rng.randrange(self.count)
        if j < self.size:
            self.samples[j] = value

    def quantile(self, q: float) -> float | None:
        if not self.samples:
            return None
        if not self._sorted:
            import numpy as np  # the generation job has it loaded (its ledger); sorted in place, no copy

            np.frombuffer(self.samples, dtype=np.float64).sort()
            self._sorted = True
        ordered = self.samples
        # nearest-rank: the smallest value with at least q of the samples at or below it
        rank = max(1, math.ceil(q * len(ordered)))
        return ordered[rank - 1]


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s"
