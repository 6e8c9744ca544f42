#!/usr/bin/python
"""Ansible module: check, copy and verify a model's files in a model directory (logic in regen_weights)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_weights
short_description: Check, copy from a mirror, and verify a model's files against the checksums of their source
description:
  - C(state=check) reads the marker a verified copy leaves (C(.regen-weights.json)) and says whether the
    directory holds every file of O(source) at its verified size; nothing is hashed or contacted.
  - C(state=disk) fails when the free space under O(dest) is smaller than what is still to fetch (the sizes
    in a source manifest already in O(dest), else the weight index's C(metadata.total_size), else the hub's
    listing, minus what is present) plus O(margin_bytes).
  - C(state=verify_hub) hashes every file against the hub listing C(hf download) wrote for O(commit)
    (sha256 of LFS files, git blob id of the others); a mismatching file is removed with hf's record of it
    (so the next run fetches it again) and the task fails naming it; all good writes the marker.
  - C(state=mirror) copies from O(mirror_path) on the same host; the sha256 manifest there
    (C(.regen-sha256.json)) is read, or computed and written there; config and tokenizer files first; each
    file through C(<name>.partial) and a rename; each copy checked against the manifest (a source file that
    does not match its manifest is refused).
  - C(state=manifest) writes the sha256 manifest beside the files in O(dest) when it is absent (the
    bastion's side of the bastion path).
  - C(state=verify_manifest) checks the files against the manifest that came with them (on the bastion path,
    synchronize brings C(.regen-sha256.json) along); a mismatching file is removed (so the next run fetches it
    again) and the task fails naming it.
version_added: "0.1.0"
author: regen maintainers
options:
  state:
    description: What to do.
    type: str
    required: true
    choices: [check, disk, verify_hub, mirror, manifest, verify_manifest]
  dest:
    description: The model directory on this host.
    type: path
    required: true
  source:
    description: Where the files come from, as recorded in the marker (e.g. C(hub:org/model@<commit>)).
    type: str
    required: true
  commit:
    description: The pinned commit (state=verify_hub, state=disk for the hub).
    type: str
  mirror_path:
    description: The source directory on this host (state=mirror).
    type: path
  write_source_manifest:
    description: With state=mirror, write the computed manifest beside the source files when it is absent.
    type: bool
    default: true
  margin_bytes:
    description: Free space to keep beyond the files (state=disk, state=mirror).
    type: int
    default: 0
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Is the model here and verified
  model_weights:
    state: check
    dest: /root/models/Kimi-K2.6
    source: "hub:moonshotai/Kimi-K2.6@0123456789abcdef0123456789abcdef01234567"
  register: _weights

- name: Copy from an NFS mirror
  model_weights:
    state: mirror
    dest: /root/models/Kimi-K2.6
    source: "mirror:/mnt/models/Kimi-K2.6"
    mirror_path: /mnt/models/Kimi-K2.6
    margin_bytes: 21474836480
"""

