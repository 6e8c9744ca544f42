"""Decisions behind the python_env role: lock parsing, fingerprints, wheelhouse completeness, failure
classification and verification messages. Pure functions over strings and dicts, unit-tested directly.
What a venv can import is probed by module_utils/regen_pyenv.py (the one probe); this file judges it.

Standard library only, Python 3.8+: the `python_venv` and `wheelhouse` modules ship this to
whatever host they run on (a fresh LXC container has nothing but Debian's python3).
"""

from __future__ import annotations

import hashlib
import json
import re

# Where a managed venv keeps what it was built from (inside the venv directory itself, so the record
# moves and disappears together with the venv it describes).
STATE_DIR = ".regen-env"
LOCK_FILE = "lock.txt"
FINGERPRINT_FILE = "fingerprint"
MANIFEST_FILE = "manifest.json"
# {wheel file name: sha256} of the wheels installed on top of the lock (the regen package).
WHEELS_FILE = "wheels.json"
# Suffix of the real directories behind the symlink at `path`: <path>.regen-<first 12 of the fingerprint>.
BUILD_SUFFIX = ".regen-"

# Import names whose distribution is called something else (the message must name what to pin).
IMPORT_TO_DIST = {
    "yaml": "PyYAML",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "cv2": "opencv-python",
    "google": "protobuf",
    "attr": "attrs",
    "dateutil": "python-dateutil",
    "sentencepiece": "sentencepiece",
    "specforge": "specforge",
    "sgl_kernel": "sglang-kernel",
}

_PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]]*\])?\s*==\s*(?P<version>[^\s;#]+)"
    r"\s*(?P<marker>;[^#]*)?(?:#.*)?$"
)
_REQUIRES_PYTHON = re.compile(r"^#\s*requires-python:\s*(?P<spec>\S.*?)\s*$")
_RESOLVED_FOR = re.compile(r"^#\s*resolved-with:.*python (?P<python>\d+\.\d+), platform (?P<platform>\S+)")


class LockError(ValueError):
    """The lock text cannot be used: the message names the line and the fix."""


def normalize_name(name):
    """PEP 503 normalized project name (what wheel file names and pip compare on)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text, source="lock"):
    """Parse a pinned requirements lock.

    Returns {"pins": {normalized name: version}, "lines": [requirement lines], "requires_python": spec
    or None, "python": "X.Y" or None, "platform": str or None}. Every requirement must be pinned with
    `==`: a range is not a lock, and installing one would make two hosts differ.
    """
    pins = {}
    lines = []
    requires_python = python = platform = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            match = _REQUIRES_PYTHON.match(line)
            if match:
                requires_python = match.group("spec")
            match = _RESOLVED_FOR.match(line)
            if match:
                python, platform = match.group("python"), match.group("platform")
            continue
        if line.startswith("-"):
            raise LockError(
                f"{source} line {number}: {line!r} is a pip option; a lock holds only pinned requirements "
                "(index and wheelhouse settings are role variables)"
            )
        match = _PIN.match(line)
        if not match:
            raise LockError(
                f"{source} line {number}: {line!r} is not pinned with '=='; re-resolve the lock "
                "(envs/resolve.sh)"
            )
        name = normalize_name(match.group("name"))
        if name in pins and pins[name] != match.group("version"):
            raise LockError(
                f"{source} line {number}: {match.group('name')} is pinned twice "
                f"({pins[name]} and {match.group('version')})"
            )
        pins[name] = match.group("version")
        lines.append(line.split("#", 1)[0].strip())
    if not pins:
        raise LockError(f"{source} holds no pinned requirement")
    return {
        "pins": pins,
        "lines": lines,
        "requires_python": requires_python,
        "python": python,
        "platform": platform,
    }


def parse_extra(spec):
    """(normalized name, version or None) of an extra package spec such as 'tiktoken==0.14.0'."""
    match = _PIN.match(spec.strip())
    if match:
        return normalize_name(match.group("name")), match.group("version")
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if not match:
        raise LockError(f"extra package {spec!r} is not a requirement")
    return normalize_name(match.group(1)), None


def fingerprint(lock_lines, extra_packages=(), python_version="", extra_paths=()):
    """What a venv was built from. Comments in the lock do not count (a new header is not a rebuild);
    the interpreter's major.minor does (a venv cannot move to another Python)."""
    document = {
        "lock": sorted(lock_lines),
        "extra_packages": sorted(extra_packages),
        "python": python_version,
        "extra_paths": list(extra_paths),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode("utf-8")).hexdigest()


def build_dir_for(path, digest):
    return "{}{}{}".format(path.rstrip("/"), BUILD_SUFFIX, digest[:12])


# --------------------------------------------------------------------------------------------------
# Python version checks
# --------------------------------------------------------------------------------------------------


def version_tuple(text):
    parts = []
    for piece in str(text).strip().split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group(0)))
    return tuple(parts)


