"""directory_archive: the archives that ship sources and wheelhouses are byte-for-byte reproducible, so the
copy to a host is changed only when a file's content changed."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import directory_archive as bundle


def _tree(base: Path) -> Path:
    src = base / "regen"
    (src / "jobs" / "__pycache__").mkdir(parents=True)
    (src / "__init__.py").write_text("__version__ = '0.1.0'\n")
    (src / "jobs" / "run.py").write_text("print('job')\n")
    (src / "jobs" / "__pycache__" / "run.cpython-311.pyc").write_bytes(b"\0junk")
    return src


def _pack(src: Path, dest: Path, compress: bool) -> bytes:
    bundle.write_archive(bundle.entries(str(src)), str(dest), compress)
    return dest.read_bytes()


def test_same_content_same_bytes_even_after_touch(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    for compress in (True, False):
        first = _pack(src, tmp_path / "a", compress)
        os.utime(src / "jobs" / "run.py", (1, 1))
        assert _pack(src, tmp_path / "b", compress) == first
    with tarfile.open(tmp_path / "a") as tar:
        assert tar.getnames() == ["regen/__init__.py", "regen/jobs/run.py"]  # no bytecode
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_changed_content_changes_bytes(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    first = _pack(src, tmp_path / "a", True)
    (src / "jobs" / "run.py").write_text("print('job v2')\n")
    assert _pack(src, tmp_path / "b", True) != first
