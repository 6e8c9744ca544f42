"""Real virtual environments that lack chosen distributions, made in about a second.

``make_venv_without(dest, ["tiktoken"])`` runs ``python -m venv --without-pip`` and fills the new
site-packages with symlinks to every top-level entry of the project venv's site-packages, except the files
of the excluded distributions (their packages and their ``*.dist-info``). Importing an excluded package
then fails for real (``ModuleNotFoundError``), while everything else, including the editable ``regen``
install, imports as usual. The new interpreter is a normal venv python, so it can run subprocesses, jobs
or Ansible modules (as ``ansible_python_interpreter``).

Do not ``pip install`` into such a venv: its site-packages entries are links into the project venv.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_site_packages() -> Path:
    """The site-packages of the interpreter running the tests (the project venv)."""
    return Path(sysconfig.get_paths()["purelib"])


def distribution_entries(names: Iterable[str], site_packages: Path) -> set[str]:
    """Top-level site-packages entries that belong to the named distributions.

    Raises LookupError for a distribution that is not installed there (a typo would otherwise give a venv
    that silently still has the package).
    """
    wanted = {_normalize(name): name for name in names}
    entries: set[str] = set()
    found: set[str] = set()
    for dist in metadata.distributions(path=[str(site_packages)]):
        key = _normalize(dist.metadata["Name"] or "")
        if key not in wanted:
            continue
        found.add(key)
        for file in dist.files or []:
            parts = Path(file).parts
            if parts and parts[0] != "..":
                entries.add(parts[0])
    missing = sorted(wanted[key] for key in set(wanted) - found)
    if missing:
        raise LookupError(f"not installed in {site_packages}: {', '.join(missing)}")
    return entries


def make_venv_without(
    dest: Path,
    exclude: Iterable[str],
    base_site_packages: Path | None = None,
    python: str = sys.executable,
) -> Path:
    """Create a venv at ``dest`` with everything of ``base_site_packages`` but ``exclude``.

    Returns the path of the new interpreter (``dest/bin/python``).
    """
    dest = Path(dest)
    base = Path(base_site_packages) if base_site_packages else project_site_packages()
    skipped = distribution_entries(exclude, base)
    subprocess.run([python, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    new_python = dest / "bin" / "python"
    purelib = subprocess.run(
        [str(new_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    site_packages = Path(purelib)
    site_packages.mkdir(parents=True, exist_ok=True)
    for entry in sorted(base.iterdir()):
        if entry.name in skipped or entry.name == "__pycache__":
            continue
        (site_packages / entry.name).symlink_to(entry)
    return new_python