def python_satisfies(version, spec):
    """Does Python `version` ("3.11.2") satisfy a requires-python spec (">=3.10", ">=3.10,<3.14")?"""
    have = version_tuple(version)
    for clause in (c.strip() for c in (spec or "").split(",")):
        if not clause:
            continue
        match = re.match(r"^(>=|<=|==|!=|>|<|~=)\s*([\d.*]+)$", clause)
        if not match:
            raise LockError(f"requires-python clause {clause!r} is not understood")
        op, want_text = match.groups()
        if want_text.endswith(".*"):
            prefix = version_tuple(want_text[:-2])
            equal = have[: len(prefix)] == prefix
            ok = equal if op == "==" else not equal if op == "!=" else False
        else:
            want = version_tuple(want_text)
            size = max(len(have), len(want))
            left, right = have + (0,) * (size - len(have)), want + (0,) * (size - len(want))
            ok = {
                ">=": left >= right,
                "<=": left <= right,
                "==": left == right,
                "!=": left != right,
                ">": left > right,
                "<": left < right,
                "~=": left >= right and left[: len(want) - 1] == right[: len(want) - 1],
            }[op]
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# Wheelhouse
# --------------------------------------------------------------------------------------------------


def _canonical_version(version):
    return re.sub(r"\.0+$", "", version.lower().replace("_", "-"))


def distribution_files(filenames):
    """{(normalized name, canonical version)} for the wheels and sdists in a wheelhouse listing."""
    found = set()
    for filename in filenames:
        if filename.endswith(".whl"):
            parts = filename[:-4].split("-")
            if len(parts) >= 5:
                found.add((normalize_name(parts[0]), _canonical_version(parts[1])))
        else:
            match = re.match(r"^(?P<name>.+)-(?P<version>[^-]+)\.(tar\.gz|zip|tar\.bz2)$", filename)
            if match:
                found.add((normalize_name(match.group("name")), _canonical_version(match.group("version"))))
    return found


def wheelhouse_missing(pins, filenames):
    """The `name==version` pins a wheelhouse directory has no file for, in lock order."""
    have = distribution_files(filenames)
    return [
        f"{name}=={version}"
        for name, version in pins.items()
        if (name, _canonical_version(version)) not in have
    ]


def download_platforms(platform):
    """pip download --platform values for a uv target such as 'x86_64-manylinux_2_28'."""
    if not platform:
        return []
    match = re.match(r"^(?P<arch>[a-z0-9_]+)-manylinux_2_(?P<minor>\d+)$", platform)
    if not match:
        return []
    arch, minor = match.group("arch"), int(match.group("minor"))
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)]
    return [*tags, f"manylinux2014_{arch}", f"linux_{arch}"]


# --------------------------------------------------------------------------------------------------
# What went wrong
# --------------------------------------------------------------------------------------------------

