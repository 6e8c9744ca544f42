"""The one probe of what a Python interpreter (a venv) can import.

Used by `python_env_info` (the facts' `environment.python`), `python_venv` (the verification of a freshly
built venv: imports, installed distributions, torch's CUDA build, the tokenizer smoke), the gpu_host torch
check and the drafter_training SpecForge check. Standard library only, Python 3.8+: it ships to whatever
host a module runs on.

The probe runs in a child process of the inspected interpreter, one step at a time (an import, the list of
installed distributions, torch's build, the tokenizer smoke). Each step announces itself before it starts,
so a step that kills the interpreter (a bad CUDA library can segfault) is reported as such and the steps
after it still run, in a fresh child.
"""

from __future__ import annotations

import json
import os
import subprocess

# Every line the probe itself prints starts with this mark: remote code (a tokenizer's) may print too.
PROBE_MARK = "@@REGEN-PROBE@@"

PROBE_SOURCE = r"""
import importlib, json, os, platform, sys
MARK = "@@REGEN-PROBE@@"
args = json.loads(sys.argv[1])

def emit(record):
    sys.stdout.write("\n" + MARK + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()

def failure(exc):
    return {"error_type": type(exc).__name__,
            "error": (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300],
            "missing_module": getattr(exc, "name", None) if isinstance(exc, ImportError) else None}

def torch_build(torch):
    cuda = getattr(torch.version, "cuda", None)
    info = {"cuda": cuda, "hip": getattr(torch.version, "hip", None)}
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["device_count"] = int(torch.cuda.device_count()) if info["cuda_available"] else 0
        info["arch_list"] = list(torch.cuda.get_arch_list()) if cuda else []
    except Exception as exc:
        info["cuda_error"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    return info

def step_import(step):
    name = step["name"]
    rec = {"name": name, "ok": False, "version": None, "error_type": None, "error": None,
           "missing_module": None}
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        rec.update(failure(exc))
        return rec
    rec["ok"] = True
    version = None
    try:
        from importlib import metadata
        for dist in metadata.packages_distributions().get(name.split(".")[0], []) + [name.split(".")[0]]:
            try:
                version = metadata.version(dist)
                break
            except Exception:
                pass
    except Exception:
        pass
    rec["version"] = version or getattr(module, "__version__", None)
    if name == "torch":
        rec["torch"] = torch_build(module)
    return rec

def step_packages(step):
    packages = {}
    from importlib import metadata
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            packages[name.lower().replace("_", "-").replace(".", "-")] = dist.version
    return packages

def step_torch(step):
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except BaseException as exc:
        return dict(failure(exc), ok=False)
    info = dict(torch_build(torch), ok=True, version=torch.__version__)
    if step.get("devices") and info.get("cuda_available"):
        info["devices"] = [{"name": torch.cuda.get_device_name(i),
                            "capability": "%d.%d" % torch.cuda.get_device_capability(i)}
                           for i in range(info["device_count"])]
    return info

def step_tokenizer(step):
    model = step["model_path"]
    result = {"model_path": model, "attempted": False, "ok": False, "required": bool(step.get("required"))}
    if not os.path.isdir(model):
        return result
    result["attempted"] = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()):
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
            ids = tok.encode("regen tokenizer smoke: hello, world")
            text = tok.decode(ids)
        result.update(ok=True, tokenizer_class=type(tok).__name__, vocab_size=len(tok),
                      sample_ids=len(ids), roundtrip="hello, world" in text)
    except BaseException as exc:
        chain, seen, current, missing = [], set(), exc, None
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            chain.append("%s: %s" % (type(current).__name__, current))
            if isinstance(current, ModuleNotFoundError) and not missing:
                missing = current.name
            current = current.__cause__ or current.__context__
        result.update(error_type=type(exc).__name__, error=" <- ".join(chain)[:2000], missing_module=missing)
    return result

emit({"python": {"executable": sys.executable, "version": platform.python_version(), "prefix": sys.prefix,
                 "is_venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
                 "implementation": platform.python_implementation()}})
steps = {"import": step_import, "packages": step_packages, "torch": step_torch, "tokenizer": step_tokenizer}
for index, step in enumerate(args["steps"]):
    emit({"started": index})
    try:
        result = steps[step["kind"]](step)
    except BaseException as exc:
        result = dict(failure(exc), ok=False)
    emit({"done": index, "result": result})
"""


def probe_steps(
    imports=(), packages=False, torch=False, torch_devices=False, model_path=None, required=False
):
    """The probe's steps, in the order they run: imports first (what most callers ask), the rest after."""
    steps = [{"kind": "import", "name": name} for name in imports]
    if packages:
        steps.append({"kind": "packages"})
    if torch:
        steps.append({"kind": "torch", "devices": bool(torch_devices)})
    if model_path:
        steps.append({"kind": "tokenizer", "model_path": model_path, "required": bool(required)})
    return steps


