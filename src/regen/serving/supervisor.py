"""Run a model server without systemd, and watch one under either: start/stop/status/wait/diagnose.

`python -m regen.serving.supervisor <command> ...` prints one JSON object on stdout (the role reads
it) and exits 0, or 2 with {"failed": true, "msg": ...} when it cannot do what was asked.

Process mode (a developer machine without systemd): `start` launches the server's argv in its own
session with stdout/stderr in `<state_dir>/<name>.log`, its pid in `<name>.pid` and the launch spec's
fingerprint in `<name>.state.json`. A second `start` with the same spec and a live process changes
nothing; a different spec stops the old process group and starts the new one. There is no restart
loop: a server that dies is reported by `wait`/`status` and started again by the next run.

`wait` is the readiness probe for both modes: it polls the server's HTTP readiness path for one
slice of time while reading the log (the process log, or the unit's journal for this invocation) to
report the loading stage, and says at once when the server has exited, with the likely cause.
It runs in the job venv regen is installed in; processes and the port probe are `regen.procs`'.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

from regen import procs
from regen.fsio import atomic_write_json, atomic_write_text, read_json_object
from regen.module_utils.regen_files import read_tail
from regen.module_utils.regen_secrets import SecretFileError, read_api_key, read_env_file
from regen.serving.diagnose import diagnose, stage_of, tail

EXIT_OK = 0
EXIT_ERROR = 2
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class SupervisorError(Exception):
    """Something the user must fix; the message says what."""


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def _paths(state_dir: str, name: str) -> dict[str, str]:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SupervisorError(f"server name {name!r} may only hold letters, digits, '.', '_' and '-'")
    return {
        "pid": os.path.join(state_dir, f"{name}.pid"),
        "state": os.path.join(state_dir, f"{name}.state.json"),
        "log": os.path.join(state_dir, f"{name}.log"),
    }


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


def _running(paths: dict[str, str]) -> tuple[int | None, dict | None]:
    """The pid of our live server (or None) and its recorded state; guards against pid reuse."""
    state = read_json_object(paths["state"])
    try:
        with open(paths["pid"], encoding="ascii") as handle:
            pid = int(handle.read().strip())
    except (FileNotFoundError, ValueError):
        return None, state
    if not procs.alive(pid):
        return None, state
    if state and state.get("pid") == pid:
        cmd = procs.cmdline(pid)
        # A recycled pid runs someone else's command line. Interpreters may rewrite argv[0] (and some
        # servers retitle themselves), so only a readable, different tail counts as "not ours".
        if cmd and len(cmd) > 1 and _cmdline_hash(cmd) != state.get("cmdline_sha256", _cmdline_hash(cmd)):
            return None, state
    return pid, state


def _cmdline_hash(argv: list[str]) -> str:
    return hashlib.sha256("\0".join(argv[1:]).encode("utf-8")).hexdigest()


def fingerprint(spec: dict, secret_env: dict[str, str]) -> str:
    """What a restart would change: the launch spec and the secrets it is started with."""
    doc = json.dumps({"spec": spec, "secret": sorted(secret_env.items())}, sort_keys=True)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def start(spec: dict, secret_env_file: str | None = None, check: bool = False) -> dict:
    """Start the server of `spec` unless the same spec already runs; restart it when the spec changed."""
    for key in ("name", "argv", "state_dir"):
        if not spec.get(key):
            raise SupervisorError(f"launch spec lacks {key!r}")
    paths = _paths(spec["state_dir"], spec["name"])
    secret_env = read_env_file(secret_env_file)
    want = fingerprint(spec, secret_env)
    pid, state = _running(paths)
    result = {
        "mode": "process",
        "name": spec["name"],
        "log": paths["log"],
        "pid_file": paths["pid"],
        "fingerprint": want,
    }
    if pid and state and state.get("fingerprint") == want:
        return {**result, "changed": False, "action": "unchanged", "pid": pid}
    action = "restarted" if pid else "started"
    if check:
        return {**result, "changed": True, "action": action, "pid": pid}
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    env.update(secret_env)
    argv = [_ENV_REF.sub(lambda m: env.get(m.group(1), ""), a) for a in spec["argv"]]
    host, port = spec.get("host"), spec.get("port")
    stop_timeout = float(spec.get("stop_timeout", 60))
    # Everything that can be known before the old server stops is checked first: a change that cannot
    # be applied must leave the working server running, not stop it and then fail.
    _check_launchable(argv, spec, env)
    same_port = bool(pid and state and (state.get("host"), state.get("port")) == (host, port))
    if host and port and not same_port and not procs.port_free(str(host), int(port)):
        raise SupervisorError(
            f"port {port} on {host} is already in use by another process; stop it (see `ss -ltnp "
            f"'sport = :{port}'`) or set sglang_server_port to a free port"
            + ("; the running server was left as it was" if pid else "")
        )
    if pid:
        procs.stop_group(pid, stop_timeout)
        if host and port and not _wait_port_free(str(host), int(port), stop_timeout):
            raise SupervisorError(
                f"port {port} on {host} is still in use {stop_timeout:g} s after the old server stopped "
                f"(sglang_server_stop_timeout_s); see `ss -ltnp 'sport = :{port}'` for what holds it"
            )
    os.makedirs(spec["state_dir"], exist_ok=True)
    if os.path.exists(paths["log"]):
        os.replace(paths["log"], paths["log"] + ".1")
    with open(paths["log"], "ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log.write(f"=== regen supervisor: starting {spec['name']} at {stamp}\n".encode())
        log.flush()
        try:
            proc = procs.spawn_detached(argv, output=log, env=env, cwd=spec.get("cwd") or spec["state_dir"])
        except OSError as exc:
            raise SupervisorError(
                f"cannot run {argv[0]}: {exc.strerror}; check sglang_server_python"
            ) from exc
    # The command line is kept as a hash: with a secret expanded into it, the text would be a copy
    # of the key outside its 0600 file.
    state = {
        "pid": proc.pid,
        "fingerprint": want,
        "cmdline_sha256": _cmdline_hash(argv),
        "started_at": time.time(),
        "started_monotonic": time.monotonic(),
        "name": spec["name"],
        "host": host,
        "port": port,
        "command": spec["argv"],
    }
    atomic_write_json(paths["state"], state, mode=0o600)
    atomic_write_text(paths["pid"], f"{proc.pid}\n")
    return {**result, "changed": True, "action": action, "pid": proc.pid}


def _check_launchable(argv: list[str], spec: dict, env: dict[str, str]) -> None:
    """Fail now, while the old server still runs, when the new command cannot be started at all."""
    program = argv[0] if argv else ""
    found = shutil.which(program, path=env.get("PATH")) if os.sep not in program else (
        program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    )
    if not found:
        raise SupervisorError(
            f"cannot run {program}: no such executable; check sglang_server_python"
            " (a running server was left as it was)"
        )
    cwd = spec.get("cwd")
    if cwd and not os.path.isdir(cwd):
        raise SupervisorError(f"working directory {cwd} of {spec['name']} does not exist")


def _wait_port_free(host: str, port: int, bound: float) -> bool:
    """Wait up to `bound` seconds for `host:port` to become bindable: a stopped server's socket can
    outlive its process for a moment (a child closing late, a loaded kernel), and a restart must not
    mistake that for a port taken by someone else."""
    deadline = time.monotonic() + bound
    while not procs.port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop(state_dir: str, name: str, remove: bool = False, timeout: float = 60, check: bool = False) -> dict:
    paths = _paths(state_dir, name)
    pid, _state = _running(paths)
    leftovers = [paths["pid"]] + ([paths["state"], paths["log"], paths["log"] + ".1"] if remove else [])
    changed = bool(pid) or any(os.path.exists(p) for p in leftovers)
    result = {"mode": "process", "name": name, "changed": changed, "pid": pid}
    if check:
        return {**result, "action": "would stop" if pid else "none"}
    outcome = procs.stop_group(pid, timeout) if pid else "not running"
    for path in leftovers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {**result, "action": outcome}


def status(state_dir: str, name: str) -> dict:
    paths = _paths(state_dir, name)
    pid, state = _running(paths)
    return {
        "mode": "process",
        "name": name,
        "running": bool(pid),
        "pid": pid,
        "fingerprint": (state or {}).get("fingerprint") if pid else None,
        "log": paths["log"],
        "changed": False,
    }


# --------------------------------------------------------------------------------------------------
# systemd side of `wait`
# --------------------------------------------------------------------------------------------------


def _systemctl_show(unit: str) -> dict[str, str]:
    props = (
        "ActiveState,SubState,MainPID,ExecMainStatus,ExecMainStartTimestampMonotonic,InvocationID,NRestarts"
    )
    out = subprocess.run(
        ["systemctl", "show", unit, "-p", props], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SupervisorError(f"systemctl show {unit} failed: {out.stderr.strip()}")
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def _journal(invocation: str, unit: str) -> str:
    query = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    out = subprocess.run(
        ["journalctl", *query, "-o", "cat", "--no-pager", "-n", "400"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout


# --------------------------------------------------------------------------------------------------
# Readiness
# --------------------------------------------------------------------------------------------------


def probe(url: str, api_key: str | None, timeout: float) -> tuple[bool, str]:
    request = urllib.request.Request(url, method="GET")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return 200 <= response.status < 300, f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"not answering ({reason})"


def _observe(args: argparse.Namespace) -> dict:
    """One look at the server: alive?, elapsed since start, log text."""
    if args.unit:
        show = _systemctl_show(args.unit)
        started = int(show.get("ExecMainStartTimestampMonotonic") or 0) / 1e6
        alive = show.get("ActiveState") in ("active", "activating", "reloading") and show.get(
            "SubState"
        ) not in ("auto-restart", "dead", "failed", "exited")
        return {
            "alive": alive,
            "elapsed": time.monotonic() - started if started else 0.0,
            "log": _journal(show.get("InvocationID", ""), args.unit),
            "state": f"{show.get('ActiveState')}/{show.get('SubState')}",
            "exit_status": show.get("ExecMainStatus"),
            "restarts": int(show.get("NRestarts") or 0),
        }
    paths = _paths(args.state_dir, args.name)
    pid, state = _running(paths)
    started = (state or {}).get("started_monotonic")
    return {
        "alive": bool(pid),
        "elapsed": time.monotonic() - started if started else 0.0,
        "log": read_tail(paths["log"]),
        "state": "running" if pid else "not running",
        "exit_status": None,
        "restarts": 0,
    }


def wait(args: argparse.Namespace) -> dict:
    """Poll readiness for up to one slice; return as soon as the server is ready or has died."""
    api_key = read_api_key(args.api_key_env_file, args.api_key_var)
    deadline = time.monotonic() + args.slice
    answer = "not probed"
    while True:
        seen = _observe(args)
        ready = False
        if seen["alive"]:
            if args.url:
                ready, answer = probe(args.url, api_key, args.probe_timeout)
            else:
                # A rank > 0 of a multi-node server has no HTTP API; running is all it can show.
                ready, answer = seen["elapsed"] >= args.min_uptime, "no HTTP API on this rank"
        if ready or not seen["alive"] or time.monotonic() >= deadline:
            break
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
    stage, detail = stage_of(seen["log"])
    result = {
        "ready": ready,
        "alive": seen["alive"],
        "state": seen["state"],
        "elapsed_s": round(seen["elapsed"], 1),
        "timed_out": not ready and seen["alive"] and seen["elapsed"] >= args.budget,
        "stage": "ready" if ready else (stage or "starting"),
        "detail": detail,
        "probe": answer,
        "restarts": seen["restarts"],
        "changed": False,
    }
    result["progress"] = (
        f"{args.name or args.unit}: {result['stage']}{(' ' + detail) if detail else ''} "
        f"after {int(seen['elapsed'])}s ({answer})"
    )
    if not ready and (not seen["alive"] or result["timed_out"] or seen["restarts"]):
        result.update(_diagnosis(seen))
    return _scrub(result, api_key)


def _scrub(value, secret: str | None):
    """Replace the API key wherever a log line carries it (SGLang logs its server_args at start)."""
    if not secret:
        return value
    if isinstance(value, str):
        return value.replace(secret, "<redacted>")
    if isinstance(value, list):
        return [_scrub(v, secret) for v in value]
    if isinstance(value, dict):
        return {k: _scrub(v, secret) for k, v in value.items()}
    return value


def _diagnosis(seen: dict) -> dict:
    cause = diagnose(seen["log"])
    out = {"log_tail": tail(seen["log"], 40)}
    if cause:
        out.update(
            {
                "cause": cause.kind,
                "cause_summary": cause.summary,
                "hint": cause.hint,
                "cause_line": cause.line,
            }
        )
    else:
        out.update(
            {
                "cause": "unknown",
                "cause_summary": "the log names no known cause",
                "hint": "read the log tail",
                "cause_line": "",
            }
        )
    if seen.get("exit_status") not in (None, "", "0"):
        out["exit_status"] = seen["exit_status"]
    return out


# Server-info fields that hold secrets (SGLang reports every server argument, the API key included) and
# fields that change while the server runs (they would make every recorded artifact differ).
_SECRET_FIELDS = {"api_key", "admin_api_key", "ssl_keyfile_password", "watermark_key", "watermark_key_b"}
_SECRET_FLAGS = {"--api-key", "--admin-api-key", "--ssl-keyfile-password"}
_VOLATILE_FIELDS = {"internal_states", "created"}


def redact(value):
    """A copy of a server's JSON answer without secrets and live counters."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in _VOLATILE_FIELDS:
                continue
            if key in _SECRET_FIELDS:
                out[key] = None if item is None else "<redacted>"
            elif key == "launch_command" and isinstance(item, (str, list)):
                out[key] = _redact_command(item)
            else:
                out[key] = redact(item)
        return out
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def _redact_command(command):
    words = command.split() if isinstance(command, str) else list(command)
    out, hide = [], False
    for word in words:
        flag = word.split("=", 1)[0]
        if hide:
            out.append("<redacted>")
            hide = False
        elif flag in _SECRET_FLAGS and "=" in word:
            out.append(f"{flag}=<redacted>")
        else:
            out.append(word)
            hide = flag in _SECRET_FLAGS
    return " ".join(out) if isinstance(command, str) else out