_UNREACHABLE = re.compile(
    r"(NewConnectionError|Failed to establish a new connection|Name or service not known|"
    r"Temporary failure in name resolution|Connection refused|ConnectTimeoutError|Network is unreachable|"
    r"ProxyError|No route to host|error sending request|dns error|tcp connect error|"
    r"Could not fetch URL|Failed to fetch)",
    re.I,
)
_NO_MATCH = re.compile(r"No matching distribution found for (?P<req>\S+)")
_UV_NO_MATCH = re.compile(
    r"Because (?P<req>[\w.\-\[\]]+(?:==\S+)?) was not found in the (?:package registry|"
    r"provided package locations)"
)
_NO_SPACE = re.compile(r"(No space left on device|\[Errno 28\])")


def classify_install_failure(output, env_name, index, offline, wheelhouse):
    """One actionable message for a failed `pip install` / `uv pip install`."""
    text = output or ""
    if _NO_SPACE.search(text):
        return (
            f"the disk filled up while installing environment '{env_name}' (No space left on device); "
            "free space or raise min_free_mb of the entry so the check catches it before installing"
        )
    if offline:
        match = _NO_MATCH.search(text) or _UV_NO_MATCH.search(text)
        missing = match.group("req") if match else "a pinned package"
        return (
            f"the wheelhouse {wheelhouse} has no usable file for {missing} (environment '{env_name}', "
            "offline mode): rebuild it with python_env_wheelhouse_build: true on a controller that "
            "reaches an index, or add the wheel for this host's Python and platform"
        )
    if _UNREACHABLE.search(text):
        return (
            "the package index {} cannot be reached from this host while installing environment '{}'; "
            "check the network/proxy, point python_env_index_url at a reachable mirror, or use offline "
            "mode (python_env_offline: true) with a wheelhouse built on the controller".format(
                index or "(pip's default index)", env_name
            )
        )
    match = _NO_MATCH.search(text) or _UV_NO_MATCH.search(text)
    if match:
        return (
            "the lock of environment '{}' does not resolve: no distribution matches {} on index {} "
            "(a pin that does not exist, or no wheel for this Python/platform); re-resolve the lock "
            "(envs/resolve.sh)".format(env_name, match.group("req"), index or "(pip's default index)")
        )
    return f"installing environment '{env_name}' failed: {tail(text)}"


def pip_check_problems(output):
    """Lines of `pip check` / `uv pip check` output that report a broken requirement."""
    problems = []
    for line in (output or "").splitlines():
        line = line.strip()
        if not line or line.startswith(("No broken requirements", "Checked ", "All installed packages")):
            continue
        if re.search(
            r"(requires|has requirement|is not installed|incompatible|but you have|"
            r"Found \d+ incompatibilit|The package)",
            line,
            re.I,
        ):
            problems.append(line)
    return problems


