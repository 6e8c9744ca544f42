"""Atomic, durable file writes: the one helper every part of regen writes its files through.

A reader (a role, the runner, a resumed job) sees either the old file or the whole new one, never a torn
one: data goes to a temporary file in the target's own directory (so the rename cannot cross a
filesystem), is flushed and fsync'd, renamed over the target, and the directory is fsync'd so that the
rename survives a power loss. Standard library only: it runs in any venv regen is installed into.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

# Temporary files are named `.<target name>.<random>.tmp`, so a job can sweep what a killed run left.
TMP_SUFFIX = ".tmp"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename or a new file inside it survives a power loss."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (e.g. certain FUSE mounts) refuse fsync on directories
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a regular-file write may be short on a signal or full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class AtomicFile:
    """A file that appears at `path` only when `commit()` is called (or its `with` block ends cleanly).

    For output written piece by piece (a shard streamed row by row, a `torch.save` into `.file`); whole
    documents go through `atomic_write_bytes`/`_text`/`_json`. `mode` is the final permission bits
    (0o600 for a file that holds a secret: the temporary file has them from its creation on).
    """

    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o644, durable: bool = True):
        self.path = Path(path)
        self.durable = durable
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=TMP_SUFFIX, dir=self.path.parent)
        self.tmp_path = Path(tmp)
        os.fchmod(fd, mode)
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def write(self, data: bytes | memoryview) -> None:
        self.file.write(data)

    def commit(self) -> None:
        try:
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        if self.durable:
            fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop what was written; the target is left as it was."""
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp_path)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, durable: bool = True
) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    with AtomicFile(path, mode=mode, durable=durable) as out:
        out.write(data)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, mode: int = 0o644, durable: bool = True
) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode, durable=durable)


def json_text(obj: Any) -> str:
    """The one JSON layout regen's documents are written in: indented, sorted keys, a final newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, mode: int = 0o644, durable: bool = True
) -> None:
    atomic_write_text(path, json_text(obj), mode=mode, durable=durable)


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when the file is missing, unreadable or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None
