#!/usr/bin/python
"""Ansible module: a wheel of a Python project, rebuilt only when its sources change."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: project_wheel
short_description: Build a wheel of a Python project into a cache keyed by its sources
description:
  - Digests the files a build reads (C(pyproject.toml), C(README.md) and everything under C(src/)) and
    keeps the wheel in C(<dest>/<digest[:16]>/). When that directory already holds the wheel nothing is
    built (changed=false) and the same file, byte for byte, is returned.
  - Otherwise copies those files to a temporary directory (the checkout gets no C(build/) or
    C(*.egg-info)), runs C(pip wheel --no-deps --no-build-isolation) with O(python), moves the wheel into
    place with one rename and removes the wheels of older digests.
  - In check mode nothing is built and RV(wheel) is empty when the wheel is not in the cache yet.
version_added: "0.1.0"
author: regen maintainers
options:
  project:
    description: Directory holding the project's C(pyproject.toml).
    type: path
    required: true
  dest:
    description: Cache directory of the built wheels (on the host the module runs on, usually the controller).
    type: path
    required: true
  python:
    description: Interpreter whose pip and setuptools build the wheel.
    type: str
    default: python3
  timeout:
    description: Seconds allowed for the build.
    type: int
    default: 600
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Build the regen wheel on the controller
  project_wheel:
    project: "{{ regen_root }}"
    dest: "{{ regen_root }}/.cache/regen-wheel"
    python: "{{ ansible_playbook_python }}"
  delegate_to: localhost
  run_once: true
  register: _wheel
"""

RETURN = r"""
wheel:
  description: The wheel file (empty in check mode when it is not built yet).
  type: str
  returned: always
digest:
  description: Digest of the sources the wheel is built from.
  type: str
  returned: always
sha256:
  description: sha256 of the wheel file (empty when not built).
  type: str
  returned: always
"""

import glob
import os
import shutil
import subprocess
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_files import file_sha256, source_digest, source_files

# Zip entries carry this date instead of the build time (wheel honours SOURCE_DATE_EPOCH): 1980-01-01.
_SOURCE_DATE_EPOCH = "315532800"


def _built(directory):
    wheels = sorted(glob.glob(os.path.join(directory, "*.whl")))
    return wheels[0] if len(wheels) == 1 else None


def _build(module, project, files, python, timeout, into):
    """Build the wheel from a copy of `files` in a scratch directory; returns the wheel's path in `into`."""
    scratch = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(into))
    try:
        tree = os.path.join(scratch, "project")
        for name in files:
            target = os.path.join(tree, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(project, name), target)
        out_dir = os.path.join(scratch, "wheel")
        env = dict(os.environ, SOURCE_DATE_EPOCH=_SOURCE_DATE_EPOCH, PIP_DISABLE_PIP_VERSION_CHECK="1")
        argv = [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out_dir, tree]
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=scratch, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            module.fail_json(msg=f"building the wheel of {project} with {python} did not finish: {exc}")
        wheel = _built(out_dir) if proc.returncode == 0 else None
        if wheel is None:
            lines = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            module.fail_json(
                msg=f"building the wheel of {project} with {python} failed (exit {proc.returncode}); that "
                "interpreter needs pip and setuptools (the controller venv has both): " + " | ".join(lines),
            )
        try:
            os.rename(out_dir, into)
        except OSError:
            # Another run built the same digest at the same time and won the rename: the build is
            # reproducible (SOURCE_DATE_EPOCH), so its wheel is this one.
            if _built(into) is None:
                raise
        return os.path.join(into, os.path.basename(wheel))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    module = AnsibleModule(
        argument_spec={
            "project": {"type": "path", "required": True},
            "dest": {"type": "path", "required": True},
            "python": {"type": "str", "default": "python3"},
            "timeout": {"type": "int", "default": 600},
        },
        supports_check_mode=True,
    )
    p = module.params
    project = p["project"]
    if not os.path.isfile(os.path.join(project, "pyproject.toml")):
        module.fail_json(msg=f"{project} has no pyproject.toml: point project at the regen checkout")
    files = source_files(project)
    digest = source_digest(project, files)
    into = os.path.join(p["dest"], digest[:16])
    wheel = _built(into)
    if wheel:
        module.exit_json(changed=False, wheel=wheel, digest=digest, sha256=file_sha256(wheel))
    if module.check_mode:
        module.exit_json(changed=True, wheel="", digest=digest, sha256="")
    os.makedirs(p["dest"], exist_ok=True)
    if os.path.isdir(into):  # an earlier build that died before its wheel was in place
        shutil.rmtree(into)
    wheel = _build(module, project, files, p["python"], p["timeout"], into)
    for old in os.listdir(p["dest"]):
        path = os.path.join(p["dest"], old)
        if path != into and os.path.isdir(path) and not old.startswith("."):
            shutil.rmtree(path, ignore_errors=True)
    module.exit_json(changed=True, wheel=wheel, digest=digest, sha256=file_sha256(wheel))


if __name__ == "__main__":
    main()