def _get_json(url: str, api_key: str | None, timeout: float):
    request = urllib.request.Request(url, method="GET")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SupervisorError(f"GET {url} failed: {getattr(exc, 'reason', exc)}") from exc


def info(args: argparse.Namespace) -> dict:
    api_key = read_api_key(args.api_key_env_file, args.api_key_var)
    base = args.url.rstrip("/")
    out = {"changed": False, "v1_models": redact(_get_json(base + "/v1/models", api_key, args.timeout))}
    if args.backend == "sglang":
        out["model_info"] = redact(_get_json(base + "/get_model_info", api_key, args.timeout))
        out["server_info"] = redact(_get_json(base + "/get_server_info", api_key, args.timeout))
    models = out["v1_models"].get("data") if isinstance(out["v1_models"], dict) else None
    out["served_model_names"] = [m.get("id") for m in models or [] if isinstance(m, dict) and m.get("id")]
    # Belt and braces: whatever field a future release adds, the key itself never reaches the artifacts.
    return _scrub(out, api_key)


def diagnose_cmd(args: argparse.Namespace) -> dict:
    api_key = read_api_key(args.api_key_env_file, args.api_key_var)
    seen = _observe(args)
    out = {"alive": seen["alive"], "state": seen["state"], "changed": False, **_diagnosis(seen)}
    return _scrub(out, api_key)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m regen.serving.supervisor", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="start (or keep, or restart) the server of a launch spec")
    p.add_argument(
        "--spec-json",
        required=True,
        help="the launch spec as JSON: name, argv, env, state_dir, host, port, stop_timeout",
    )
    p.add_argument("--secret-env-file", help="KEY=VALUE file (mode 0600) merged into the environment")
    p.add_argument("--check", action="store_true", help="report what would change, do nothing")

    for name, text in (("stop", "stop the server"), ("status", "is the server running?")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--state-dir", required=True)
        p.add_argument("--name", required=True)
        if name == "stop":
            p.add_argument("--remove", action="store_true", help="also remove pid, state and log files")
            p.add_argument("--timeout", type=float, default=60.0, help="seconds before SIGKILL")
            p.add_argument("--check", action="store_true")

    p = sub.add_parser("port", help="can a server bind HOST:PORT now? (the one port probe, regen.procs)")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--owner-pid", type=int, help="also say whether this pid (or one below it) listens there"
    )

    p = sub.add_parser("info", help="what the server says it serves (secrets and live counters removed)")
    p.add_argument("--url", required=True, help="base URL of the server")
    p.add_argument("--backend", choices=["sglang", "transformers", "router"], required=True)
    p.add_argument("--api-key-env-file")
    p.add_argument("--api-key-var", default="REGEN_SERVING_API_KEY")
    p.add_argument("--timeout", type=float, default=30.0)

    for name, text in (("wait", "poll readiness for one slice"), ("diagnose", "log tail and likely cause")):
        p = sub.add_parser(name, help=text)
        target = p.add_mutually_exclusive_group(required=True)
        target.add_argument("--unit", help="systemd unit (journal of its current invocation)")
        target.add_argument("--state-dir", help="process mode: directory with <name>.pid/.log")
        p.add_argument("--name", help="process mode: server name")
        p.add_argument("--api-key-env-file", help="the key is sent with probes and removed from log lines")
        p.add_argument("--api-key-var", default="REGEN_SERVING_API_KEY")
        if name == "wait":
            p.add_argument("--url", help="readiness URL; omit for a rank without HTTP API")
            p.add_argument("--slice", type=float, default=30.0, help="seconds to poll before returning")
            p.add_argument(
                "--budget", type=float, default=1800.0, help="seconds since start before timing out"
            )
            p.add_argument("--interval", type=float, default=2.0)
            p.add_argument("--probe-timeout", type=float, default=30.0)
            p.add_argument("--min-uptime", type=float, default=10.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "start":
            try:
                spec = json.loads(args.spec_json)
            except json.JSONDecodeError as exc:
                raise SupervisorError(f"--spec-json is not JSON: {exc}") from exc
            if not isinstance(spec, dict):
                raise SupervisorError("--spec-json must be a JSON object")
            out = start(spec, args.secret_env_file, check=args.check)
        elif args.command == "stop":
            out = stop(args.state_dir, args.name, remove=args.remove, timeout=args.timeout, check=args.check)
        elif args.command == "status":
            out = status(args.state_dir, args.name)
        elif args.command == "port":
            out = {"host": args.host, "port": args.port, "free": procs.port_free(args.host, args.port)}
            if args.owner_pid is not None:
                out["held_by_owner"] = procs.port_held_by(args.host, args.port, args.owner_pid)
            out["changed"] = False
        elif args.command == "info":
            out = info(args)
        else:
            if args.state_dir and not args.name:
                raise SupervisorError("--state-dir needs --name")
            out = wait(args) if args.command == "wait" else diagnose_cmd(args)
    except (SupervisorError, SecretFileError) as exc:
        print(json.dumps({"failed": True, "msg": str(exc), "changed": False}))
        return EXIT_ERROR
    print(json.dumps(out, sort_keys=True))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
