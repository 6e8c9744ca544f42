"""Stopping a cancelled run completely.

ansible-runner cancels by SIGKILL to ansible-playbook's process group. Ansible's worker processes call
``setsid()``, so they (and the module each one runs, e.g. a long ``wait_for`` or a synchronous job) are in
other groups and would go on as orphans. regen therefore notes ansible-playbook's descendants at the
moment of the cancel and, once runner has killed the main process, ends their process groups too.

What a role launched on purpose to outlive the play (an ``async`` job, which daemonizes away from the
tree, or a systemd unit) is not a descendant and is left alone: such jobs are resumable by design.
Linux only (``/proc``); elsewhere nothing extra is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    start: int  # clock ticks since boot: tells a live process from a later one with a reused pid


def _read(pid: int) -> Proc | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: split after the last ')'
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return Proc(pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), start=int(fields[19]))
    except (IndexError, ValueError):
        return None


def _all() -> list[Proc]:
    if not _PROC.is_dir():
        return []
    procs = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            proc = _read(int(entry.name))
            if proc is not None:
                procs.append(proc)
    return procs


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root`` (not ``root`` itself)."""
    children: dict[int, list[Proc]] = {}
    for proc in _all():
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def _alive(proc: Proc) -> bool:
    now = _read(proc.pid)
    return now is not None and now.start == proc.start


def terminate(procs: list[Proc], *, grace: float = 2.0) -> list[int]:
    """End the process groups of ``procs`` that still run (SIGTERM, then SIGKILL after ``grace`` s).

    Returns the pids that were still alive when called.
    """
    alive = [p for p in procs if _alive(p)]
    own_group = os.getpgrp()
    groups = {p.pgid for p in alive if p.pgid not in (0, 1, own_group)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, sig)
        for proc in alive:  # a process that shares our own group is signalled alone
            if proc.pgid == own_group:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
        if not any(_alive(p) for p in alive):
            break
    return [p.pid for p in alive]
