"""Vars plugin: a group_vars/host_vars file that is not valid YAML fails naming its path, line and column.

ansible-core 2.19's host_group_vars re-raises the YAML error of such a file as its bare message ("YAML
parsing failed: Colons in unquoted values must be followed by a non-space character.") without the file,
even at -vvvv. This plugin runs before it (Ansible loads the plugins of the configured vars_plugins path
first) and parses the same files itself; on a YAML error it raises one naming the file and the line. It
returns no variables: host_group_vars still loads them.
"""

from __future__ import annotations

import os

import yaml
from ansible.errors import AnsibleParserError
from ansible.plugins.vars import BaseVarsPlugin

DOCUMENTATION = r"""
name: regen_vars_files
short_description: Name the file and line of a group_vars/host_vars YAML error
description:
  - Parses every YAML file under the C(group_vars) and C(host_vars) directories next to the inventory and the
    playbook, and fails on the first that is not valid YAML with its path, line and column.
  - Returns no variables (the builtin host_group_vars plugin loads them).
options: {}
"""

_SUBDIRS = ("group_vars", "host_vars")
_SUFFIXES = ("", ".yml", ".yaml", ".json")
# Files already parsed this process, by (path, mtime): each is read once however many hosts share it.
_CHECKED: dict[str, float] = {}


def _vars_files(top):
    for sub in _SUBDIRS:
        base = os.path.join(top, sub)
        if not os.path.isdir(base):
            continue
        for root, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if not name.startswith(".") and os.path.splitext(name)[1] in _SUFFIXES:
                    yield os.path.join(root, name)


def yaml_error(path):
    """'PATH:LINE:COLUMN: problem' when the file at `path` is not valid YAML, else None."""
    try:
        with open(path, encoding="utf-8") as handle:
            list(yaml.safe_load_all(handle))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        return f"{where}: {problem}"
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        return f"{path}: {exc}"
    except OSError:
        return None  # unreadable: host_group_vars reports it
    return None


class VarsModule(BaseVarsPlugin):
    REQUIRES_ENABLED = False
    is_stateless = True

    def get_vars(self, loader, path, entities, cache=True):
        super().get_vars(loader, path, entities)
        for found in _vars_files(os.path.realpath(path)):
            try:
                mtime = os.path.getmtime(found)
            except OSError:
                continue
            if _CHECKED.get(found) == mtime:
                continue
            error = yaml_error(found)
            if error:
                raise AnsibleParserError(f"{error} (this file is not valid YAML; fix it and run again)")
            _CHECKED[found] = mtime
        return {}
