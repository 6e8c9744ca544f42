"""Bringing a model's files to a host and proving they are the right bytes (the model_weights role).

Every source ends in the same state: the files in the model directory, each checked against a checksum
written where the files came from, and a marker (`.regen-weights.json`) naming the source and each file's
size. A run that finds the marker matching its source and every file at its size is done (changed=0,
nothing contacted); anything else fetches what is missing (finished files are kept, a partial one
restarts or resumes) and verifies again.

- hub: `hf download` writes the hub's file listing of the pinned commit to
  `.cache/huggingface/trees/<commit>.json` in the local dir: the sha256 of every LFS file (the weights) and
  the git blob id of every other file. Verification hashes the files against it.
- mirror / bastion: a sha256 manifest (`.regen-sha256.json`) is written beside the files at the source once
  (or provided by whoever filled the mirror); the copy is checked against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

MARKER = ".regen-weights.json"
SOURCE_MANIFEST = ".regen-sha256.json"
HF_CACHE = os.path.join(".cache", "huggingface")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 8 * 1024 * 1024


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def git_blob_id_file(path):
    digest = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def metadata_first(names):
    """Config, tokenizer and index files before the weights: introspection can start while shards arrive."""
    return sorted(names, key=lambda n: (n.endswith(WEIGHT_SUFFIXES), n))


def list_files(root):
    """Relative paths of the model's files under root (regen's and hf's bookkeeping left out)."""
    found = []
    for base, dirs, files in os.walk(root):
        rel = os.path.relpath(base, root)
        dirs[:] = [d for d in dirs if not (rel == "." and d == ".cache")]
        for name in files:
            path = os.path.normpath(os.path.join(rel, name))
            if path in (MARKER, SOURCE_MANIFEST) or name.endswith((".partial", ".incomplete")):
                continue
            found.append(path)
    return sorted(found)


def hub_expected(local_dir, commit):
    """{file: {"size", "sha256" or "git_blob"}} from the hub listing hf wrote for `commit` (None: absent)."""
    path = os.path.join(local_dir, HF_CACHE, "trees", f"{commit}.json")
    try:
        with open(path, encoding="utf-8") as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError):
        return None
    expected = {}
    for name, entry in files.items():
        if entry.get("lfs_sha256"):
            expected[name] = {"size": entry.get("lfs_size", entry.get("size")), "sha256": entry["lfs_sha256"]}
        else:
            expected[name] = {"size": entry.get("size"), "git_blob": entry.get("blob_id")}
    return expected


def check_file(path, want):
    """None when the file at path matches `want` ({size, sha256|git_blob}), else why not."""
    if not os.path.isfile(path):
        return "missing"
    size = os.path.getsize(path)
    if want.get("size") is not None and size != int(want["size"]):
        return f"size {size}, expected {want['size']}"
    if want.get("sha256"):
        got = sha256_file(path)
        if got != want["sha256"]:
            return f"sha256 {got}, expected {want['sha256']}"
    elif want.get("git_blob"):
        got = git_blob_id_file(path)
        if got != want["git_blob"]:
            return f"git blob {got}, expected {want['git_blob']}"
    return None


def verify(dest, expected):
    """(missing files, corrupted [{file, reason}]) of dest against expected."""
    missing, corrupted = [], []
    for name in metadata_first(expected):
        reason = check_file(os.path.join(dest, name), expected[name])
        if reason == "missing":
            missing.append(name)
        elif reason:
            corrupted.append({"file": name, "reason": reason})
    return missing, corrupted


def drop_hub_file(dest, name):
    """Remove a refused file and hf's record of it, so the next `hf download` fetches it again."""
    for path in (
        os.path.join(dest, name),
        os.path.join(dest, HF_CACHE, "download", name + ".metadata"),
    ):
        if os.path.exists(path):
            os.remove(path)


def marker_document(source, expected):
    return {
        "source": source,
        "files": {name: {"size": int(want["size"])} for name, want in sorted(expected.items())},
        "total_bytes": sum(int(want["size"]) for want in expected.values()),
    }


def read_json(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def write_json_atomic(path, document):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


def quick_check(dest, source):
    """(verified, reason): the marker names this source and every file it lists has its size."""
    marker = read_json(os.path.join(dest, MARKER))
    if marker is None:
        return False, "no verified copy yet (no marker)"
    if marker.get("source") != source:
        return False, f"the copy came from {marker.get('source')}, not {source}"
    for name, entry in (marker.get("files") or {}).items():
        path = os.path.join(dest, name)
        if not os.path.isfile(path) or os.path.getsize(path) != entry.get("size"):
            return False, f"{name} is missing or changed size since it was verified"
    return True, f"{len(marker.get('files') or {})} files verified from {source}"


def disk_need(index, present_sizes, margin_bytes):
    """(need_bytes or None, reason): what fetching the rest of the weights takes, from the index's
    metadata.total_size minus the shards already present, plus the margin."""
    total = ((index or {}).get("metadata") or {}).get("total_size")
    if total is None:
        return None, "the weight index has no metadata.total_size (or there is no index)"
    shards = set((index.get("weight_map") or {}).values())
    have = sum(size for name, size in present_sizes.items() if name in shards)
    need = max(0, int(total) - have) + int(margin_bytes)
    return need, f"index total_size {int(total)} bytes, {have} present, margin {int(margin_bytes)}"


def manifest_disk_need(manifest, present_sizes, margin_bytes):
    """(need_bytes, reason) from a source manifest ({file: {size, ...}}): the files not yet present at their
    size, plus the margin."""
    total = sum(int(entry["size"]) for entry in manifest.values())
    have = sum(int(e["size"]) for name, e in manifest.items() if present_sizes.get(name) == int(e["size"]))
    need = total - have + int(margin_bytes)
    margin = int(margin_bytes)
    return (
        need,
        f"the source manifest's {len(manifest)} files: {total} bytes, {have} present, margin {margin}",
    )


def free_bytes(path):
    while not os.path.exists(path):
        path = os.path.dirname(path)
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def source_manifest(source_dir, write=True):
    """The sha256 manifest beside the files at the source ({file: {size, sha256}}): read, or computed
    (and written there when `write`). Returns (manifest, written)."""
    path = os.path.join(source_dir, SOURCE_MANIFEST)
    existing = read_json(path)
    if existing and isinstance(existing.get("files"), dict):
        return existing["files"], False
    files = {}
    for name in list_files(source_dir):
        full = os.path.join(source_dir, name)
        files[name] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
    if write:
        write_json_atomic(path, {"files": files})
    return files, write


def copy_file(source, dest):
    """Copy through `<dest>.partial` then rename: an interrupted copy leaves only the partial, which the
    next run starts again (whole files are never half-written under their own name)."""
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    partial = dest + ".partial"
    with open(source, "rb") as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(partial, dest)
