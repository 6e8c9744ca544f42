"""The processes regen starts, watches and stops where a host has no systemd, and the one port probe.

One fallback supervisor for every long-running thing regen launches: the model server
(`regen.serving.supervisor`, process mode), the training supervisor (`regen.training.launcher`, process
mode) and the ansible-playbook tree the runner cancels (`regen.runner.api`). They share:

- `spawn_detached`: start a command in its own session, so it outlives the SSH session (or the CLI) that
  started it and can be stopped as one process group;
- `alive` / `cmdline`: is a pid a live process (a zombie is not), and what it runs;
- `stop_group`: SIGTERM a process group, SIGKILL what is left after a grace period;
- `descendants` / `terminate`: the processes below a pid, and ending their groups;
- `port_free`: can a server bind `host:port` now?

Every process query in the package goes through this module, and processes are read through psutil,
not by walking `/proc` by hand, with one exception: `cmdline` reads `/proc/PID/cmdline` itself to split
it on NUL only (its docstring says why). `regen.status.liveness` asks `alive` too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO

import psutil


def alive(pid: int | None) -> bool:
    """True while `pid` is a running process; a zombie (exited, not yet reaped) does not count."""
    if not pid or int(pid) <= 0:
        return False
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's live process


def cmdline(pid: int) -> list[str] | None:
    """The command line of `pid`, or None when it cannot be read (gone, a zombie, not ours).

    Split on NUL only, as the kernel wrote it: psutil splits a NUL-less cmdline on spaces, which changes
    the argv of a process that rewrote its title (sglang-router becomes `sglang::router ...`), so the
    supervisor would no longer recognise its own process and start a second one.
    """
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part] or None


def spawn_detached(
    argv: Sequence[str],
    *,
    output: IO[bytes] | IO[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen:
    """Start `argv` as the leader of a new session (and process group), stdout and stderr to `output`.

    Raises OSError when the program cannot be run; the caller words the fix.
    """
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        cwd=cwd or None,
        start_new_session=True,
        close_fds=True,
    )


def stop_group(pid: int, timeout: float) -> str:
    """Stop the process `pid` leads (its whole group), or `pid` alone when it leads none.

    SIGTERM first; SIGKILL after `timeout` seconds. Returns "gone" (nothing to stop), "terminated" or
    "killed". Members of the group that outlive their leader are killed too: a stopped server or trainer
    must leave its GPUs free.
    """
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return "gone"
    leads_group = pgid == pid

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if leads_group:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            send(signal.SIGKILL)
            time.sleep(0.5)
            return "killed"
        time.sleep(0.2)
    if leads_group:
        send(signal.SIGKILL)
    return "terminated"


def descendants(root: int) -> list[psutil.Process]:
    """Every live process below `root` (not `root` itself); empty when `root` is gone."""
    try:
        return psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def still_running(proc: psutil.Process) -> bool:
    """True while `proc` runs: the same process (psutil compares its start time, so a reused pid is not
    taken for it), and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def terminate(procs: Sequence[psutil.Process], *, grace: float = 2.0) -> list[int]:
    """End the process groups of `procs` that still run (SIGTERM, then SIGKILL after `grace` s).

    A process in our own group is signalled alone. Returns the pids that were still alive when called.
    """
    running = [p for p in procs if still_running(p)]
    own_group = os.getpgrp()
    groups: set[int] = set()
    alone: list[psutil.Process] = []
    for proc in running:
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            continue
        if pgid == own_group:
            alone.append(proc)
        elif pgid not in (0, 1):
            groups.add(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, sig)
        for proc in alone:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(still_running(p) for p in running):
            time.sleep(0.05)
        if not any(still_running(p) for p in running):
            break
    return [p.pid for p in running]


def port_free(host: str, port: int) -> bool:
    """True when a server could bind `host:port` now (the probe binds it, as the server will)."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bare, int(port)))
        except OSError:
            return False
    return True


def port_held_by(host: str, port: int, owner: int) -> bool:
    """True when a process listening on `host:port` is `owner` or runs below it (its server's workers).

    A port that is busy is only "ours" when the server being converged is what listens on it: a server
    running on another port does not make a stranger's listener on the new port harmless.
    """
    wanted = int(port)
    try:
        listeners = {
            conn.pid
            for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.pid and conn.laddr and conn.laddr.port == wanted
        }
    except psutil.AccessDenied:
        return False
    if not owner or not listeners:
        return False
    family = {int(owner)} | {p.pid for p in descendants(int(owner))}
    return bool(listeners & family)
