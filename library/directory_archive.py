#!/usr/bin/python
"""Pack a directory into a byte-for-byte reproducible tar (for shipping wheelhouses to hosts)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: directory_archive
short_description: Pack a directory into a reproducible tar, rewritten only when its content changed
description:
  - Runs on the controller. Files are added in sorted order with fixed owner, mode and mtime, and
    C(__pycache__) and C(*.pyc) are left out, so the same content always gives the same bytes and the
    copy to the host that follows is changed only when a file changed. One file to copy instead of one
    module round trip per file (a wheelhouse has hundreds).
  - A listing of names, sizes and modification times is kept next to O(dest); when it matches, the
    directory is not read again (a serving wheelhouse is several GB).
options:
  src:
    description: Directory to pack (its name becomes the top-level directory in the archive).
    type: path
    required: true
  dest:
    description: The archive to write.
    type: path
    required: true
  compress:
    description: gzip the archive; leave it off for wheels, which are compressed already.
    type: bool
    default: true
author: regen
"""

EXAMPLES = r"""
- name: Pack the demo wheelhouse
  directory_archive:
    src: "{{ regen_root }}/.cache/wheelhouse/demo"
    dest: "{{ regen_root }}/.cache/bundles/wheelhouse-demo.tar"
    compress: false
  delegate_to: localhost
"""

RETURN = r"""
files:
  description: Number of files in the archive.
  type: int
  returned: always
dest:
  description: The archive file (O(dest)).
  type: str
  returned: always
"""

import gzip
import hashlib
import json
import os
import tarfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_files import file_sha256, tree_files


def entries(src):
    """Sorted (archive name, path, size, mtime) of the files to pack (half-written `.tmp-*` files out)."""
    top = os.path.basename(os.path.normpath(src))
    found = []
    for relative in tree_files(src, skip_file=lambda name: name.startswith(".tmp-")):
        path = os.path.join(src, relative)
        stat = os.stat(path)
        found.append((os.path.join(top, relative), path, stat.st_size, int(stat.st_mtime)))
    return found


def write_archive(files, target, compress):
    """Reproducible tar (fixed mtime/owner/mode, gzip without a timestamp) written to `target`."""
    with open(target, "wb") as raw:
        stream = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) if compress else raw
        try:
            with tarfile.open(fileobj=stream, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                for arcname, path, size, _ in files:
                    info = tarfile.TarInfo(arcname)
                    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
                    with open(path, "rb") as handle:
                        tar.addfile(info, handle)
        finally:
            if compress:
                stream.close()


def main():
    module = AnsibleModule(
        argument_spec=dict(
            src=dict(type="path", required=True),
            dest=dict(type="path", required=True),
            compress=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    src, dest = module.params["src"], module.params["dest"]
    if not os.path.isdir(src):
        module.fail_json(msg=f"{src} is not a directory")
    files = entries(src)
    listing = hashlib.sha256(json.dumps([f[:1] + f[2:] for f in files]).encode()).hexdigest()
    sidecar = dest + ".listing"
    if os.path.exists(dest) and os.path.exists(sidecar):
        with open(sidecar) as handle:
            if handle.read().strip() == listing:
                module.exit_json(changed=False, files=len(files), dest=dest)
    if module.check_mode:
        module.exit_json(changed=True, files=len(files), dest=dest)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = dest + ".tmp"
    write_archive(files, tmp, module.params["compress"])
    changed = not os.path.exists(dest) or file_sha256(tmp) != file_sha256(dest)
    if changed:
        os.replace(tmp, dest)
    else:
        os.unlink(tmp)
    with open(sidecar, "w") as handle:
        handle.write(listing + "\n")
    # Only the archive's bytes count as a change (a touched but identical file does not).
    module.exit_json(changed=changed, files=len(files), dest=dest)


if __name__ == "__main__":
    main()
