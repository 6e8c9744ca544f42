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
from urllib.parse import urlsplit

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
# pip's hash options (`--hash=sha256:<hex>`, also `--hash sha256:<hex>`) and the digest lengths of the
# algorithms pip accepts in hash-checking mode.
_HASH = re.compile(r"^--hash(?:=|\s+)(?P<algorithm>[a-z0-9]+):(?P<digest>\S+)$")
_DIGEST_LENGTH = {"sha256": 64, "sha384": 96, "sha512": 128}
_COMMENT = re.compile(r"(^|\s)#.*$")
_REQUIRES_PYTHON = re.compile(r"^#\s*requires-python:\s*(?P<spec>\S.*?)\s*$")
_RESOLVED_FOR = re.compile(r"^#\s*resolved-with:.*python (?P<python>\d+\.\d+), platform (?P<platform>\S+)")
_RESOLVE_HINT = "re-resolve the lock (envs/resolve.sh: uv pip compile --generate-hashes)"


class LockError(ValueError):
    """The lock text cannot be used: the message names the line and the fix."""


def index_url_environment(url, installer="pip"):
    """The variable the installer reads its index from (pip: PIP_INDEX_URL, uv: UV_INDEX_URL): an index URL
    may hold credentials (``https://user:token@mirror/simple``), which on the command line every ``ps``
    shows. Empty when there is no URL."""
    if not url:
        return {}
    return {"UV_INDEX_URL" if installer == "uv" else "PIP_INDEX_URL": url}


def url_credentials(url):
    """The secret parts of a URL's user-info (``user:password``, the password), for masking; [] if none."""
    netloc = urlsplit(url or "").netloc
    if "@" not in netloc:
        return []
    userinfo = netloc.rsplit("@", 1)[0]
    secrets = [userinfo]
    if ":" in userinfo:
        secrets.append(userinfo.split(":", 1)[1])
    return [s for s in secrets if s]


