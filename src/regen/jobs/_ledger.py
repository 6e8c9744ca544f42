"""Exactly-once output: append-only JSONL shards plus an id ledger that indexes them.

The design, and why it survives SIGKILL at any instant:

* Results are appended as whole lines to `<kind>-NNNNN.jsonl` shards (kind `completions` or `dropped`).
  **The shards are the source of truth**: a record is done exactly when its line is complete in a shard.
* After each batch of lines is written (and fsync'd, so the index can never be durable ahead of the data
  it points to), one fixed-size 32-byte record per line is appended to `ledger.bin`:
  (128-bit id digest, shard number, kind, end offset of the line). The ledger is an index, not a second
  truth: it only makes restarts cheap.
* On open, the ledger is checked against the shards (torn last record, records pointing past the end of a
  shard or at a missing one are cut off), then every shard is scanned *only after the last offset the
  ledger confirms*: complete lines there (written just before a kill, before their ledger records) are
  added to the ledger, and the first torn or unparsable line is truncated away with everything after it.
  A deleted ledger is rebuilt by scanning every shard.
* Ids live in memory as 128-bit BLAKE2b digests in sorted numpy arrays (16 bytes per id; 1M ids = 16 MB),
  queried in vectorised batches, plus a small set for ids finished during this run that is merged into
  the arrays as it grows. Starting over a 1M-id ledger reads 32 MB and sorts 1M integers.
* One writer at a time: an advisory `flock` on `<dir>/.lock`, released by the kernel when the process dies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from regen.fsio import atomic_write_bytes, fsync_dir, write_all

from ._common import DirectoryLock, kv

log = logging.getLogger("regen.jobs.ledger")

LEDGER_NAME = "ledger.bin"
LOCK_NAME = ".lock"
_MAGIC = b"REGEN-LEDGER\x00\x00\x00\x01"  # 16 bytes, version in the last byte
_HEADER_SIZE = 32
RECORD = np.dtype(
    [("hi", "<u8"), ("lo", "<u8"), ("file", "<u4"), ("kind", "u1"), ("pad", "V3"), ("end", "<u8")]
)
assert RECORD.itemsize == 32
_READ_CHUNK_RECORDS = 1 << 18
_ID_FAST = re.compile(rb'^\{"id": ?"([^"\\]*)"')


def id_digest(record_id: str) -> bytes:
    """The 16-byte key of an id (collisions: ~n^2/2^129, i.e. never at any realistic size)."""
    # surrogatepass: an id holding an escaped lone surrogate ("\\ud800") is a row to reject, not a crash
    return hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _split_digests(digests: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    pairs = np.frombuffer(b"".join(digests), dtype=">u8").reshape(-1, 2)
    return pairs[:, 0].astype("<u8"), pairs[:, 1].astype("<u8")


def line_id(raw: bytes) -> str | None:
    """The `id` of one JSONL line, or None when the line is not a JSON object with a string/int id.

    Lines that regen writes start with `{"id": "...", ` so the common case avoids a full JSON parse.
    """
    m = _ID_FAST.match(raw)
    if m is not None:
        try:
            return m.group(1).decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    value = obj.get("id")
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


def _whole_lines_size(path: Path, chunk: int = 1 << 16) -> int:
    """The size of `path` up to its last newline, a torn last line cut off (0 when there is no file)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = end = os.fstat(fd).st_size
        while end > 0:
            start = max(0, end - chunk)
            at = os.pread(fd, end - start, start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
        if end != size:
            log.warning("cutting a torn last line off a file", extra=kv(file=str(path), offset=end))
            os.ftruncate(fd, end)
            os.fsync(fd)
        return end
    finally:
        os.close(fd)


_RECENT_IDS = 1 << 14  # this run's ids kept in a Python set before they join the sorted arrays


class IdIndex:
    """A set of id digests: sorted arrays (bulk, from the ledger) plus a Python set (this run's ids)."""

    def __init__(self) -> None:
        self._hi = np.empty(0, dtype="<u8")
        self._lo = np.empty(0, dtype="<u8")
        self._recent: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._hi) + len(self._recent)

    def load(self, hi: np.ndarray, lo: np.ndarray) -> None:
        order = np.argsort(hi, kind="stable")
        self._hi = np.ascontiguousarray(hi[order])
        self._lo = np.ascontiguousarray(lo[order])

    def add(self, digest: bytes) -> None:
        self._recent.add(digest)
        # The set costs about 100 bytes per id against 16 in the arrays, and what it held stays with the
        # process after a merge (the allocator keeps its arenas): merged at a fixed 16k ids, so the set's
        # share of the memory does not grow with the run. A merge inserts the sorted new ids into the
        # sorted arrays, one pass over them (no sort of the whole).
        if len(self._recent) >= _RECENT_IDS:
            self._compact()

    def _compact(self) -> None:
        hi, lo = _split_digests(list(self._recent))
        order = np.argsort(hi, kind="stable")
        hi, lo = hi[order], lo[order]
        at = np.searchsorted(self._hi, hi)
        self._hi = np.insert(self._hi, at, hi)
        self._lo = np.insert(self._lo, at, lo)
        self._recent = set()

    def __contains__(self, digest: bytes) -> bool:
        if digest in self._recent:
            return True
        if not len(self._hi):
            return False
        hi = int.from_bytes(digest[:8], "big")
        lo = int.from_bytes(digest[8:], "big")
        left = int(np.searchsorted(self._hi, np.uint64(hi), "left"))
        right = int(np.searchsorted(self._hi, np.uint64(hi), "right"))
        return bool((self._lo[left:right] == np.uint64(lo)).any()) if right > left else False

    def contains_many(self, digests: Sequence[bytes]) -> list[bool]:
        if not digests:
            return []
        found = np.zeros(len(digests), dtype=bool)
        if len(self._hi):
            qh, ql = _split_digests(digests)
            left = np.searchsorted(self._hi, qh, "left")
            right = np.searchsorted(self._hi, qh, "right")
            count = right - left
            one = count == 1
            found[one] = self._lo[left[one]] == ql[one]
            # the first 64 bits of two different ids agree with probability 2^-64 per pair: check slowly
            for i in np.nonzero(count > 1)[0]:
                found[i] = bool((self._lo[left[i] : right[i]] == ql[i]).any())
        result = found.tolist()
        if self._recent:
            recent = self._recent
            for i, digest in enumerate(digests):
                if not result[i] and digest in recent:
                    result[i] = True
        return result


