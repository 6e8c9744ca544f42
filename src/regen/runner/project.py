"""Where a regen checkout lives and how its ``ansible.cfg`` is wired into ansible-runner.

ansible-runner does not read ``ansible.cfg`` from the project directory by itself, forces its own stdout
callback (``awx_display``) and points the fact cache into each run's artifact directory. regen makes each
of those choices explicitly here, so a run through the API behaves like ``ansible-playbook regen.yml``
started from the checkout.
"""

from __future__ import annotations

import configparser
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from regen.runner.errors import BadInput

PIPELINE = "regen.yml"


@dataclass(frozen=True)
class Project:
    """A regen checkout: the directory that holds ``regen.yml`` and the ``ansible.cfg`` it runs with."""

    root: Path
    ansible_cfg: Path

    @property
    def pipeline(self) -> Path:
        return self.root / PIPELINE

    @property
    def default_private_data_dir(self) -> Path:
        # .cache/ is git-ignored; runner artifacts are per-run scratch, not results.
        return self.root / ".cache" / "runner"

    def cfg_value(self, key: str, section: str = "defaults") -> str | None:
        """One value of ``ansible.cfg`` as written (no interpolation), or None."""
        parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
        try:
            parser.read(self.ansible_cfg, encoding="utf-8")
        except configparser.Error:
            return None
        value = parser.get(section, key, fallback=None)
        return value.strip() if value is not None else None

    def cfg_path(self, key: str) -> Path | None:
        """A path setting of ``ansible.cfg``, made absolute against the file's own directory."""
        value = self.cfg_value(key)
        if not value:
            return None
        path = Path(os.path.expanduser(value))
        return path if path.is_absolute() else (self.ansible_cfg.parent / path)

    def default_inventory(self) -> Path | None:
        return self.cfg_path("inventory")

    def resolve_inventory(self, inventory: str | os.PathLike[str] | None) -> Path:
        """An inventory path, absolute: as given (relative to the cwd, else the checkout) or the default."""
        if inventory is None:
            path = self.default_inventory()
            if path is None:
                raise BadInput(f"no inventory given and {self.ansible_cfg} sets none: pass -i INVENTORY")
            if not path.exists():
                raise BadInput(f"the default inventory {path} (from {self.ansible_cfg}) does not exist")
            return path
        given = Path(os.path.expanduser(os.fspath(inventory)))
        for candidate in (given, self.root / given) if not given.is_absolute() else (given,):
            if candidate.exists():
                return candidate.resolve()
        raise BadInput(
            f"inventory {os.fspath(inventory)!r} does not exist (looked in {Path.cwd()} and {self.root}); "
            "pass a directory or file such as inventory/local"
        )


def _looks_like_checkout(path: Path) -> bool:
    return (path / PIPELINE).is_file() and (path / "playbooks").is_dir()


def find_project(
    project_dir: str | os.PathLike[str] | None = None, *, ansible_cfg: str | None = None
) -> Project:
    """Locate the checkout: ``project_dir`` if given, else ``$REGEN_ROOT``, the cwd or one of its parents,
    else the checkout this package is installed from (editable install).

    The ``ansible.cfg`` is the project's own when it has one, else the one of the checkout the package
    comes from, so test projects without a config still run with the repository's settings.
    """
    candidates: list[Path] = []
    if project_dir is not None:
        path = Path(project_dir).expanduser().resolve()
        if not _looks_like_checkout(path):
            raise BadInput(f"{path} is not a regen checkout: it needs {PIPELINE} and playbooks/")
        candidates = [path]
    else:
        env_root = os.environ.get("REGEN_ROOT")
        if env_root:
            candidates.append(Path(env_root).expanduser().resolve())
        cwd = Path.cwd().resolve()
        candidates.extend([cwd, *cwd.parents])
        candidates.append(_package_checkout())
    root = next((c for c in candidates if _looks_like_checkout(c)), None)
    if root is None:
        raise BadInput(
            f"cannot find a regen checkout ({PIPELINE} and playbooks/) from {Path.cwd()}: "
            "run from inside the repository, pass --project DIR, or set REGEN_ROOT"
        )
    if ansible_cfg is not None:
        cfg = Path(ansible_cfg).expanduser().resolve()
        if not cfg.is_file():
            raise BadInput(f"ansible.cfg {cfg} does not exist")
    elif (root / "ansible.cfg").is_file():
        cfg = root / "ansible.cfg"
    else:
        cfg = _package_checkout() / "ansible.cfg"
        if not cfg.is_file():
            raise BadInput(f"{root} has no ansible.cfg and none was given")
    return Project(root=root, ansible_cfg=cfg)


def _package_checkout() -> Path:
    # src/regen/runner/project.py -> the checkout root, for the editable install the project uses.
    return Path(__file__).resolve().parents[3]


def ansible_bin_dir() -> Path | None:
    """The directory holding the ``ansible-playbook`` that belongs to this Python (the project venv)."""
    candidate = Path(sys.executable).parent
    return candidate if (candidate / "ansible-playbook").exists() else None