def parse_probe_output(stdout):
    """(python record or None, {step index: result}, index of the step that started but never finished)."""
    python, done, started = None, {}, None
    for line in (stdout or "").splitlines():
        if not line.startswith(PROBE_MARK):
            continue
        try:
            record = json.loads(line[len(PROBE_MARK) :])
        except ValueError:
            continue
        if "python" in record:
            python = record["python"]
        elif "started" in record:
            started = record["started"]
        elif "done" in record:
            done[record["done"]] = record["result"]
            started = None
    return python, done, started


def _crash_result(step, rc, stderr):
    reason = "the interpreter died while {} (exit {}): {}".format(
        "importing it" if step["kind"] == "import" else "probing " + step["kind"],
        rc,
        ((stderr or "").strip().splitlines() or ["no message"])[-1][:300],
    )
    result = {"ok": False, "error_type": "InterpreterCrash", "error": reason, "missing_module": None}
    if step["kind"] == "import":
        result = {"name": step["name"], "version": None, **result}
    elif step["kind"] == "tokenizer":
        result.update(model_path=step["model_path"], attempted=True, required=bool(step.get("required")))
    return result


def _run(python, steps, timeout, env, cwd):
    try:
        proc = subprocess.run(
            [python, "-c", PROBE_SOURCE, json.dumps({"steps": steps})],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out, f"timed out after {timeout}s"
    return proc.returncode, proc.stdout, proc.stderr


def run_probe(python, steps, timeout=300, env=None, cwd=None):
    """Run `steps` in `python`: {"python": record or None, "results": [one result per step], "error"}.

    `python` is None when the interpreter does not start (then "error" says why and there are no results).
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    results, python_record, offset = {}, None, 0
    while offset < len(steps):
        try:
            rc, out, err = _run(python, steps[offset:], timeout, env, cwd)
        except OSError as exc:
            return {"python": None, "results": [], "error": f"{python} does not run: {exc}"}
        record, done, started = parse_probe_output(out)
        if record is None:
            message = ((err or "").strip().splitlines() or [f"exit {rc}, no output"])[-1][:300]
            error = f"{python} cannot run the probe: {message}"
            return {"python": python_record, "results": [], "error": error}
        python_record = record
        for index, result in done.items():
            results[offset + index] = result
        if len(done) == len(steps) - offset:
            break
        crashed = offset + (started if started is not None else len(done))
        results[crashed] = _crash_result(steps[crashed], rc, err)
        offset = crashed + 1
    return {"python": python_record, "results": [results[i] for i in range(len(steps))], "error": None}


def probe(modules, python, timeout=300, env=None, cwd=None):
    """One import record per module, in order (python_env_info's view); (records, python record, error)."""
    run = run_probe(python, probe_steps(imports=modules), timeout, env, cwd)
    return run["results"], run["python"], run["error"]


def summarize(records, python):
    """The `python_env` document of python_env_info (the facts' `environment.python`)."""
    failed = {
        r["name"]: {"error_type": r["error_type"], "error": r["error"], "missing_module": r["missing_module"]}
        for r in records
        if not r["ok"]
    }
    return {
        "python": {key: (python or {}).get(key) for key in ("executable", "version", "prefix", "is_venv")},
        "modules": records,
        "imported": {r["name"]: r["version"] for r in records if r["ok"]},
        "missing": sorted(
            name
            for name, info in failed.items()
            if info["error_type"] == "ModuleNotFoundError"
            and (info["missing_module"] or name).split(".")[0] == name.split(".")[0]
        ),
        "failed": failed,
        "torch": next((r.get("torch") for r in records if r["name"] == "torch" and r["ok"]), None),
    }


def torch_view(python_env):
    """What the gpu_host torch check needs from a python_env document that probed torch."""
    record = next((r for r in python_env.get("modules") or [] if r["name"] == "torch"), None)
    if record is None or not record.get("ok"):
        error = (record or {}).get("error") or "torch was not probed"
        if record and record.get("error_type"):
            error = "{}: {}".format(record["error_type"], error)
        return {"ok": False, "error": error}
    return dict(record.get("torch") or {}, ok=True, version=record.get("version"))


def probe_venv(python, imports=(), model_path=None, required=False, torch_devices=False, **run_args):
    """What python_venv verifies in a venv, by kind: {"python", "imports": {name: record}, "packages",
    "torch" (None without torch), "tokenizer" (None without a model), "error" (the interpreter's own)}."""
    steps = probe_steps(
        imports,
        packages=True,
        torch=True,
        torch_devices=torch_devices,
        model_path=model_path,
        required=required,
    )
    run = run_probe(python, steps, **run_args)
    document = {"python": run["python"], "imports": {}, "packages": {}, "torch": None, "tokenizer": None}
    document["error"] = run["error"]
    # No zip(strict=...): this file runs on Python 3.8 hosts; results are either complete or empty.
    for index, result in enumerate(run["results"]):
        step = steps[index]
        if step["kind"] == "import":
            document["imports"][step["name"]] = result
        elif step["kind"] == "packages" and isinstance(result, dict) and result.get("ok") is False:
            document["packages_error"] = "{}: {}".format(result.get("error_type"), result.get("error"))
        else:
            document[step["kind"]] = result
    return document