@dataclass
class OpenReport:
    """What `ShardStore.open` found and repaired; logged and put into the status file."""

    ledger_records: int = 0  # valid records found in the ledger
    ledger_dropped: int = 0  # ledger records cut off because they were torn or pointed past the data
    recovered_lines: int = (
        0  # complete shard lines that the ledger did not know yet (written just before a kill)
    )
    truncated_bytes: int = 0  # torn or unparsable shard bytes removed
    removed_files: list[str] = field(default_factory=list)  # empty shards left by a kill
    done_by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Current:
    num: int
    fd: int
    records: int
    offset: int


class ShardStore:
    """Append-only JSONL shards with an id ledger; see the module docstring for the guarantees."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        kinds: Sequence[str] = ("completions", "dropped"),
        shard_records: int = 100_000,
        fsync: bool = True,
        read_only: bool = False,
    ):
        self.dir = Path(directory)
        self.kinds = tuple(kinds)
        self.shard_records = max(1, int(shard_records))
        self.fsync = fsync
        self.read_only = read_only
        self.index = IdIndex()
        self._pattern = re.compile(r"^(" + "|".join(map(re.escape, self.kinds)) + r")-(\d{5,})\.jsonl$")
        self._current: dict[int, _Current] = {}
        self._next_num = 0
        self._ledger_fd: int | None = None
        self._writer_lock: DirectoryLock | None = None
        self.report = OpenReport()

    # ---------------------------------------------------------------- open / reconcile

    def shard_path(self, kind: int, num: int) -> Path:
        return self.dir / f"{self.kinds[kind]}-{num:05d}.jsonl"

    def shard_files(self, kind: str | None = None) -> list[Path]:
        """Existing shard files in order (of one kind, or all)."""
        found = []
        if self.dir.is_dir():
            for entry in os.scandir(self.dir):
                m = self._pattern.match(entry.name)
                if m and (kind is None or m.group(1) == kind):
                    found.append((int(m.group(2)), Path(entry.path)))
        return [p for _, p in sorted(found)]

    def open(self) -> OpenReport:
        if self.read_only:
            if self.dir.is_dir():
                self._reconcile()
            return self.report
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        self._reconcile()
        return self.report

    def _lock(self) -> None:
        # One writer per output directory: two would break the exactly-once guarantee.
        self._writer_lock = DirectoryLock(self.dir, "generate", LOCK_NAME).acquire()

    def _scan_files(self) -> dict[int, tuple[int, Path, int]]:
        files: dict[int, tuple[int, Path, int]] = {}
        if not self.dir.is_dir():
            return files
        for entry in os.scandir(self.dir):
            m = self._pattern.match(entry.name)
            if m:
                files[int(m.group(2))] = (
                    self.kinds.index(m.group(1)),
                    Path(entry.path),
                    entry.stat().st_size,
                )
        return files

    def _read_ledger(self, files: dict[int, tuple[int, Path, int]]) -> tuple[np.ndarray, int]:
        """Valid ledger records (hi, lo, file, kind, end columns) and how many bytes of the file to keep."""
        path = self.dir / LEDGER_NAME
        empty = np.empty(0, dtype=RECORD)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return empty, 0
        with open(path, "rb") as fh:
            header = fh.read(_HEADER_SIZE)
            if len(header) < _HEADER_SIZE or header[:16] != _MAGIC:
                log.warning(
                    "ledger header unreadable; rebuilding it from the shards", extra=kv(path=str(path))
                )
                return empty, 0
            n = (size - _HEADER_SIZE) // RECORD.itemsize
            # lookup tables: for every shard number, its size and kind (-1 where no such shard)
            top = max(files, default=-1) + 1
            size_of = np.full(top + 1, -1, dtype=np.int64)
            kind_of = np.full(top + 1, -1, dtype=np.int64)
            for num, (kind, _, fsize) in files.items():
                size_of[num] = fsize
                kind_of[num] = kind
            parts = []
            kept = 0
            while kept < n:
                chunk = np.fromfile(fh, dtype=RECORD, count=min(_READ_CHUNK_RECORDS, n - kept))
                if not len(chunk):
                    break
                fnum = np.minimum(chunk["file"].astype(np.int64), top)
                end = chunk["end"].astype(np.int64)
                ok = (end > 0) & (end <= size_of[fnum]) & (kind_of[fnum] == chunk["kind"])
                if not ok.all():
                    first_bad = int(np.argmin(ok))
                    parts.append(chunk[:first_bad].copy())
                    kept += first_bad
                    break
                parts.append(chunk)
                kept += len(chunk)
        self.report.ledger_dropped = n - kept
        records = np.concatenate(parts) if parts else empty
        return records, _HEADER_SIZE + kept * RECORD.itemsize

    def _reconcile(self) -> None:
        files = self._scan_files()
        records, keep_bytes = self._read_ledger(files)
        self.report.ledger_records = len(records)
        if self.report.ledger_dropped:
            log.warning(
                "ledger records past the data were dropped; the shards will be rescanned",
                extra=kv(dropped=self.report.ledger_dropped),
            )

        confirmed: dict[int, int] = {}
        if len(records):
            rev_files = records["file"][::-1]
            uniq, idx = np.unique(rev_files, return_index=True)
            last = len(records) - 1 - idx
            confirmed = dict(zip(uniq.tolist(), records["end"][last].tolist(), strict=True))

        new_rows: list[tuple[bytes, int, int, int]] = []
        for num in sorted(files):
            kind, path, fsize = files[num]
            start = confirmed.get(num, 0)
            if start == fsize == 0:
                if not self.read_only:
                    os.unlink(path)  # an empty shard created just before a kill
                    self.report.removed_files.append(path.name)
                continue
            if start < fsize:
                new_rows.extend(self._scan_tail(num, kind, path, start, fsize))

        if not self.read_only:
            self._write_ledger_repairs(keep_bytes, new_rows)
            if self.report.removed_files or self.report.truncated_bytes:
                fsync_dir(self.dir)

        hi_parts = [records["hi"]]
        lo_parts = [records["lo"]]
        kinds = [records["kind"]]
        if new_rows:
            hi, lo = _split_digests([r[0] for r in new_rows])
            hi_parts.append(hi)
            lo_parts.append(lo)
            kinds.append(np.array([r[1] for r in new_rows], dtype=np.uint8))
        all_kinds = np.concatenate(kinds)
        self.report.done_by_kind = {k: int((all_kinds == i).sum()) for i, k in enumerate(self.kinds)}
        self.index.load(np.concatenate(hi_parts), np.concatenate(lo_parts))
        self._next_num = max(files, default=-1) + 1
        del records

    def _scan_tail(
        self, num: int, kind: int, path: Path, start: int, fsize: int
    ) -> list[tuple[bytes, int, int, int]]:
        """Complete lines after `start` become ledger rows; the first torn/invalid line is cut off."""
        rows: list[tuple[bytes, int, int, int]] = []
        offset = start
        cut_at: int | None = None
        with open(path, "rb") as fh:
            fh.seek(start)
            for raw in fh:
                line_end = offset + len(raw)
                record_id = line_id(raw.rstrip(b"\n")) if raw.endswith(b"\n") else None
                if record_id is None:
                    cut_at = offset
                    break
                rows.append((id_digest(record_id), kind, num, line_end))
                offset = line_end
        self.report.recovered_lines += len(rows)
        if cut_at is not None:
            self.report.truncated_bytes += fsize - cut_at
            log.warning(
                "cutting a torn or unparsable tail off a shard",
                extra=kv(shard=path.name, offset=cut_at, bytes=fsize - cut_at),
            )
            if not self.read_only:
                with open(path, "r+b") as fh:
                    fh.truncate(cut_at)
                    os.fsync(fh.fileno())
        return rows

    def _write_ledger_repairs(self, keep_bytes: int, new_rows: list[tuple[bytes, int, int, int]]) -> None:
        path = self.dir / LEDGER_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if keep_bytes < _HEADER_SIZE:
            os.ftruncate(fd, 0)
            write_all(fd, _MAGIC + b"\x00" * (_HEADER_SIZE - len(_MAGIC)))
            keep_bytes = _HEADER_SIZE
        elif os.fstat(fd).st_size != keep_bytes:
            os.ftruncate(fd, keep_bytes)
        os.lseek(fd, 0, os.SEEK_END)
        if new_rows:
            write_all(fd, self._encode(new_rows))
        os.fsync(fd)
        self._ledger_fd = fd

    @staticmethod
    def _encode(rows: Sequence[tuple[bytes, int, int, int]]) -> bytes:
        arr = np.zeros(len(rows), dtype=RECORD)
        hi, lo = _split_digests([r[0] for r in rows])
        arr["hi"] = hi
        arr["lo"] = lo
        arr["kind"] = [r[1] for r in rows]
        arr["file"] = [r[2] for r in rows]
        arr["end"] = [r[3] for r in rows]
        return arr.tobytes()

    # ---------------------------------------------------------------- append

    def _file_for(self, kind: int) -> _Current:
        cur = self._current.get(kind)
        if cur is not None and cur.records >= self.shard_records:
            self._close_file(cur)
            del self._current[kind]
            cur = None
        if cur is None:
            num = self._next_num
            self._next_num += 1
            fd = os.open(
                self.shard_path(kind, num), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644
            )
            # the new name must be durable before a ledger record can point into the file
            fsync_dir(self.dir)
            cur = _Current(num=num, fd=fd, records=0, offset=0)
            self._current[kind] = cur
        return cur

    def _close_file(self, cur: _Current) -> None:
        if self.fsync:
            os.fsync(cur.fd)
        os.close(cur.fd)

    def append(self, items: Iterable[tuple[int, bytes, bytes]]) -> None:
        """Durably append (kind, id digest, JSON line without newline) items.

        Shard bytes are written (and fsync'd) before the ledger records that point at them, so the
        ledger can lag the data (recovered on open) but never lead it. The caller adds the digests to
        `self.index` afterwards, on its own thread: this method may run in a worker thread while the
        event loop queries the index.
        """
        if self.read_only or self._ledger_fd is None:
            raise RuntimeError("store is not open for writing")
        buffers: dict[int, list[bytes]] = {}
        rows: list[tuple[bytes, int, int, int]] = []
        touched: dict[int, _Current] = {}
        for kind, digest, line in items:
            cur = self._file_for(kind)
            data = line + b"\n"
            buffers.setdefault(cur.num, []).append(data)
            cur.records += 1
            cur.offset += len(data)
            touched[cur.num] = cur
            rows.append((digest, kind, cur.num, cur.offset))
            if cur.records >= self.shard_records:
                # flush this shard before the next item opens a new one
                self._flush(buffers, touched)
        self._flush(buffers, touched)
        if rows:
            write_all(self._ledger_fd, self._encode(rows))

    def _flush(self, buffers: dict[int, list[bytes]], touched: dict[int, _Current]) -> None:
        for num, parts in list(buffers.items()):
            cur = touched[num]
            write_all(cur.fd, b"".join(parts))
            if self.fsync:
                os.fsync(cur.fd)
            del buffers[num]

    @staticmethod
    def _aside_intent(aside: Path) -> Path:
        return aside.with_name(f".{aside.name}.intent")

    def move_aside_pending(self, aside: Path) -> bool:
        """Whether a `move_aside` into `aside` was interrupted (the next one must run to finish it)."""
        return self._aside_intent(aside).exists()

    def _resume_aside(self, aside: Path, intent: Path) -> set[bytes]:
        """After a kill inside `move_aside`: the lines it had appended to `aside` already (by their shard
        and record), a torn last line cut off. Those are not appended again: each moved record is in
        `aside` exactly once."""
        try:
            start = int(json.loads(intent.read_text())["aside_size"])
        except (OSError, ValueError, KeyError, TypeError):
            start = None  # an intent torn by the kill before it was durable: nothing was appended
        if start is None or not aside.exists():
            return set()
        appended: set[bytes] = set()
        with open(aside, "r+b") as fh:
            fh.seek(start)
            offset = start
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break
                appended.add(self._aside_key(raw))
                offset += len(raw)
            if offset < os.fstat(fh.fileno()).st_size:
                log.warning(
                    "cutting a torn line off the moved-aside records",
                    extra=kv(file=aside.name, offset=offset),
                )
                fh.truncate(offset)
                os.fsync(fh.fileno())
        return appended

    @staticmethod
    def _aside_key(line: bytes) -> bytes:
        """What makes a moved line the same line again: its shard and its record, not its reason (which a
        second attempt with another prompt set may see differently)."""
        try:
            doc = json.loads(line)
            ident = json.dumps([doc.get("shard"), doc.get("record")], sort_keys=True).encode()
        except ValueError:
            ident = line.rstrip(b"\n")
        return hashlib.blake2b(ident, digest_size=16).digest()

    def move_aside(self, reason_for, aside: Path) -> dict[str, int]:
        """Move every record line for which `reason_for(line)` names a reason out of the shards into
        `aside` (one `{"reason", "shard", "record"}` object per line), then rebuild the ledger.

        For records that later stages must not read (superseded by an edited prompt, orphaned by a removed
        one): moved, never deleted, and listed in `aside` exactly once. Call right after `open()`, before
        any `append`. Crash-safe in this order: an intent file records the size of `aside` before the move
        (durable first); the moved lines are durable in `aside` next; the ledger goes next (a rebuilt
        ledger never points into a rewritten shard); then each shard is replaced atomically; the intent
        goes last. A kill in between leaves the stale lines in their shards (some shards rewritten, some
        not), found and moved again by the next call, which appends only the lines that the interrupted
        one had not (`_resume_aside`).
        """
        if self.read_only or self._ledger_fd is None or self._current:
            raise RuntimeError("move_aside needs a store just opened for writing")
        intent = self._aside_intent(aside)
        resuming = intent.exists()
        appended = self._resume_aside(aside, intent) if resuming else set()
        plan: list[tuple[Path, list[bytes], list[bytes]]] = []
        counts: dict[str, int] = {}
        moved: list[bytes] = []
        for path in self.shard_files():
            keep: list[bytes] = []
            gone: list[bytes] = []
            with open(path, "rb") as fh:
                for raw in fh:
                    reason = reason_for(raw.rstrip(b"\n"))
                    if reason is None:
                        keep.append(raw)
                        continue
                    gone.append(raw)
                    counts[reason] = counts.get(reason, 0) + 1
                    entry = b'{"reason": %s, "shard": %s, "record": %s}\n' % (
                        json.dumps(reason).encode(),
                        json.dumps(path.name).encode(),
                        raw.rstrip(b"\n"),
                    )
                    if not appended or self._aside_key(entry) not in appended:
                        moved.append(entry)
            if gone:
                plan.append((path, keep, gone))
        if not plan:
            if resuming:
                intent.unlink()
                fsync_dir(self.dir)
            return counts
        if not resuming:
            size = _whole_lines_size(aside)
            atomic_write_bytes(intent, json.dumps({"aside_size": size}).encode() + b"\n")
        if moved:
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                write_all(fd, b"".join(moved))
                os.fsync(fd)
            finally:
                os.close(fd)
        os.close(self._ledger_fd)
        self._ledger_fd = None
        os.unlink(self.dir / LEDGER_NAME)
        fsync_dir(self.dir)
        for path, keep, _ in plan:
            if keep:
                tmp = path.with_name(f".{path.name}.rewrite.tmp")
                with open(tmp, "wb") as fh:
                    fh.write(b"".join(keep))
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            else:
                os.unlink(path)
        fsync_dir(self.dir)
        intent.unlink()
        fsync_dir(self.dir)
        self.index = IdIndex()
        self.report = OpenReport()
        self._reconcile()
        return counts

    def sync(self) -> None:
        if self._ledger_fd is not None and self.fsync:
            os.fsync(self._ledger_fd)

    def close(self) -> None:
        for cur in self._current.values():
            with contextlib.suppress(OSError):
                self._close_file(cur)
        self._current.clear()
        if self._ledger_fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._ledger_fd)
            os.close(self._ledger_fd)
            self._ledger_fd = None
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
