"""Fault injection: bit rot in a file that keeps its size and modification time, as a failing disk or a bad
copy leaves it. Transfer tools that compare size and time (rsync's quick check, hf's record of a download)
then take the file for current; only a checksum finds it."""

from __future__ import annotations

import os
from pathlib import Path


def rot_in_place(path: Path, offset: int = 100, garbage: bytes = b"ROT!") -> None:
    """Overwrite len(garbage) bytes at offset, then restore the file's access and modification times."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset : offset + len(garbage)] = garbage
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