def tail(text, lines=12):
    kept = [line for line in (text or "").strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "(no output)"


_NOT_FOUND_IN_ENV = re.compile(r"not found in your environment: ([\w\-., ]+?)\. Run")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def missing_modules(error_text, error_name=None):
    """Top-level module names an ImportError says are missing (ModuleNotFoundError.name, or the list in
    transformers' 'requires the following packages that were not found in your environment' message)."""
    found = []
    if error_name:
        found.append(error_name.split(".")[0])
    for match in _NOT_FOUND_IN_ENV.finditer(error_text or ""):
        found.extend(p.strip() for p in match.group(1).split(",") if p.strip())
    for match in _NO_MODULE.finditer(error_text or ""):
        found.append(match.group(1).split(".")[0])
    return list(dict.fromkeys(found))


def dist_for_module(module):
    return IMPORT_TO_DIST.get(module, module)


def remedy_for(missing, env):
    """How to get `missing` (distribution names) into the venv of `env` (an entry of python_env_envs)."""
    names = ", ".join(missing)
    if env.get("manage", True):
        return "add {} to {} (or pin it in the lock {} and re-resolve it with envs/resolve.sh)".format(
            names,
            env.get("remedy_variable") or "extra_packages of this entry in python_env_envs",
            env.get("lock_source") or "of this environment",
        )
    return "install {} into that venv (it is not managed by regen: {}/bin/python -m pip install {})".format(
        names, env["path"], " ".join(missing)
    )


def verification_errors(probe, env):
    """Messages for everything the probe of a venv found wrong; [] when it verified."""
    errors = []
    where = env["path"]
    for module, result in sorted((probe.get("imports") or {}).items()):
        if result.get("ok"):
            continue
        missing = missing_modules(result.get("error", ""), result.get("missing_module"))
        if module in missing or (missing and missing[0] == module.split(".")[0]):
            dist = dist_for_module(module.split(".")[0])
            errors.append(
                "{} is not installed in {} (environment '{}'); {}".format(
                    dist, where, env["name"], remedy_for([dist], env)
                )
            )
        elif missing:
            dists = [dist_for_module(m) for m in missing]
            errors.append(
                "{} cannot be imported in {} (environment '{}') because {} {} missing; {}".format(
                    module,
                    where,
                    env["name"],
                    ", ".join(dists),
                    "is" if len(dists) == 1 else "are",
                    remedy_for(dists, env),
                )
            )
        else:
            errors.append(
                "{} cannot be imported in {} (environment '{}'): {}: {}".format(
                    module, where, env["name"], result.get("error_type"), result.get("error")
                )
            )
    tokenizer = probe.get("tokenizer")
    if tokenizer and tokenizer.get("attempted") and not tokenizer.get("ok"):
        missing = missing_modules(tokenizer.get("error", ""), tokenizer.get("missing_module"))
        model = tokenizer.get("model_path")
        if missing:
            dists = [dist_for_module(m) for m in missing]
            errors.append(
                "{} {} not installed in {} (environment '{}'), so the tokenizer of {} cannot load there "
                "(AutoTokenizer with trust_remote_code); {}".format(
                    ", ".join(dists),
                    "is" if len(dists) == 1 else "are",
                    where,
                    env["name"],
                    model,
                    remedy_for(dists, env),
                )
            )
        else:
            errors.append(
                "the tokenizer of {} does not load in {} (environment '{}'): {}".format(
                    model, where, env["name"], tokenizer.get("error")
                )
            )
    elif tokenizer and tokenizer.get("required") and not tokenizer.get("attempted"):
        errors.append(
            "the tokenizer smoke of environment '{}' needs {}, which does not exist on this host".format(
                env["name"], tokenizer.get("model_path")
            )
        )
    return errors


# --------------------------------------------------------------------------------------------------
# Diff and manifest
# --------------------------------------------------------------------------------------------------


def pins_diff(old_pins, new_pins):
    """Readable package changes between two pin maps ('+ added==1', '- removed==1', '~ name 1 -> 2')."""
    lines = []
    for name in sorted(set(old_pins) | set(new_pins)):
        before, after = old_pins.get(name), new_pins.get(name)
        if before == after:
            continue
        if before is None:
            lines.append(f"+ {name}=={after}")
        elif after is None:
            lines.append(f"- {name}=={before}")
        else:
            lines.append(f"~ {name} {before} -> {after}")
    return lines


def manifest(env, probe, digest, installer, wheels=None):
    """The environment manifest recorded in the run's artifacts. Deterministic (no timestamps) so an
    unchanged venv rewrites the same bytes and the artifact task stays changed=0."""
    torch = probe.get("torch")
    return {
        "environment": env["name"],
        "path": env["path"],
        "managed": bool(env.get("manage", True)),
        "fingerprint": digest,
        "installer": installer,
        "python": probe.get("python"),
        "packages": dict(sorted((probe.get("packages") or {}).items())),
        "torch": torch,
        "imports": {
            name: {"ok": bool(r.get("ok")), "version": r.get("version")}
            for name, r in sorted((probe.get("imports") or {}).items())
        },
        "tokenizer": probe.get("tokenizer"),
        "wheels": dict(sorted((wheels or {}).items())),
    }