def normalize_name(name):
    """PEP 503 normalized project name (what wheel file names and pip compare on)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _logical_lines(text):
    """(first physical line number, header comment or None, requirement text) per logical line, the way
    pip reads a requirements file: a trailing backslash continues a line, `#` starts a comment."""
    number, pending, first = 0, "", None
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip().startswith("#"):
            if not pending:
                yield number, raw.strip(), ""
            continue
        line = _COMMENT.sub("", raw).strip()
        if first is None:
            first = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = (pending + line).strip()
        pending, start, first = "", first, None
        if logical:
            yield start, None, logical
    if pending.strip():
        yield first or number, None, pending.strip()


def _split_hashes(logical, source, number):
    """The requirement part of a logical line and the hashes its `--hash` options give."""
    requirement, _, options = logical.partition(" --")
    options = ("--" + options) if options else ""
    hashes = []
    for option in re.split(r"\s+(?=--)", options) if options else []:
        match = _HASH.match(option.strip())
        if not match:
            raise LockError(
                f"{source} line {number}: {option.strip()!r} is a pip option; a lock holds only pinned "
                "requirements and their --hash values (index and wheelhouse settings are role variables)"
            )
        algorithm, digest = match.group("algorithm"), match.group("digest")
        length = _DIGEST_LENGTH.get(algorithm)
        if length is None or not re.fullmatch(f"[0-9a-f]{{{length}}}", digest):
            raise LockError(
                f"{source} line {number}: {option.strip()!r} is not a digest pip can check (sha256, sha384 "
                "or sha512, then the digest in lowercase hex); " + _RESOLVE_HINT
            )
        hashes.append(f"{algorithm}:{digest}")
    return requirement.strip(), hashes


def parse_lock(text, source="lock", require_hashes=True):
    """Parse a pinned, hashed requirements lock (what `uv pip compile --generate-hashes` writes).

    Returns {"pins": {normalized name: version}, "hashes": {normalized name: [algorithm:digest]},
    "lines": [one line per pin: the requirement and its --hash options, sorted], "requires_python":
    spec or None, "python": "X.Y" or None, "platform": str or None}. Every requirement must be pinned
    with `==` (a range is not a lock, and installing one would make two hosts differ) and, unless
    require_hashes is false (an old venv's record), carry the hashes of its files: the role installs
    with `pip install --require-hashes`, where one pin without a hash fails the whole install.
    """
    pins, hashes, lines = {}, {}, []
    requires_python = python = platform = None
    for number, comment, line in _logical_lines(text):
        if comment is not None:
            match = _REQUIRES_PYTHON.match(comment)
            if match:
                requires_python = match.group("spec")
            match = _RESOLVED_FOR.match(comment)
            if match:
                python, platform = match.group("python"), match.group("platform")
            continue
        if line.startswith("-"):
            what = (
                "a --hash without a requirement (the line above it lost its trailing backslash, or its "
                "requirement line was removed)"
                if line.startswith("--hash")
                else "a pip option; a lock holds only pinned requirements (index and wheelhouse settings "
                "are role variables)"
            )
            raise LockError(f"{source} line {number}: {line[:80]!r} is {what}")
        requirement, line_hashes = _split_hashes(line, source, number)
        match = _PIN.match(requirement)
        if not match:
            raise LockError(
                f"{source} line {number}: {requirement!r} is not pinned with '=='; {_RESOLVE_HINT}"
            )
        name, version = normalize_name(match.group("name")), match.group("version")
        if require_hashes and not line_hashes:
            raise LockError(
                f"{source} line {number}: {requirement} has no --hash; the lock is installed with hash "
                "checking (pip --require-hashes), so every pin needs the sha256 of its files: "
                f"{_RESOLVE_HINT}"
            )
        if name in pins:
            if pins[name] != version:
                raise LockError(
                    f"{source} line {number}: {match.group('name')} is pinned twice "
                    f"({pins[name]} and {version})"
                )
            hashes[name] = sorted(set(hashes[name]) | set(line_hashes))
            lines[list(pins).index(name)] = _requirement_line(requirement, hashes[name])
            continue
        pins[name] = version
        hashes[name] = sorted(set(line_hashes))
        lines.append(_requirement_line(requirement, hashes[name]))
    if not pins:
        raise LockError(f"{source} holds no pinned requirement")
    return {
        "pins": pins,
        "hashes": hashes,
        "lines": lines,
        "requires_python": requires_python,
        "python": python,
        "platform": platform,
    }


def _requirement_line(requirement, hashes):
    return " ".join([requirement, *(f"--hash={digest}" for digest in hashes)])


def requirements_text(lock, names=None):
    """A requirements file for pip/uv holding the lock's pins (only `names`, normalized, when given), each
    with its --hash options on continuation lines, as `uv pip compile --generate-hashes` writes them."""
    chosen = []
    for index, name in enumerate(lock["pins"]):  # lines are in pin order, one per pin
        if names is not None and name not in names:
            continue
        requirement, _, _ = lock["lines"][index].partition(" --hash=")
        chosen.append(" \\\n    ".join([requirement, *(f"--hash={h}" for h in lock["hashes"][name])]))
    return "".join(entry + "\n" for entry in chosen)


def parse_extra(spec):
    """(normalized name, version or None) of an extra package spec such as 'tiktoken==0.14.0'."""
    match = _PIN.match(spec.strip())
    if match:
        return normalize_name(match.group("name")), match.group("version")
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if not match:
        raise LockError(f"extra package {spec!r} is not a requirement")
    return normalize_name(match.group(1)), None


def check_extras(extras, lock, variable=""):
    """The extra packages to install on top of a hashed lock, or a LockError naming `variable`.

    A hashed lock is installed with pip's hash checking, which cannot resolve anything it holds no hash
    for. So extras go in a second install without dependencies: each must be pinned `name==version`, must
    not repin a package of the lock, and whatever it needs beyond the lock must be an extra too (the
    `pip check` after the install names what is missing). Returns the `name==version` lines to install
    (an extra the lock already pins at that version adds nothing and is dropped)."""
    where = variable or "extra_packages of this entry in python_env_envs"
    wanted = []
    for spec in extras:
        name, version = parse_extra(spec)
        if version is None:
            raise LockError(
                f"{where}: {spec!r} is not pinned; the lock is installed with hash checking, so an extra "
                f"package must be pinned exactly ('{name}==<version>', with every dependency it needs beyond "
                "the lock listed too), or added to the environment's .in file and resolved into its lock "
                "(envs/resolve.sh)"
            )
        locked = lock["pins"].get(name)
        if locked is not None and locked != version:
            raise LockError(
                f"{where}: {spec!r} conflicts with the lock, which pins {name}=={locked}; drop the extra, or "
                "change the pin in the environment's .in file and re-resolve its lock (envs/resolve.sh)"
            )
        if locked is None:
            wanted.append(spec.strip())
    return wanted


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
# Hash-checking mode refused a file: pip's "THESE PACKAGES DO NOT MATCH THE HASHES" block (the requirement,
# where the file came from, the expected digests, "Got <digest>") and uv's "Hash mismatch for `req`".
_PIP_HASH_MISMATCH = re.compile(
    r"DO NOT MATCH THE HASHES.*?^\s+(?P<req>\S+==\S+) from (?P<origin>\S+?)(?: \(from [^\n]*\))?:[ \t]*$"
    r".*?\bGot\s+(?P<got>[0-9a-f]+)",
    re.S | re.M,
)
_UV_HASH_MISMATCH = re.compile(
    r"Hash mismatch for `(?P<req>[^`]+)`.*?Computed:\s*(?:\w+:)?(?P<got>[0-9a-f]+)", re.S
)
_HASH_MISSING = re.compile(
    r"(?:Hashes are required in --require-hashes mode.*?^\s+(?P<pip>\S+==\S+)|"
    r"all requirements must have a hash, but none were provided for: (?P<uv>\S+))",
    re.S | re.M,
)


def hash_mismatch(output):
    """{"requirement", "got", "origin"} when pip or uv refused a file in hash-checking mode, else None."""
    text = output or ""
    match = _PIP_HASH_MISMATCH.search(text)
    if match:
        return {"requirement": match.group("req"), "got": match.group("got"), "origin": match.group("origin")}
    match = _UV_HASH_MISMATCH.search(text)
    if match:
        return {"requirement": match.group("req"), "got": match.group("got"), "origin": None}
    return None


def hash_mismatch_message(mismatch, env_name, where, offline):
    """What to do about a file whose sha256 the lock does not list (`where`: the wheelhouse or index)."""
    origin = " ({})".format(mismatch["origin"]) if mismatch.get("origin") else ""
    head = (
        "the file for {req} from {where}{origin} is not one the lock of environment '{env}' was resolved "
        "to: its sha256 {got} is not among the lock's hashes for that pin (pip --require-hashes refused it); "
    ).format(req=mismatch["requirement"], where=where, origin=origin, env=env_name, got=mismatch["got"])
    if offline:
        return head + (
            "delete that file from the controller's wheelhouse so the role downloads the locked one again "
            "(python_env_wheelhouse_build: true), or put the locked file there"
        )
    return head + (
        "the index serves other bytes for that version than the ones the lock was resolved against (a mirror "
        "that rebuilt it, or tampering): point python_env_index_url at an index that serves the published "
        "files, or re-resolve the lock (envs/resolve.sh) against this index if you trust it"
    )


def classify_install_failure(output, env_name, index, offline, wheelhouse):
    """One actionable message for a failed `pip install` / `uv pip install`."""
    text = output or ""
    if _NO_SPACE.search(text):
        return (
            f"the disk filled up while installing environment '{env_name}' (No space left on device); "
            "free space or raise min_free_mb of the entry so the check catches it before installing"
        )
    mismatch = hash_mismatch(text)
    if mismatch:
        where = f"the wheelhouse {wheelhouse}" if offline else f"the index {index or '(pip default)'}"
        return hash_mismatch_message(mismatch, env_name, where, offline)
    missing = _HASH_MISSING.search(text)
    if missing:
        return (
            "{} has no --hash in the lock of environment '{}', and hash checking needs one for every pin; "
            "re-resolve the lock (envs/resolve.sh: uv pip compile --generate-hashes)".format(
                missing.group("pip") or missing.group("uv"), env_name
            )
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
