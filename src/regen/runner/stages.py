"""The pipeline's stages, read from ``regen.yml`` and ``playbooks/`` each time (never hard-coded).

``regen.yml`` imports ``playbooks/<stage>.yml`` in order; the plays of each stage playbook carry the
stage's tag (``demo_model.yml`` is tagged ``demo``). Playbooks under ``playbooks/`` that ``regen.yml``
does not import (``teardown.yml``) are *standalone* stages: they run by their own playbook.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from regen.runner.errors import BadInput

_IMPORT_KEYS = ("ansible.builtin.import_playbook", "import_playbook")


@dataclass(frozen=True)
class Play:
    name: str
    hosts: str
    tags: tuple[str, ...]


@dataclass(frozen=True)
class Stage:
    """One stage: ``name`` is the playbook's file stem, ``tags`` what selects it (``--tags``)."""

    name: str
    playbook: Path
    tags: tuple[str, ...]
    plays: tuple[Play, ...]
    title: str = ""
    standalone: bool = False

    @property
    def tag(self) -> str:
        """The tag that selects this stage (its first; the name when the plays carry none)."""
        return self.tags[0] if self.tags else self.name

    def matches(self, word: str) -> bool:
        return word == self.name or word in self.tags


def _load_yaml_list(path: Path) -> list:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise BadInput(f"{path} must be a list of plays or imports, found {type(data).__name__}")
    return data


def _tags(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    if isinstance(value, list):
        return tuple(str(t) for t in value)
    return ()


def _hosts(value: object) -> str:
    if isinstance(value, list):
        return ",".join(str(h) for h in value)
    return str(value) if value is not None else ""


def read_stage(
    playbook: Path, *, title: str = "", extra_tags: Sequence[str] = (), standalone: bool = False
) -> Stage:
    plays: list[Play] = []
    tags: list[str] = list(extra_tags)
    for entry in _load_yaml_list(playbook):
        if not isinstance(entry, dict) or "hosts" not in entry:
            continue  # nested imports and odd entries do not name plays
        play_tags = _tags(entry.get("tags"))
        plays.append(
            Play(
                name=str(entry.get("name") or _hosts(entry["hosts"])),
                hosts=_hosts(entry["hosts"]),
                tags=play_tags,
            )
        )
        tags.extend(t for t in play_tags if t not in tags)
    return Stage(
        name=playbook.stem,
        playbook=playbook,
        tags=tuple(tags),
        plays=tuple(plays),
        title=title,
        standalone=standalone,
    )


def discover_stages(root: Path) -> list[Stage]:
    """Every stage of the checkout at ``root``: the pipeline's in ``regen.yml`` order, then standalone."""
    pipeline = root / "regen.yml"
    stages: list[Stage] = []
    imported: set[Path] = set()
    for entry in _load_yaml_list(pipeline):
        if not isinstance(entry, dict):
            continue
        target = next((entry[k] for k in _IMPORT_KEYS if k in entry), None)
        if not isinstance(target, str):
            continue
        path = (pipeline.parent / target).resolve()
        if not path.is_file():
            raise BadInput(f"regen.yml imports {target}, which does not exist")
        imported.add(path)
        stages.append(read_stage(path, title=str(entry.get("name", "")), extra_tags=_tags(entry.get("tags"))))
    playbooks_dir = root / "playbooks"
    if playbooks_dir.is_dir():
        for path in sorted(playbooks_dir.glob("*.yml")):
            if path.resolve() not in imported:
                stages.append(read_stage(path.resolve(), standalone=True))
    return stages


def select_stages(stages: Sequence[Stage], wanted: Iterable[str]) -> list[Stage]:
    """The stages named by ``wanted`` (names or tags), in pipeline order; unknown names are bad input."""
    wanted = [w.strip() for w in wanted if w and w.strip()]
    unknown = [w for w in wanted if not any(s.matches(w) for s in stages)]
    if unknown:
        known = ", ".join(f"{s.name} (tag {s.tag})" if s.tag != s.name else s.name for s in stages) or "none"
        raise BadInput(f"unknown stage {', '.join(map(repr, unknown))}; this checkout has: {known}")
    chosen = [s for s in stages if any(s.matches(w) for w in wanted)]
    standalone = [s for s in chosen if s.standalone]
    if standalone and len(chosen) > 1:
        raise BadInput(
            f"{', '.join(s.name for s in standalone)} runs on its own, not with other stages: "
            f"run `regen run {standalone[0].name}` separately"
        )
    return chosen


def play_stage_map(stages: Iterable[Stage]) -> dict[str, str]:
    """Play name -> stage name, so runner events (which name the play, not its file) map to stages."""
    mapping: dict[str, str] = {}
    for stage in stages:
        for play in stage.plays:
            mapping.setdefault(play.name, stage.name)
    return mapping
