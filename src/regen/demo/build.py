"""Build the demo model directory: ``python -m regen.demo.build --output DIR [--seed N] [--cache-dir DIR]
[--pretrain-steps N] [--check] [--json]``.

The directory looks like the real Kimi K2.6 checkpoint at tiny scale (see ``regen.demo.spec``): nested
config.json with remote code, a tiktoken tokenizer that needs ``trust_remote_code``, a chat template with
Kimi's ``thinking`` switch, and sharded safetensors with weights pre-trained for a few hundred steps on
the demo corpus (``regen.demo.pretrain``; under a minute on 2 CPU cores), so a drafter has something to
learn.

Idempotent: the directory records a hash of everything the build depends on (builder version, spec and
seed, the sources of the builder, the model-dir files and the corpus, and the versions of the libraries
that shape the bytes) and the sha256 of every file it wrote. When both still match, nothing is done and
``changed`` is false. ``--check`` only reports whether a build would change anything. Writes are atomic:
the model is built in a temporary directory next to DIR and renamed into place, so a crash leaves the old
model, or none, never half of one. A lock next to DIR serialises concurrent builds of the same DIR.

With ``--cache-dir``, the model is built once per input hash under ``CACHE/<hash>/regen-demo-kimi`` and DIR
becomes a verified copy of it: every later build with the same inputs (another DIR, another test, the next
pipeline run after ``rm -rf .work``) copies instead of pre-training again.

Exit codes: 0 success (also when nothing changed), 1 the build failed (message on stderr, or in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from regen.demo import bpe
from regen.demo import spec as spec_module
from regen.demo.spec import DemoSpec
from regen.fsio import fsync_dir
from regen.module_utils.regen_files import sha256_bytes

BUILDER = "regen.demo.build"
# Bump when the builder's output changes in a way its sources do not show (they are hashed anyway).
BUILDER_VERSION = 2
# The directory name of a model inside the cache (CACHE/<input hash>/NAME).
CACHE_MODEL_NAME = "regen-demo-kimi"
MANIFEST = "regen_demo_manifest.json"
# Files copied verbatim from regen/demo/model_files into the model directory.
MODEL_FILES = (
    "configuration_kimi_k25_demo.py",
    "modeling_kimi_k25_demo.py",
    "tokenization_kimi.py",
    "chat_template.jinja",
)
# Libraries whose version can change the bytes written (BPE training, random draws, pre-training with
# transformers' DeepSeek-V3 and tiktoken's encoding, file format).
BYTE_SHAPING_LIBRARIES = ("tokenizers", "torch", "safetensors", "transformers", "tiktoken", "jinja2")


class DemoBuildError(Exception):
    """A build problem with a message that says what to do."""


@dataclass
class BuildResult:
    changed: bool
    path: str
    inputs_sha256: str
    seed: int
    vocab_size: int
    num_bpe_ranks: int
    check_mode: bool = False
    pretrain_steps: int = 0
    cached_from: str | None = None
    files: list[str] = field(default_factory=list)
    msg: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "path": self.path,
            "check_mode": self.check_mode,
            "inputs_sha256": self.inputs_sha256,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "num_bpe_ranks": self.num_bpe_ranks,
            "pretrain_steps": self.pretrain_steps,
            "cached_from": self.cached_from,
            "files": self.files,
            "msg": self.msg,
        }


def _library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def _source_files() -> dict[str, bytes]:
    """Everything under regen/demo the output depends on: builder modules, model-dir files, corpus."""
    package = resources.files("regen.demo")
    sources = {}
    for entry in sorted(package.iterdir(), key=lambda item: item.name):
        if entry.is_file() and entry.name.endswith((".py", ".txt")):
            sources[entry.name] = entry.read_bytes()
    model_files = package.joinpath("model_files")
    for name in MODEL_FILES:
        sources[f"model_files/{name}"] = model_files.joinpath(name).read_bytes()
    return sources


def inputs_digest(spec: DemoSpec) -> str:
    """Hash of every input of the build; equal digests mean byte-identical model directories."""
    inputs = {
        "builder": BUILDER,
        "builder_version": BUILDER_VERSION,
        "spec": spec.as_dict(),
        "sources": {name: sha256_bytes(data) for name, data in _source_files().items()},
        "libraries": {name: _library_version(name) for name in BYTE_SHAPING_LIBRARIES},
    }
    return sha256_bytes(json.dumps(inputs, sort_keys=True).encode("utf-8"))


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("builder") == BUILDER else None


def is_up_to_date(directory: Path, digest: str) -> bool:
    """The directory was built from these inputs and every file it recorded is still intact."""
    manifest = _read_manifest(directory)
    if manifest is None or manifest.get("inputs_sha256") != digest:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, expected in files.items():
        try:
            if sha256_bytes((directory / name).read_bytes()) != expected:
                return False
        except OSError:
            return False
    return True


def _refuse_foreign_directory(directory: Path) -> None:
    if not directory.exists():
        return
    if not directory.is_dir():
        raise DemoBuildError(f"{directory} exists and is not a directory; choose another --output")
    if any(directory.iterdir()) and _read_manifest(directory) is None:
        raise DemoBuildError(
            f"{directory} is not empty and was not built by {BUILDER} (no {MANIFEST}); "
            "refusing to replace it. Remove it, or choose another --output"
        )


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def render_files(spec: DemoSpec) -> dict[str, bytes]:
    """Every file of the model directory except the weights, as bytes (pure: no I/O outside the package)."""
    from regen.demo.model_files import tokenization_kimi

    ranks = bpe.train_ranks(bpe.training_texts(), spec.num_bpe_ranks, tokenization_kimi.PAT_STR)
    model_files = resources.files("regen.demo").joinpath("model_files")
    files = {name: model_files.joinpath(name).read_bytes() for name in MODEL_FILES}
    files["config.json"] = _json_bytes(spec_module.model_config(spec))
    files["generation_config.json"] = _json_bytes(spec_module.generation_config(spec))
    files["tokenizer_config.json"] = _json_bytes(spec_module.tokenizer_config(spec))
    files["tiktoken.model"] = bpe.dump_tiktoken(ranks)
    files["README.md"] = _readme(spec).encode("utf-8")
    return files


def _readme(spec: DemoSpec) -> str:
    weights_line = (
        f"The weights were pre-trained for {spec.pretrain_steps} steps on the regen demo corpus (about\n"
        "12 KB of prose, dialogue and code): the model strings together fragments of that corpus,\n"
        "fluent-looking and mostly wrong, and cannot answer questions. That is enough for a drafter to\n"
        "learn its patterns, and every stage meets the real checkpoint's layout and loading rules:"
        if spec.pretrain_steps
        else "The weights are random: the model produces token salad, but every stage meets the real\n"
        "checkpoint's layout and loading rules:"
    )
    return (
        "# regen demo model (Kimi K2.6 layout, tiny"
        + (", pre-trained on the demo corpus)\n\n" if spec.pretrain_steps else ", random weights)\n\n")
        + f"Built by `python -m {BUILDER}` (seed {spec.seed}); do not edit, rebuild instead.\n"
        "Every file here, code included, was written by the regen project.\n"
        f"{weights_line} config nested under `text_config` (DeepSeek-V3 MLA + MoE),\n"
        "remote code, a tiktoken tokenizer that needs `trust_remote_code=True`, special tokens above the\n"
        "BPE ranks, and a chat template whose thinking switch is the variable `thinking`.\n\n"
        f"- vocabulary: {spec.num_bpe_ranks} BPE ranks + 256 special ids = {spec.vocab_size}\n"
        f"- layers: {spec.num_hidden_layers} ({spec.first_k_dense_replace} dense), "
        f"hidden {spec.hidden_size}, {spec.n_routed_experts} routed experts "
        f"(top-{spec.num_experts_per_tok}) + {spec.n_shared_experts} shared\n"
    )


def _write_tree(spec: DemoSpec, digest: str, target: Path, file_mode: int) -> list[str]:
    from regen.demo import weights

    files = render_files(spec)
    for name, data in files.items():
        (target / name).write_bytes(data)
    names = sorted([*files, *weights.write_checkpoint(spec, target)])
    manifest = {
        "builder": BUILDER,
        "builder_version": BUILDER_VERSION,
        "inputs_sha256": digest,
        "spec": spec.as_dict(),
        "files": {name: sha256_bytes((target / name).read_bytes()) for name in names},
    }
    (target / MANIFEST).write_bytes(_json_bytes(manifest))
    _seal(target, [*names, MANIFEST], file_mode)
    return [*names, MANIFEST]


def _seal(target: Path, names: list[str], file_mode: int) -> None:
    for name in names:
        # safetensors writes owner-only files; the model directory is shared data like any checkpoint.
        os.chmod(target / name, file_mode)
        with open(target / name, "rb") as handle:
            os.fsync(handle.fileno())


def cache_entry(cache_dir: Path, spec: DemoSpec) -> Path:
    """Where the cache keeps the model built from ``spec``'s inputs."""
    return Path(cache_dir).expanduser().absolute() / inputs_digest(spec)[:16] / CACHE_MODEL_NAME


