"""File digests the modules share: which files a wheel of the regen project is built from and their digest
(the wheel cache key), the sha256 of one file (a wheel, an archive) or of bytes, and the end of a log file.
The regen package uses the same functions (module_utils/__init__.py says how).

Standard library only. The project_wheel module rebuilds the wheel only when the source digest changes, so
an unchanged checkout keeps the same wheel file (same bytes) and its copy to every host stays changed=0.
"""

from __future__ import annotations

import hashlib
import os

# What the build backend reads: the project table, the readme it embeds as the long description, and the
# package sources (pyproject.toml's `where = ["src"]`).
PROJECT_FILES = ("pyproject.toml", "README.md")
SOURCE_DIR = "src"
_SKIP_DIRS = {"build", "dist"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def tree_files(top, skip_dir=None, skip_file=None, follow_links=False):
    """Paths (relative to `top`, sorted) of the files below `top`, bytecode and __pycache__ left out, and
    the directories and files the optional predicates name (called with a bare name). `follow_links`
    descends into linked directories (as setuptools does when it finds packages)."""
    found = []
    for root, dirs, files in os.walk(top, followlinks=follow_links):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (skip_dir and skip_dir(d)))
        for name in files:
            if not name.endswith(_SKIP_SUFFIXES) and not (skip_file and skip_file(name)):
                found.append(os.path.relpath(os.path.join(root, name), top))
    return sorted(found)


def source_files(project):
    """Paths (relative to `project`, sorted) of every file a wheel build of `project` reads."""
    found = [name for name in PROJECT_FILES if os.path.isfile(os.path.join(project, name))]
    # src/regen/module_utils links to module_utils/ (see module_utils/__init__.py): the build packages what
    # the link points at, so those files are sources of the wheel too.
    sources = tree_files(
        os.path.join(project, SOURCE_DIR),
        skip_dir=lambda d: d in _SKIP_DIRS or d.endswith(".egg-info"),
        follow_links=True,
    )
    return sorted(found + [os.path.join(SOURCE_DIR, name) for name in sources])


def source_digest(project, files):
    """sha256 over the names and contents of `files` (relative to `project`)."""
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode("utf-8") + b"\0")
        with open(os.path.join(project, name), "rb") as handle:
            digest.update(hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()


# How much of a server's log the diagnosis reads: enough for a traceback and the lines before it, small
# enough to read at once however long the server has been logging.
LOG_TAIL_BYTES = 256 * 1024


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data):
    """Hex sha256 of bytes, or of text as UTF-8."""
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def read_tail(path, max_bytes=LOG_TAIL_BYTES):
    """The last `max_bytes` of a (log) file as text, undecodable bytes replaced; "" when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - max_bytes))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
