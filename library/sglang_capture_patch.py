#!/usr/bin/python
"""Ansible module: apply SpecForge's spec-capture patch to the SGLang installed in a venv, exactly once."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_capture_patch
short_description: Apply SpecForge's spec-capture patch to an installed SGLang (idempotent, content-aware)
description:
  - Finds the SGLang package the given interpreter imports and its version, picks the patch of the SpecForge
    source checkout that matches it (C(patches/sglang/v<version>/spec-capture.patch), or O(target)), and
    applies it with C(patch -p2) in the package's C(site-packages) (the patch's paths are
    C(a/python/sglang/...)).
  - Records the applied patch text inside the package, so a second run changes nothing, a revised patch is
    reversed with the text that went in before the new one is applied, and a tree patched without a record
    is adopted only when the patch reverses cleanly.
  - Refuses, naming the fix, when the checkout has no patch for the installed release, when the source is
    not a SpecForge checkout, or when the installed files match neither the patched nor the unpatched release.
  - Check mode runs only the dry runs and reports what would change.
version_added: "0.1.0"
author: regen maintainers
options:
  python:
    description: Interpreter of the capture venv (the one whose sglang is patched).
    type: path
    required: true
  specforge_source:
    description: A SpecForge source checkout (it holds C(patches/sglang/)).
    type: path
    required: true
  target:
    description: Patch target (a directory of C(patches/sglang/)); null picks C(v<installed version>).
    type: str
  state:
    description: C(present) applies the patch, C(absent) reverses the recorded one.
    type: str
    choices: [present, absent]
    default: present
attributes:
  check_mode:
    support: full
requirements:
  - the C(patch) program on the host (Debian package C(patch))
"""

EXAMPLES = r"""
- name: Patch the capture venv's sglang for spec capture
  sglang_capture_patch:
    python: /root/venv_capture/bin/python
    specforge_source: /root/src/SpecForge
"""

RETURN = r"""
target:
  description: The patch target that was chosen.
  returned: when a patch was chosen
  type: str
  sample: v0.5.14
sglang_version:
  description: The installed SGLang release.
  returned: always
  type: str
sglang_dir:
  description: The installed package directory.
  returned: always
  type: str
patch_sha256:
  description: Digest of the patch text applied (or that would be).
  returned: when a patch was chosen
  type: str
action:
  description: keep, replace, apply, adopt, reverse or none.
  returned: always
  type: str
reason:
  description: Why, in one line.
  returned: always
  type: str
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_capture_patch import (
    PATCH_NAME,
    RECORD_NAME,
    CapturePatchError,
    available_targets,
    choose_target,
    plan_action,
)
from ansible.module_utils.regen_files import sha256_bytes

_PROBE = "import json, os, sglang; print(json.dumps([os.path.dirname(sglang.__file__), sglang.__version__]))"


def _read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def main():
    module = AnsibleModule(
        argument_spec={
            "python": {"type": "path", "required": True},
            "specforge_source": {"type": "path", "required": True},
            "target": {"type": "str"},
            "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
        },
        supports_check_mode=True,
    )
    p = module.params
    rc, out, err = module.run_command([p["python"], "-c", _PROBE])
    if rc != 0:
        tail = (err or out).strip().splitlines()[-1:] or ["no output"]
        module.fail_json(
            msg=f"sglang does not import with {p['python']} ({tail[0]}): build the capture venv first"
        )
    sglang_dir, version = json.loads(out.strip().splitlines()[-1])
    site = os.path.dirname(sglang_dir)
    record_path = os.path.join(sglang_dir, RECORD_NAME)
    recorded = _read(record_path)
    patch_bin = module.get_bin_path("patch", required=False)
    if patch_bin is None:
        module.fail_json(msg="the `patch` program is missing on this host: install the Debian package patch")

    def run_patch(text, *flags):
        argv = [patch_bin, "-p2", "--batch", "-d", site, *flags]
        return module.run_command(argv, data=text, binary_data=True)

    result = {"sglang_version": version, "sglang_dir": sglang_dir, "changed": False}
    if p["state"] == "absent":
        if recorded is None:
            module.exit_json(action="none", reason="no spec-capture patch is recorded", **result)
        if not module.check_mode:
            rc, out, err = run_patch(recorded, "--reverse")
            if rc != 0:
                module.fail_json(msg=f"reversing the recorded patch failed: {(out + err).strip()[-500:]}")
            os.unlink(record_path)
        result["changed"] = True
        module.exit_json(action="reverse", reason="the recorded patch is reversed", **result)

    try:
        target = choose_target(
            available_targets(p["specforge_source"]), version, p["target"], source=p["specforge_source"]
        )
    except CapturePatchError as exc:
        module.fail_json(msg=str(exc), **result)
    text = _read(os.path.join(p["specforge_source"], "patches", "sglang", target, PATCH_NAME))
    forward = reverse = False
    if recorded is None:
        forward = run_patch(text, "--dry-run", "--forward")[0] == 0
        reverse = not forward and run_patch(text, "--dry-run", "--reverse")[0] == 0
    action, reason = plan_action(text, recorded, forward, reverse)
    result.update(target=target, patch_sha256=sha256_bytes(text), action=action, reason=reason)
    if action == "refuse":
        module.fail_json(msg=f"cannot apply the {target} spec-capture patch to sglang {version}: {reason}")
    if action == "keep":
        module.exit_json(**result)
    if not module.check_mode:
        if action == "replace":
            rc, out, err = run_patch(recorded, "--reverse")
            if rc != 0:
                module.fail_json(msg=f"reversing the earlier patch failed: {(out + err).strip()[-500:]}")
        if action in ("replace", "apply"):
            rc, out, err = run_patch(text, "--forward")
            if rc != 0:
                module.fail_json(msg=f"applying the {target} patch failed: {(out + err).strip()[-500:]}")
        with open(record_path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(record_path + ".tmp", record_path)
    result["changed"] = True
    module.exit_json(**result)


if __name__ == "__main__":
    main()
