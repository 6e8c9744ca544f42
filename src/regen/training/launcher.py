"""Launch SpecForge so it outlives the SSH session, and keep a status document up to date while it runs.

    python -m regen.training.launcher start  --name UNIT --status S --log L [--total-steps N] -- CMD ...
    python -m regen.training.launcher status --status S [--wait SECONDS]
    python -m regen.training.launcher stop   --status S
    python -m regen.training.launcher run    --status S --log L [--total-steps N] -- CMD ...   (internal)

`start` runs `run` as a transient systemd unit (`systemd-run --unit UNIT`) where the host has systemd, else
as a detached process in its own session (the mode is recorded in the status). `run` is the supervisor:
it starts CMD, appends everything CMD prints to the log, folds SpecForge's step lines into the status
(step, loss, acceptance proxy, ETA; see regen.training.status), forwards SIGTERM/SIGINT/SIGHUP to CMD so
SpecForge can flush, and records the exit code and the final state. `status` answers with the status,
after checking the supervisor is still alive: a supervisor that vanished without writing a final state
(host reboot, SIGKILL) is reported as `lost`. Every command prints one JSON object; exit code 0 means
the command itself worked (a failed training is a status, not a launcher error), 2 means bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from regen import procs
from regen.training.status import (
    FINAL_STATES,
    apply_line,
    new_status,
    progress_line,
    read_status,
    write_status,
)

# Keys a `start` writes that the supervisor keeps when it takes over the status document.
_LAUNCH_KEYS = (
    "mode",
    "unit",
    "launched_at",
    "command",
    "log",
    "resume_from",
    "run_id",
    # A rolling run's round (regen.training.rolling): the trainer stops at its last step.
    "round",
    "rounds",
    "round_first_step",
    "round_last_step",
    # An online run's attempt (a new one after an attempt that ended without success).
    "attempt",
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def _emit(payload: dict[str, Any]) -> None:
    json.dump(payload, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def has_systemd() -> bool:
    """True on a host whose PID 1 is systemd (containers and dev machines often have no systemd)."""
    return Path("/run/systemd/system").is_dir() and shutil.which("systemd-run") is not None


# --------------------------------------------------------------------------------------------------
# run: the supervisor
# --------------------------------------------------------------------------------------------------


def run(cmd: list[str], status_path: str, log_path: str, total_steps: int | None, cwd: str | None) -> int:
    previous = read_status(status_path) or {}
    status = new_status(total_steps, **{k: previous[k] for k in _LAUNCH_KEYS if k in previous})
    status.update(state="starting", pid=os.getpid(), command=cmd)
    write_status(status_path, status)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stop_requested = []
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        log.write(f"==== regen launcher: starting {' '.join(cmd)}\n")
        log.flush()
        try:
            child = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except OSError as exc:
            status.update(state="failed", exit_code=127, error=f"cannot start {cmd[0]}: {exc}")
            write_status(status_path, status)
            log.write(f"==== regen launcher: {status['error']}\n")
            return 127

        def forward(signum, _frame):
            stop_requested.append(signum)
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, forward)
        status.update(state="running", child_pid=child.pid)
        write_status(status_path, status)
        last_write = time.monotonic()

        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            log.flush()
            if apply_line(status, line) or time.monotonic() - last_write > 5:
                write_status(status_path, status)
                last_write = time.monotonic()
        code = child.wait()
        status["exit_code"] = code
        if stop_requested:
            status["state"] = "stopped"
        elif code == 0:
            status["state"] = "succeeded"
            status["eta_s"] = 0
        else:
            status["state"] = "failed"
            status["error"] = status.get("error") or f"exited with code {code}; see {log_path}"
        status["finished_at"] = time.time()
        write_status(status_path, status)
        log.write(f"==== regen launcher: {progress_line(status)}\n")
    return code


# --------------------------------------------------------------------------------------------------
# liveness, start, stop
# --------------------------------------------------------------------------------------------------


def _unit_active(unit: str | None) -> bool:
    if not unit or shutil.which("systemctl") is None:
        return False
    result = subprocess.run(["systemctl", "is-active", "--quiet", unit], check=False)
    return result.returncode == 0


def alive(status: dict[str, Any] | None) -> bool:
    if not status:
        return False
    if status.get("mode") == "systemd":
        return _unit_active(status.get("unit"))
    return procs.alive(status.get("pid"))


def current_status(status_path: str) -> dict[str, Any] | None:
    """The status, with a vanished supervisor turned into `lost`."""
    status = read_status(status_path)
    # A just-started supervisor gets a moment to write its first status before it counts as gone.
    if (
        status
        and status.get("state") not in FINAL_STATES
        and status.get("state") != "lost"
        and not alive(status)
        and time.time() - float(status.get("launched_at") or 0) > 10
    ):
        status["state"] = "lost"
        status["error"] = status.get("error") or "the training supervisor is gone without a final state"
        write_status(status_path, status)
    if status:
        status["line"] = progress_line(status)
    return status


def start(args: argparse.Namespace) -> int:
    existing = current_status(args.status)
    if existing and existing.get("state") in ("starting", "running") and alive(existing):
        _emit({"started": False, "reason": "already running", "status": existing})
        return 0
    mode = args.mode
    if mode == "auto":
        mode = "systemd" if has_systemd() else "process"
    supervisor = [
        sys.executable,
        "-m",
        "regen.training.launcher",
        "run",
        "--status",
        args.status,
        "--log",
        args.log,
    ]
    if args.total_steps:
        supervisor += ["--total-steps", str(args.total_steps)]
    if args.workdir:
        supervisor += ["--workdir", args.workdir]
    supervisor += ["--", *args.cmd]
    env_pairs = dict(pair.split("=", 1) for pair in args.env)
    env_pairs["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env_pairs.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")) if p
    )
    launch = new_status(
        args.total_steps,
        mode=mode,
        unit=args.name if mode == "systemd" else None,
        launched_at=time.time(),
        command=args.cmd,
        log=args.log,
        **json.loads(args.meta or "{}"),
    )
    write_status(args.status, launch)
    if mode == "systemd":
        # A failed unit of the same name blocks reuse of the name until it is reset.
        subprocess.run(["systemctl", "reset-failed", args.name], capture_output=True, check=False)
        argv = [
            "systemd-run",
            f"--unit={args.name}",
            "--collect",
            "--quiet",
            "--property=KillMode=mixed",
            f"--property=TimeoutStopSec={args.stop_timeout}",
            f"--description=regen drafter training {args.name}",
        ]
        if args.workdir:
            argv.append(f"--working-directory={args.workdir}")
        argv += [f"--property={p}" for p in args.property]
        argv += [f"--setenv={k}={v}" for k, v in sorted(env_pairs.items())]
        result = subprocess.run([*argv, "--", *supervisor], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            launch.update(state="failed", error=f"systemd-run failed: {result.stderr.strip()[-500:]}")
            write_status(args.status, launch)
            _emit({"started": False, "reason": launch["error"], "status": launch})
            return 1
    else:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        with open(f"{args.log}.supervisor", "a", encoding="utf-8") as out:
            proc = procs.spawn_detached(
                supervisor, output=out, env={**os.environ, **env_pairs}, cwd=args.workdir
            )
        launch["pid"] = proc.pid
        write_status(args.status, launch)
    _emit(
        {
            "started": True,
            "mode": mode,
            "unit": launch["unit"],
            "status": current_status(args.status) or launch,
        }
    )
    return 0


def stop(args: argparse.Namespace) -> int:
    status = read_status(args.status)
    if not status or not alive(status):
        _emit({"stopped": False, "reason": "not running", "status": status})
        return 0
    if status.get("mode") == "systemd":
        subprocess.run(["systemctl", "stop", status["unit"]], check=False)
    else:
        procs.stop_group(int(status["pid"]), args.timeout)
    _emit({"stopped": True, "status": current_status(args.status)})
    return 0


def wait_status(args: argparse.Namespace) -> int:
    """The status now, or after up to --wait seconds: returns early on a final state, and on a new step
    unless --until-final."""
    status = current_status(args.status)
    deadline = time.monotonic() + args.wait
    first = (status or {}).get("done"), (status or {}).get("state")
    while status and status.get("state") not in (*FINAL_STATES, "lost") and time.monotonic() < deadline:
        time.sleep(min(1.0, args.wait))
        status = current_status(args.status)
        if status and not args.until_final and ((status.get("done"), status.get("state")) != first):
            break
    if status is None:
        status = {"state": "absent", "line": "absent | no training was launched here"}
    _emit(status)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.launcher", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="supervise CMD in the foreground (what the unit runs)")
    start_p = sub.add_parser("start", help="start the supervisor detached (systemd unit or session leader)")
    for p in (run_p, start_p):
        p.add_argument("--status", required=True, help="status JSON to keep up to date")
        p.add_argument("--log", required=True, help="log file CMD's output is appended to")
        p.add_argument(
            "--total-steps", type=int, default=None, help="optimizer steps the run will take (ETA)"
        )
        p.add_argument("--workdir", default=None)
        p.add_argument("cmd", nargs="+", help="the command, after --")
    start_p.add_argument("--name", required=True, help="systemd unit name")
    start_p.add_argument("--mode", choices=("auto", "systemd", "process"), default="auto")
    start_p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the command")
    start_p.add_argument("--property", action="append", default=[], help="extra systemd unit property")
    start_p.add_argument(
        "--stop-timeout", type=int, default=120, help="seconds SpecForge gets to flush on stop"
    )
    start_p.add_argument("--meta", default=None, help="JSON object of extra fields for the status")
    status_p = sub.add_parser("status", help="print the status (waiting up to --wait seconds for progress)")
    status_p.add_argument("--status", required=True)
    status_p.add_argument("--wait", type=float, default=0.0)
    status_p.add_argument("--until-final", action="store_true", help="keep waiting through new steps")
    stop_p = sub.add_parser("stop", help="stop a running training (SpecForge flushes its checkpoint first)")
    stop_p.add_argument("--status", required=True)
    stop_p.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.cmd, args.status, args.log, args.total_steps, args.workdir)
    if args.command == "start":
        return start(args)
    if args.command == "stop":
        return stop(args)
    return wait_status(args)


if __name__ == "__main__":
    raise SystemExit(main())
