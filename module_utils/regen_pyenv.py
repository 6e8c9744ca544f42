"""Which modules import in an interpreter, their versions, torch's CUDA build, and why imports fail.

Imports run in a child process of the inspected interpreter: a module that crashes the interpreter
(a bad CUDA library can segfault) is then reported as such instead of killing the Ansible module.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

# The probe runs in the child; it prints one JSON line per module as soon as that module is done.
PROBE = r"""
import importlib, json, sys
try:
    from importlib import metadata
    dists = metadata.packages_distributions()
except Exception:
    metadata, dists = None, {}
for name in sys.argv[1:]:
    print(json.dumps({"name": name, "started": True}), flush=True)
    rec = {"name": name, "ok": False, "version": None, "error_type": None, "error": None,
           "missing_module": None}
    try:
        mod = importlib.import_module(name)
        rec["ok"] = True
        version = None
        if metadata is not None:
            for dist in dists.get(name.split(".")[0], []) + [name]:
                try:
                    version = metadata.version(dist)
                    break
                except Exception:
                    pass
        rec["version"] = version or getattr(mod, "__version__", None)
        if name == "torch":
            cuda = getattr(mod.version, "cuda", None)
            rec["torch"] = {"cuda": cuda, "hip": getattr(mod.version, "hip", None)}
            try:
                rec["torch"]["cuda_available"] = bool(mod.cuda.is_available())
                available = rec["torch"]["cuda_available"]
                rec["torch"]["device_count"] = int(mod.cuda.device_count()) if available else 0
                rec["torch"]["arch_list"] = list(mod.cuda.get_arch_list()) if cuda else []
            except Exception as exc:
                rec["torch"]["cuda_error"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    except BaseException as exc:
        rec["error_type"] = type(exc).__name__
        rec["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        rec["missing_module"] = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    print(json.dumps(rec), flush=True)
"""


def _run_probe(python, modules, timeout):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


def parse_probe_output(stdout):
    """(finished records by name, name of the module that started but never finished or None)."""
    done = {}
    started = None
    for line in stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or "name" not in rec:
            continue
        if rec.get("started"):
            started = rec["name"]
        else:
            done[rec["name"]] = rec
            started = None
    return done, started


def probe(modules, python=None, timeout=300):
    python = python or sys.executable
    pending = list(modules)
    records = {}
    while pending:
        try:
            rc, out, err = _run_probe(python, pending, timeout)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc, err = -1, f"timed out after {timeout}s"
        done, crashed = parse_probe_output(out)
        records.update(done)
        pending = [m for m in pending if m not in records]
        if not pending:
            break
        culprit = crashed or pending[0]
        reason = "the interpreter died while importing it (exit {}): {}".format(
            rc, (err.strip().splitlines() or ["no message"])[-1][:300]
        )
        records[culprit] = {
            "name": culprit,
            "ok": False,
            "version": None,
            "error_type": "InterpreterCrash",
            "error": reason,
            "missing_module": None,
        }
        pending = [m for m in pending if m != culprit]
    return [records[m] for m in modules]


def summarize(records):
    imported = {r["name"]: r["version"] for r in records if r["ok"]}
    failed = {
        r["name"]: {"error_type": r["error_type"], "error": r["error"], "missing_module": r["missing_module"]}
        for r in records
        if not r["ok"]
    }
    torch = next((r.get("torch") for r in records if r["name"] == "torch" and r["ok"]), None)
    return {
        "python": {
            "executable": sys.executable,
            "version": platform.python_version(),
            "prefix": sys.prefix,
            "is_venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
        },
        "modules": records,
        "imported": imported,
        "missing": sorted(
            name
            for name, info in failed.items()
            if info["error_type"] == "ModuleNotFoundError"
            and (info["missing_module"] or name).split(".")[0] == name.split(".")[0]
        ),
        "failed": failed,
        "torch": torch,
    }