def _copy_tree(source: Path, digest: str, target: Path, file_mode: int) -> list[str]:
    """Copy a cached model into ``target``, checking every file against the cache's own manifest."""
    manifest = _read_manifest(source)
    if manifest is None or manifest.get("inputs_sha256") != digest:
        raise DemoBuildError(f"the cached model {source} does not match this build's inputs; remove it")
    names = sorted(manifest["files"])
    for name in [*names, MANIFEST]:
        shutil.copyfile(source / name, target / name)
    for name in names:
        if sha256_bytes((target / name).read_bytes()) != manifest["files"][name]:
            raise DemoBuildError(f"{source / name} changed while it was copied; build again")
    _seal(target, [*names, MANIFEST], file_mode)
    return [*names, MANIFEST]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    lock_path = directory.parent / f".{directory.name}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(directory: Path) -> None:
    """Temporary trees of builds that crashed earlier (only ever ours: they carry our prefix)."""
    for pattern in (f".{directory.name}.tmp-*", f".{directory.name}.old-*"):
        for leftover in directory.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def build(
    output: Path, spec: DemoSpec | None = None, check: bool = False, cache_dir: Path | None = None
) -> BuildResult:
    """Make ``output`` the demo model for ``spec``; with ``check``, only say whether that would change it.

    With ``cache_dir``, the model is built (once) as ``cache_entry(cache_dir, spec)`` and copied from there.
    """
    spec = spec or DemoSpec()
    try:
        spec.validate()
    except ValueError as exc:
        raise DemoBuildError(str(exc)) from exc
    output = Path(output).expanduser().absolute()
    digest = inputs_digest(spec)
    result = BuildResult(
        changed=False,
        path=str(output),
        inputs_sha256=digest,
        seed=spec.seed,
        vocab_size=spec.vocab_size,
        num_bpe_ranks=spec.num_bpe_ranks,
        check_mode=check,
        pretrain_steps=spec.pretrain_steps,
    )
    _refuse_foreign_directory(output)
    if check:
        result.changed = not is_up_to_date(output, digest)
        result.msg = "would build the demo model" if result.changed else "demo model is up to date"
        return result

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoBuildError(f"cannot create {output.parent}: {exc.strerror}") from exc
    with _locked(output):
        if is_up_to_date(output, digest):
            result.msg = "demo model is up to date"
            return result
        _remove_leftovers(output)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
        retired = None
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staging, 0o777 & ~umask)
            entry = cache_entry(cache_dir, spec) if cache_dir is not None else None
            if entry is not None and entry != output:
                build(entry, spec)  # locked and idempotent: only the first build of these inputs trains
                result.files = _copy_tree(entry, digest, staging, 0o666 & ~umask)
                result.cached_from = str(entry)
            else:
                result.files = _write_tree(spec, digest, staging, 0o666 & ~umask)
            fsync_dir(staging)
            if output.exists():
                retired = output.parent / f".{output.name}.old-{uuid.uuid4().hex}"
                os.rename(output, retired)
            os.rename(staging, output)
            fsync_dir(output.parent)
        except BaseException:
            if retired is not None and not output.exists():
                os.rename(retired, output)
                retired = None
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if retired is not None:
                shutil.rmtree(retired, ignore_errors=True)
    result.changed = True
    result.msg = "copied the demo model from the cache" if result.cached_from else "built the demo model"
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {BUILDER}",
        description="Build the tiny Kimi-K2.6-shaped demo model (real layout, pre-trained on the corpus).",
    )
    parser.add_argument("--output", required=True, type=Path, help="model directory to create or update")
    parser.add_argument(
        "--seed", type=int, default=DemoSpec.seed, help="seed of the initial weights and the pre-training"
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=DemoSpec.pretrain_steps,
        help=f"pre-training steps on the demo corpus (default {DemoSpec.pretrain_steps}; 0: random weights)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="build once per input hash under this directory and copy from there (e.g. .cache/demo-models)",
    )
    parser.add_argument("--check", action="store_true", help="only report whether a build would change DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON object (for Ansible)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Pre-training reports its progress on stderr; stdout stays one JSON object with --json.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        spec = replace(DemoSpec(), seed=args.seed, pretrain_steps=args.pretrain_steps)
        result = build(args.output, spec, check=args.check, cache_dir=args.cache_dir)
    except (DemoBuildError, OSError) as exc:
        message = f"demo model build failed: {exc}"
        if args.json:
            print(json.dumps({"failed": True, "changed": False, "path": str(args.output), "msg": message}))
        else:
            print(message, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"{result.msg}: {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