RETURN = r"""
verified:
  description: Whether the directory holds a verified copy of the source now.
  returned: always
  type: bool
reason:
  description: Why (or why not), in one line.
  returned: always
  type: str
files:
  description: Number of files of the model.
  returned: when known
  type: int
need_bytes:
  description: Bytes still to fetch plus the margin (state=disk, state=mirror).
  returned: when known
  type: int
free_bytes:
  description: Free bytes under dest (state=disk, state=mirror).
  returned: when known
  type: int
copied:
  description: Files copied (state=mirror).
  returned: when state is mirror
  type: list
  elements: str
corrupted:
  description: Files refused, each C({file, reason}).
  returned: always
  type: list
  elements: dict
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_weights import (
    MARKER,
    SOURCE_MANIFEST,
    check_file,
    copy_file,
    disk_need,
    drop_hub_file,
    free_bytes,
    hub_expected,
    list_files,
    manifest_disk_need,
    marker_document,
    metadata_first,
    quick_check,
    read_json,
    source_manifest,
    verify,
    write_json_atomic,
)

GIB = 1024**3
STATES = ["check", "disk", "verify_hub", "mirror", "manifest", "verify_manifest"]


def _present_sizes(dest):
    if not os.path.isdir(dest):
        return {}
    return {name: os.path.getsize(os.path.join(dest, name)) for name in list_files(dest)}


def _finish(module, dest, source, expected, result):
    """Write the marker of a verified copy (a change), or say it would."""
    marker = marker_document(source, expected)
    if read_json(os.path.join(dest, MARKER)) != marker:
        result["changed"] = True
        if not module.check_mode:
            write_json_atomic(os.path.join(dest, MARKER), marker)
    result.update(verified=True, files=len(expected), reason=f"{len(expected)} files verified from {source}")
    module.exit_json(**result)


def _space(module, dest, need, why, result):
    free = free_bytes(dest)
    result.update(need_bytes=need, free_bytes=free)
    if need is not None and need > free:
        module.fail_json(
            msg=f"not enough disk under {dest}: {need / GIB:.1f} GiB needed ({why}), "
            f"{free / GIB:.1f} GiB free; "
            "free space there, or point regen_model_path (model_weights_dest) at a larger disk, or lower "
            "model_weights_margin_gib",
            **result,
        )


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", required=True, choices=STATES),
            dest=dict(type="path", required=True),
            source=dict(type="str", required=True),
            commit=dict(type="str"),
            mirror_path=dict(type="path"),
            write_source_manifest=dict(type="bool", default=True),
            margin_bytes=dict(type="int", default=0),
        ),
        required_if=[
            ("state", "verify_hub", ["commit"]),
            ("state", "mirror", ["mirror_path"]),
        ],
        supports_check_mode=True,
    )
    p = module.params
    dest, source, state = p["dest"], p["source"], p["state"]
    result = {"changed": False, "verified": False, "corrupted": []}

    if state == "check":
        verified, reason = quick_check(dest, source)
        module.exit_json(**dict(result, verified=verified, reason=reason))

    if state == "disk":
        index = read_json(os.path.join(dest, "model.safetensors.index.json"))
        present = _present_sizes(dest)
        need, why = disk_need(index, present, p["margin_bytes"])
        # The bastion's manifest, pushed ahead of the files, lists every file with its size.
        manifest = (read_json(os.path.join(dest, SOURCE_MANIFEST)) or {}).get("files")
        if manifest:
            need, why = manifest_disk_need(manifest, present, p["margin_bytes"])
        if need is None and p["commit"]:
            expected = hub_expected(dest, p["commit"]) or {}
            if expected:
                have = sum(present.get(n, 0) for n in expected if present.get(n) == expected[n]["size"])
                need = sum(int(w["size"]) for w in expected.values()) - have + p["margin_bytes"]
                why = f"the hub's listing of {len(expected)} files, {have} bytes present"
        if need is None and module.check_mode:
            # Nothing was fetched in check mode, so the index that says how much is still to come is not here.
            module.exit_json(
                **dict(result, reason=f"check mode: the disk is checked once the index is here ({why})")
            )
        if need is None:
            module.fail_json(msg=f"cannot tell how much disk the model needs: {why}", **result)
        _space(module, dest, need, why, result)
        module.exit_json(**dict(result, reason=why))

    if state == "verify_hub":
        expected = hub_expected(dest, p["commit"])
        if not expected and module.check_mode:
            module.exit_json(
                **dict(result, changed=True, reason="check mode: would verify the files once fetched")
            )
        if not expected:
            module.fail_json(
                msg=f"no hub listing for commit {p['commit']} under {dest}/.cache/huggingface/trees: "
                "`hf download --revision <commit> --local-dir` did not run to completion",
                **result,
            )
        missing, corrupted = verify(dest, expected)
        result["corrupted"] = corrupted
        if missing and not corrupted and module.check_mode:
            module.exit_json(
                **dict(result, changed=True, reason=f"check mode: {len(missing)} files not fetched yet")
            )
        if corrupted and not module.check_mode:
            for entry in corrupted:
                drop_hub_file(dest, entry["file"])
        if missing or corrupted:
            module.fail_json(
                msg="refused: {}{}; {} removed, run again to fetch {} again".format(
                    "; ".join(f"{c['file']}: {c['reason']}" for c in corrupted),
                    (" missing: " + ", ".join(missing)) if missing else "",
                    "the refused files are" if corrupted else "nothing",
                    "them" if corrupted or missing else "nothing",
                ),
                **result,
            )
        _finish(module, dest, source, expected, result)

    if state == "manifest":
        if os.path.isfile(os.path.join(dest, SOURCE_MANIFEST)):
            module.exit_json(**dict(result, reason=f"{dest}/{SOURCE_MANIFEST} exists"))
        if module.check_mode:
            module.exit_json(**dict(result, changed=True, reason=f"would write {dest}/{SOURCE_MANIFEST}"))
        manifest, _ = source_manifest(dest, write=True)
        module.exit_json(**dict(result, changed=True, files=len(manifest), reason=f"wrote {SOURCE_MANIFEST}"))

    if state == "verify_manifest":
        manifest = (read_json(os.path.join(dest, SOURCE_MANIFEST)) or {}).get("files")
        if not manifest and module.check_mode:
            module.exit_json(
                **dict(result, changed=True, reason="check mode: would verify the files once pushed")
            )
        if not manifest:
            module.fail_json(msg=f"{dest}/{SOURCE_MANIFEST} did not come with the files", **result)
        missing, corrupted = verify(dest, manifest)
        result["corrupted"] = corrupted
        if missing and not corrupted and module.check_mode:
            module.exit_json(
                **dict(result, changed=True, reason=f"check mode: {len(missing)} files not pushed yet")
            )
        if corrupted and not module.check_mode:
            # rsync skips a file whose size and time match, so a rotten one would be refused on every run.
            for entry in corrupted:
                os.remove(os.path.join(dest, entry["file"]))
        if missing or corrupted:
            module.fail_json(
                msg="refused: "
                + "; ".join(
                    [f"{c['file']}: {c['reason']}" for c in corrupted] + [f"{m}: missing" for m in missing]
                )
                + (
                    "; the refused files are removed, run again to fetch them again (refused again: the "
                    "source's own file does not match its manifest, repair it there)"
                    if corrupted
                    else ""
                ),
                **result,
            )
        _finish(module, dest, source, manifest, result)

    # state == mirror
    mirror = p["mirror_path"]
    if not os.path.isdir(mirror):
        module.fail_json(msg=f"model_weights_mirror_path {mirror} is not a directory on this host", **result)
    can_write = p["write_source_manifest"] and os.access(mirror, os.W_OK) and not module.check_mode
    manifest, written = source_manifest(mirror, write=can_write)
    todo = []
    for name in metadata_first(manifest):
        target = os.path.join(dest, name)
        # check_file compares the size first and hashes only a file of the right size.
        if check_file(target, manifest[name]):
            todo.append(name)
    need = sum(int(manifest[n]["size"]) for n in todo) + p["margin_bytes"]
    _space(module, dest, need, f"{len(todo)} of {len(manifest)} files to copy", result)
    result["copied"] = todo
    if module.check_mode:
        result["changed"] = bool(todo) or written
        module.exit_json(**dict(result, reason=f"would copy {len(todo)} files"))
    for name in todo:
        copy_file(os.path.join(mirror, name), os.path.join(dest, name))
        reason = check_file(os.path.join(dest, name), manifest[name])
        if reason:
            os.remove(os.path.join(dest, name))
            result["corrupted"].append({"file": name, "reason": reason})
            module.fail_json(
                msg=f"refused {name} from {mirror}: {reason} (the mirror's file does not match its manifest "
                f"{mirror}/{SOURCE_MANIFEST}); repair the mirror",
                **result,
            )
    result["changed"] = bool(todo)
    _finish(module, dest, source, manifest, result)


if __name__ == "__main__":
    main()
