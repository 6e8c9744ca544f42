"""Which variables the pipeline knows, and which of the variables a run was given it does not.

A misspelled variable in inventory or in `-e` (`prompt_data_souces:`) is otherwise ignored without a word:
the role reads its own default instead and the run quietly builds something else (the demo prompts instead
of the user's). The check compares every name the inventory and `-e` set with the names the roles declare
(each role's meta/argument_specs.yml options and defaults/main.yml keys; the globals are the `regen` role's)
and fails on the ones nobody declares, naming the closest known names.

Standard library and PyYAML only (PyYAML ships with ansible-core): the module runs on the controller.
"""

from __future__ import annotations

import difflib
import os

import yaml

# Ansible's own names a host's variables carry before any play runs (magic variables and connection
# settings). Every `ansible_*` name is Ansible's (connection, interpreter, become, facts), so the prefix is
# accepted as a whole: regen declares none of its own under it.
ANSIBLE_PREFIX = "ansible_"
ANSIBLE_MAGIC_NAMES = frozenset({
    "environment", "group_names", "groups", "hostvars", "inventory_dir", "inventory_file",
    "inventory_hostname", "inventory_hostname_short", "omit", "play_hosts", "playbook_dir", "role_names",
    "role_path",
})
# The one variable through which a user declares names of their own (documented in the regen role).
USER_VARIABLES = "regen_user_variables"


def _yaml_mapping(path):
    """The mapping at `path` ({} when the file is absent or empty)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        document = yaml.safe_load(handle)
    return document if isinstance(document, dict) else {}


def role_variables(roles_dir):
    """{name: role} of every variable the roles under `roles_dir` declare: the options of each entry point
    of meta/argument_specs.yml and the keys of defaults/main.yml."""
    declared = {}
    if not os.path.isdir(roles_dir):
        return declared
    for role in sorted(os.listdir(roles_dir)):
        specs = _yaml_mapping(os.path.join(roles_dir, role, "meta", "argument_specs.yml"))
        for entry in (specs.get("argument_specs") or {}).values():
            for name in (entry or {}).get("options") or {}:
                declared.setdefault(name, role)
        for name in _yaml_mapping(os.path.join(roles_dir, role, "defaults", "main.yml")):
            declared.setdefault(name, role)
    return declared


def is_ansible_name(name):
    return name.startswith(ANSIBLE_PREFIX) or name in ANSIBLE_MAGIC_NAMES


def unknown_variables(given, declared, user_declared=(), facts=()):
    """[{name, suggestions}] for each name in `given` that is neither Ansible's own, nor in `declared`, nor
    in `user_declared` (the user's regen_user_variables), nor a fact of the host (`facts`: the fact cache
    brings facts such as `gather_subset` and `module_setup` back as host variables), sorted by name;
    suggestions are the closest declared names (at most three, most similar first)."""
    known = set(declared) | set(user_declared) | set(facts) | {USER_VARIABLES}
    candidates = sorted(known)
    unknown = []
    for name in sorted(set(given)):
        if is_ansible_name(name) or name in known:
            continue
        suggestions = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
        unknown.append({"name": name, "suggestions": suggestions})
    return unknown


def describe_unknown(unknown, host):
    """The failure message for `unknown` (non-empty) on `host`: one line per name with what to do."""
    lines = [
        f"{len(unknown)} variable(s) set for {host} in the inventory or with -e are declared by no role, "
        "so nothing would read them (a misspelled name leaves the role on its default):"
    ]
    for entry in unknown:
        suggestions = entry["suggestions"]
        hint = f"did you mean {' or '.join(suggestions)}?" if suggestions else "no close name"
        lines.append(f"  {entry['name']}: {hint}")
    lines.append(
        f"Fix the name, or declare a variable of your own in {USER_VARIABLES} (a list of names) so the check "
        "lets it through."
    )
    return "\n".join(lines)
