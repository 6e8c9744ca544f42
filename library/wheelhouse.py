#!/usr/bin/python
"""Make sure a wheelhouse directory holds a file for every pin of a lock (offline provisioning)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: wheelhouse
short_description: Fill (or check) a wheelhouse with the wheels a pinned lock needs
description:
  - Runs on the controller. Lists the pins of the lock that O(dest) has no wheel or sdist for; with
    O(build=true) downloads exactly those with C(pip download --no-deps --only-binary=:all:) for the
    lock's target Python and platform (read from the lock header), so hosts without an index can
    install with C(--no-index). The download runs in pip's hash-checking mode (C(--require-hashes)), so a
    file whose sha256 the lock does not list is refused. A complete wheelhouse is left alone
    (changed=false, no network).
  - With O(build=false) a missing wheel is an error that names every missing pin.
options:
  name:
    description: Environment name (for messages).
    type: str
    required: true
  lock:
    description: Text of the pinned lock.
    type: str
    required: true
  lock_source:
    description: Where the lock came from (for messages).
    type: str
    default: ''
  extra_packages:
    description: Extra packages, each pinned C(name==version), downloaded without dependencies (as they are
      installed).
    type: list
    elements: str
    default: []
  remedy_variable:
    description: The inventory variable a user edits to change the extra packages (named in messages).
    type: str
    default: ''
  dest:
    description: Wheelhouse directory.
    type: path
    required: true
  build:
    description: Download what is missing.
    type: bool
    default: true
  pip:
    description: Python whose pip downloads.
    type: str
    default: python3
  index_url:
    description: >-
      Index to download from; empty uses pip's configuration. It reaches pip as C(PIP_INDEX_URL), never
      on its command line; a password in it is masked in the output.
    type: str
    default: ''
author: regen
"""

EXAMPLES = r"""
- name: Fill the demo wheelhouse
  wheelhouse:
    name: demo
    lock: "{{ lookup('ansible.builtin.file', 'envs/demo.lock') }}"
    dest: .cache/wheelhouse/demo
  delegate_to: localhost
"""

RETURN = r"""
missing: {description: Pins that had no file before this run., type: list, returned: always}
downloaded: {description: Files added., type: list, returned: always}
dest: {description: The wheelhouse directory (O(dest))., type: str, returned: always}
"""

import os
import shutil
import subprocess
import sys
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_net import redact_url
from ansible.module_utils.regen_venv import (
    LockError,
    check_extras,
    download_platforms,
    hash_mismatch,
    hash_mismatch_message,
    index_url_environment,
    parse_lock,
    requirements_text,
    tail,
    url_credentials,
    wheelhouse_missing,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            lock=dict(type="str", required=True),
            lock_source=dict(type="str", default=""),
            extra_packages=dict(type="list", elements="str", default=[]),
            remedy_variable=dict(type="str", default=""),
            dest=dict(type="path", required=True),
            build=dict(type="bool", default=True),
            pip=dict(type="str", default="python3"),
            index_url=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    module.no_log_values.update(url_credentials(p["index_url"]))  # a password in the URL stays out of output
    try:
        lock = parse_lock(p["lock"], p["lock_source"] or "lock of {}".format(p["name"]))
        extras = check_extras(p["extra_packages"], lock, p["remedy_variable"])
    except LockError as exc:
        module.fail_json(msg="environment '{}': {}".format(p["name"], exc))
    existing = os.listdir(p["dest"]) if os.path.isdir(p["dest"]) else []
    missing = wheelhouse_missing(lock["pins"], existing)
    extras_marker = os.path.join(p["dest"], ".extras")
    extras_text = "\n".join(sorted(p["extra_packages"]))
    extras_done = False
    if os.path.exists(extras_marker):
        with open(extras_marker) as handle:
            extras_done = handle.read() == extras_text
    if not missing and (not p["extra_packages"] or extras_done):
        module.exit_json(changed=False, missing=[], downloaded=[], dest=p["dest"])
    if not p["build"]:
        module.fail_json(
            msg=f"the wheelhouse {p['dest']} lacks {len(missing)} pinned package(s) of environment "
            f"'{p['name']}': {', '.join(missing[:10])}; set python_env_wheelhouse_build: true on a "
            "controller that reaches an index, or copy the wheels in",
            missing=missing,
        )
    if module.check_mode:
        module.exit_json(changed=True, missing=missing, downloaded=[], dest=p["dest"])
    os.makedirs(p["dest"], exist_ok=True)
    target = []
    if lock["python"]:
        target += [
            "--python-version",
            lock["python"],
            "--implementation",
            "cp",
            "--abi",
            "cp{}".format(lock["python"].replace(".", "")),
        ]
        for tag in download_platforms(lock["platform"]):
            target += ["--platform", tag]
    base = [
        p["pip"],
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--only-binary=:all:",
        "-d",
        None,  # the staging directory, below
        *target,
    ]
    # The index URL (credentials and all) reaches pip through its environment, never its command line.
    env = {**os.environ, **index_url_environment(p["index_url"])}
    # The missing pins with their hashes: pip downloads in hash-checking mode and refuses a file the lock
    # has no hash for, so the wheelhouse only ever holds the files the lock was resolved to.
    missing_names = {pin.split("==", 1)[0] for pin in missing}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(requirements_text(lock, missing_names))
        needed = handle.name
    # pip writes into a staging directory; each finished file is then renamed into the wheelhouse, so a
    # provisioning run reading it at the same time (another host, another play) never sees half a wheel.
    staging = tempfile.mkdtemp(prefix=".incoming-", dir=p["dest"])
    base[base.index(None)] = staging
    try:
        runs = []
        if missing:
            runs.append([*base, "--require-hashes", "--no-deps", "-r", needed])
        if extras:
            runs.append([*base, "--no-deps", *extras])
        for argv in runs:
            proc = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, check=False
            )
            out = proc.stdout.decode("utf-8", "replace")
            if proc.returncode != 0:
                mismatch = hash_mismatch(out)
                where = "the index {}".format(redact_url(p["index_url"]) or "(pip's default)")
                module.fail_json(
                    msg="building the wheelhouse {} for environment '{}' failed: {}".format(
                        p["dest"],
                        p["name"],
                        hash_mismatch_message(mismatch, p["name"], where, False) if mismatch else tail(out),
                    ),
                    missing=missing,
                )
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(p["dest"], name))
    finally:
        os.unlink(needed)
        shutil.rmtree(staging, ignore_errors=True)
    if p["extra_packages"]:
        with open(extras_marker, "w") as handle:
            handle.write(extras_text)
    after = os.listdir(p["dest"])
    still = wheelhouse_missing(lock["pins"], after)
    if still:
        module.fail_json(
            msg="pip download left the wheelhouse {} without {} (environment '{}')".format(
                p["dest"], ", ".join(still[:10]), p["name"]
            ),
            missing=still,
        )
    module.exit_json(
        changed=True, missing=missing, downloaded=sorted(set(after) - set(existing)), dest=p["dest"]
    )


if __name__ == "__main__":
    sys.exit(main())
