"""Install the collections requirements.yml pins from the hashed `ansible` wheel on PyPI (no Galaxy).

usage: python scripts/install_collections.py requirements.yml requirements/collections.lock .collections

pip downloads the one wheel the lock names, in hash-checking mode (into the pip cache and a temporary
directory); only the listed collections are extracted into
<dest>/ansible_collections/<namespace>/<name>, and each one's MANIFEST.json must carry the pinned version.
An installed collection of the pinned version is left alone, so a re-run does nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml


def installed_version(dest: Path, fqcn: str) -> str | None:
    manifest = dest / "ansible_collections" / Path(*fqcn.split(".")) / "MANIFEST.json"
    try:
        return json.loads(manifest.read_text())["collection_info"]["version"]
    except (OSError, ValueError, KeyError):
        return None


def main(requirements: str, lock: str, dest: str) -> int:
    spec = yaml.safe_load(Path(requirements).read_text())
    wanted = {c["name"]: str(c["version"]) for c in spec.get("collections") or []}
    target = Path(dest)
    todo = {name: version for name, version in wanted.items() if installed_version(target, name) != version}
    if not todo:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "-r",
                lock,
                "-d",
                tmp,
            ],
            check=True,
        )
        (path,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(path) as archive:
            for name, version in todo.items():
                prefix = "ansible_collections/" + name.replace(".", "/") + "/"
                members = [m for m in archive.namelist() if m.startswith(prefix)]
                manifest = json.loads(archive.read(prefix + "MANIFEST.json"))["collection_info"]["version"]
                if manifest != version:
                    sys.exit(f"{path.name} holds {name} {manifest}, requirements.yml pins {version}")
                shutil.rmtree(target / prefix, ignore_errors=True)
                archive.extractall(target, members)
                print(f"install_collections: {name} {version} from {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
