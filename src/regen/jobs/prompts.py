"""Build the prompt set: read sources, normalize every row, drop duplicates, sample, write shards atomically.

    python -m regen.jobs.prompts --source SPEC [--source SPEC ...] --output-dir DIR [--sample N --seed S]

A SPEC is a local file or directory (`*.jsonl`, `*.jsonl.gz`, `*.parquet`), `builtin:demo` (the small prompt
set regen ships for the embedded default), `hf:NAME` (a Hugging Face dataset; needs the `datasets` package
and access to the hub), or a JSON object with the options:
  {"path": "...", "hf": "org/name", "builtin": "demo",          one of these three
   "config": null, "split": "train", "revision": null,          Hugging Face datasets only
   "mapping": {"id": "uuid", "conversations": "dialog", "role_key": "from", "content_key": "value",
               "prompt": "question", "system": "system_prompt"},   field names, when not auto-detected
   "sample": 1000, "seed": 0, "id_prefix": "sharegpt-", "name": "label in reports"}

Every row becomes `{"id", "conversations": [{"role", "content"}, ...]}` (SpecForge's format; roles system,
user, assistant), plus its `category` (or `metadata.category`: code, math, chat...) when it has one, which
the evaluate stage reports by. ShareGPT (`from`/`value`, human/gpt), OpenAI `messages`, and prompt-only rows
(`prompt`, `instruction` + `input`, `question`, ...) are recognised. Ids are the source's own (with
`id_prefix`) or a hash of the prompt content. Rows whose prompt side (system and user turns; assistant text
is regenerated later anyway) repeats an earlier row are dropped as duplicates. Sampling keeps the N rows
with the smallest keyed hash of (seed, id): the same input and seed give the same sample, whatever the order
of the rows.

Output in DIR: `prompts-<fingerprint>-NNNNN.jsonl` shards, `rejects.jsonl` (rows that could not be
normalized, with the reason), and `manifest.json`, written last, which commits the set. Running again with
the same sources, contents and options changes nothing (`"changed": false` on stdout).

The manifest's `lengths` are the set's prompt-length statistics the plan's length budget is made of: the
prompt side of every generated conversation (its system and user turns, assistant turns emptied since they
are regenerated) in characters and UTF-8 bytes, and in tokens with the model's chat template when
`--tokenizer DIR` loads; percentiles p50/p90/p99/max, and the longest prompt per number of assistant turns
to generate (a later turn reads the earlier answers). The held-out evaluation split is not counted.
One build per directory at a time (`.lock`; a second is refused with the first one's pid).

Exit codes: 0 built or up to date; 2 bad arguments or sources (a damaged .gz or Parquet file, no usable
prompt, a second build on the same directory); 4 crashed (a bug: traceback on stderr); 5 the output
cannot be written (the previous set is kept); 130/143 interrupted by SIGINT/SIGTERM (nothing committed).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import heapq
import json
import logging
import math
import os
import re
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regen.fsio import AtomicFile, atomic_write_json, fsync_dir

from .. import __version__
from ._common import (
    EXIT_OK,
    DirectoryLock,
    JobError,
    OutputError,
    canonical_json,
    control_character,
    decode_json_line,
    iter_lines,
    job_parser,
    kv,
    prepare_output_dir,
    run_main,
    setup_logging,
    sha256_file,
    stop_on_sigterm,
    stop_signals_done,
)

log = logging.getLogger("regen.jobs.prompts")
# The held-out evaluation split (--eval-fraction) goes in this subdirectory: the generate stage reads only
# the top level, so these prompts are never generated for, tokenized or trained on.
EVAL_DIR = "eval"

SCHEMA_VERSION = 1
BUILTINS = {"demo": "demo_prompts.jsonl"}
ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "question": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "answer": "assistant",
    "system": "system",
}
CONVERSATION_KEYS = ("conversations", "messages", "conversation", "dialog", "dialogue", "chat")
ROLE_KEYS = ("role", "from", "speaker", "author")
CONTENT_KEYS = ("content", "value", "text", "message")
PROMPT_KEYS = ("prompt", "instruction", "question", "query", "input", "text")
SYSTEM_KEYS = ("system", "system_prompt")
ID_KEYS = ("id", "uuid", "conversation_id", "_id", "idx")
MAX_ID_LENGTH = 256
REJECT_EXCERPT = 400


class Reject(ValueError):
    """A row that cannot be normalized; the message is the reason in rejects.jsonl."""


# ==================================================================================================
# Pure normalization
# ==================================================================================================


def _text(value: Any, where: str) -> str:
    """A turn's content as text: a string, or OpenAI content parts of type text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Reject(f"{where} has non-text content ({kind}); regen handles text prompts only")
        return "\n".join(parts)
    raise Reject(f"{where} has content of type {type(value).__name__}, expected text")


def _first_key(row: dict, candidates: tuple[str, ...]) -> str | None:
    # a plain loop: a generator per field per row is a measurable share of a million-row build
    for key in candidates:
        if key in row:
            return key
    return None


def _pick(row: dict, mapping: dict, name: str, candidates: tuple[str, ...]) -> str | None:
    key = mapping.get(name)
    if key is not None:
        if key not in row:
            raise Reject(f"mapped field {name}={key!r} is missing from the row (fields: {sorted(row)[:12]})")
        return key
    return _first_key(row, candidates)


def row_category(row: Any) -> str | None:
    """A row's `category` (or `metadata.category`) when it is a short string, else None."""
    if not isinstance(row, dict):
        return None
    value = row.get("category")
    if value is None and isinstance(row.get("metadata"), dict):
        value = row["metadata"].get("category")
    if isinstance(value, str) and 0 < len(value.strip()) <= 64:
        return value.strip()
    return None


def normalize_conversation(row: Any, mapping: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Turn one source row into [{"role", "content"}, ...] or raise Reject with the reason."""
    mapping = mapping or {}
    if not isinstance(row, dict):
        raise Reject(f"row is a JSON {type(row).__name__}, expected an object")
    conv_key = _pick(row, mapping, "conversations", CONVERSATION_KEYS)
    turns: list[dict[str, str]] = []
    if conv_key is not None and isinstance(row[conv_key], list):
        raw_turns = row[conv_key]
        if not raw_turns:
            raise Reject(f"field {conv_key!r} is an empty list")
        for i, turn in enumerate(raw_turns):
            where = f"turn {i}"
            if not isinstance(turn, dict):
                raise Reject(f"{where} is a {type(turn).__name__}, expected an object with role and content")
            rkey = mapping.get("role_key") or _first_key(turn, ROLE_KEYS)
            ckey = mapping.get("content_key") or _first_key(turn, CONTENT_KEYS)
            if rkey is None or rkey not in turn:
                raise Reject(f"{where} has no role field (looked for {', '.join(ROLE_KEYS)})")
            raw_role = turn[rkey]
            role = ROLE_ALIASES.get(str(raw_role).strip().lower()) if isinstance(raw_role, str) else None
            if role is None:
                raise Reject(
                    f"{where} has unknown role {raw_role!r} (known: system, user/human, assistant/gpt)"
                )
            if ckey is None or ckey not in turn:
                raise Reject(f"{where} has no content field (looked for {', '.join(CONTENT_KEYS)})")
            content = turn[ckey]
            if content is None and role == "assistant":
                content = ""
            turns.append({"role": role, "content": _text(content, where)})
    elif conv_key is not None and mapping.get("conversations"):
        raise Reject(f"mapped field {conv_key!r} is not a list of turns")
    else:
        pkey = _pick(row, mapping, "prompt", PROMPT_KEYS)
        if pkey is None:
            raise Reject(
                "row has neither a conversation (conversations/messages) nor a prompt field "
                "(prompt/instruction/question); set `mapping` for this source"
            )
        text = _text(row[pkey], f"field {pkey!r}")
        # Alpaca style: the instruction plus an optional input.
        if pkey == "instruction" and isinstance(row.get("input"), str) and row["input"].strip():
            text = f"{text}\n\n{row['input']}"
        turns.append({"role": "user", "content": text})

    # a mapped system field may be absent from some rows: no system turn then
    skey = mapping.get("system") or _first_key(row, SYSTEM_KEYS)
    if skey is not None and row.get(skey) not in (None, "") and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": _text(row[skey], f"field {skey!r}")})
    return validate_conversation(turns)


def validate_conversation(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    seen_user = False
    for i, t in enumerate(turns):
        role = t["role"]
        if role == "system" and i != 0:
            raise Reject(f"turn {i} is a system turn after the start of the conversation")
        if role == "assistant":
            if not seen_user:
                raise Reject(f"turn {i} is an assistant turn before any user turn")
            if turns[i - 1]["role"] == "assistant":
                raise Reject(f"turns {i - 1} and {i} are consecutive assistant turns")
        if role == "user":
            if not t["content"].strip():
                raise Reject(f"turn {i} is an empty user turn")
            seen_user = True
        if role == "system" and not t["content"].strip():
            raise Reject("the system turn is empty")
    if not seen_user:
        raise Reject("conversation has no user turn")
    return turns


def lone_surrogate(rid: str, turns: list[dict[str, str]]) -> str | None:
    """Why a row cannot be kept when its id or a turn holds a lone surrogate (JSON may escape one:
    "\\ud800"), which no UTF-8 file or server takes; None when the row is valid Unicode."""
    if rid.isascii() and all(t["content"].isascii() for t in turns):
        return None  # isascii() reads a flag of the string: no encoding of the common row
    for what, text in [("the id", rid)] + [
        (f"turn {i} ({t['role']})", t["content"]) for i, t in enumerate(turns)
    ]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = text[exc.start : exc.end].encode("unicode_escape").decode()
            return (
                f"{what} holds a lone surrogate ({char} at character {exc.start}), which is not valid Unicode"
            )
    return None


def _json_line(doc: Any) -> bytes:
    try:
        return json.dumps(doc, ensure_ascii=False).encode() + b"\n"
    except UnicodeEncodeError:  # a lone surrogate in a rejected row: escaped, the line stays valid UTF-8
        return json.dumps(doc).encode() + b"\n"


def prompt_key(turns: list[dict[str, str]]) -> bytes:
    """Identity of what will be asked: roles plus system/user text (assistant text is regenerated)."""
    side = [[t["role"], t["content"] if t["role"] != "assistant" else ""] for t in turns]
    return hashlib.blake2b(canonical_json(side), digest_size=16).digest()


def asked_turns(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    """What the target is asked: the conversation without its trailing assistant turns (the generate job
    answers the last user turn anew), so `[user q]` and `[user q, assistant <old answer>]` are the same
    question and the set keeps one of them."""
    end = len(turns)
    while end and turns[end - 1]["role"] == "assistant":
        end -= 1
    return turns[:end]


def row_id(row: Any, turns: list[dict[str, str]], mapping: dict[str, str], prefix: str) -> str:
    """The source's id (with prefix), else a content hash of the prompt side."""
    key = _pick(row, mapping, "id", ID_KEYS) if isinstance(row, dict) else None
    if key is not None:
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
            raise Reject(f"id field {key!r} holds {value!r}; expected a non-empty string or integer")
        rid = f"{prefix}{value}"
        if len(rid) > MAX_ID_LENGTH or "\n" in rid:
            raise Reject(f"id {rid[:40]!r}... is longer than {MAX_ID_LENGTH} characters or has a newline")
        bad = control_character(rid)
        if bad is not None:
            raise Reject(f"id {rid[:40]!r} holds the control character {bad!r}; ids are printable text")
        return rid
    return f"{prefix}{prompt_key(turns).hex()[:24]}"


def sample_key(seed: int, rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{rid}".encode(), digest_size=8).digest(), "big")


# ==================================================================================================
# Sources
# ==================================================================================================


@dataclass
class Source:
    kind: str  # path | hf | builtin
    location: str
    name: str
    mapping: dict[str, str] = field(default_factory=dict)
    sample: int | None = None
    seed: int | None = None
    id_prefix: str = ""
    split: str = "train"
    config: str | None = None
    revision: str | None = None
    files: list[Path] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        d = {
            "kind": self.kind,
            "location": self.location,
            "name": self.name,
            "mapping": self.mapping,
            "sample": self.sample,
            "seed": self.seed,
            "id_prefix": self.id_prefix,
        }
        if self.kind == "hf":
            d.update(split=self.split, config=self.config, revision=self.revision)
        return d


_SOURCE_KEYS = {
    "path",
    "hf",
    "builtin",
    "mapping",
    "sample",
    "seed",
    "id_prefix",
    "split",
    "config",
    "revision",
    "name",
}


def parse_source(spec: str | dict) -> Source:
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except ValueError as exc:
                raise JobError(f"--source {text[:60]!r} is not valid JSON ({exc})") from None
        elif text.startswith("builtin:"):
            spec = {"builtin": text.split(":", 1)[1]}
        elif text.startswith("hf:"):
            spec = {"hf": text.split(":", 1)[1]}
        else:
            spec = {"path": text}
    if not isinstance(spec, dict):
        raise JobError(f"a source must be a path, builtin:NAME, hf:NAME or a JSON object, got {spec!r}")
    unknown = set(spec) - _SOURCE_KEYS
    if unknown:
        raise JobError(
            f"source {spec} has unknown option(s) {sorted(unknown)}; known: {sorted(_SOURCE_KEYS)}"
        )
    where = [k for k in ("path", "hf", "builtin") if spec.get(k)]
    if len(where) != 1:
        raise JobError(f"source {spec} must name exactly one of path, hf or builtin")
    kind = where[0]
    location = str(spec[kind])
    mapping = spec.get("mapping") or {}
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise JobError(f"source {location}: mapping must be an object of field names")
    sample = spec.get("sample")
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
        raise JobError(f"source {location}: sample must be a positive integer, got {sample!r}")
    src = Source(
        kind=kind,
        location=location,
        name=str(spec.get("name") or f"{kind}:{location}"),
        mapping=mapping,
        sample=sample,
        seed=spec.get("seed"),
        id_prefix=str(spec.get("id_prefix") or ""),
        split=str(spec.get("split") or "train"),
        config=spec.get("config"),
        revision=spec.get("revision"),
    )
    if kind == "builtin":
        if location not in BUILTINS:
            raise JobError(f"unknown builtin prompt set {location!r}; available: {sorted(BUILTINS)}")
        from importlib import resources

        src.files = [Path(str(resources.files("regen.data").joinpath(BUILTINS[location])))]
    elif kind == "path":
        src.files = _files_of(Path(location))
    return src


def _files_of(path: Path) -> list[Path]:
    def ok(p: Path) -> bool:
        return p.name.endswith((".jsonl", ".jsonl.gz", ".json", ".parquet"))

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and ok(p) and not p.name.startswith("."))
        if not files:
            raise JobError(f"source directory {path} holds no .jsonl, .jsonl.gz or .parquet files")
        return files
    if path.is_file():
        if not ok(path):
            raise JobError(f"source {path}: unsupported file type; use .jsonl, .jsonl.gz or .parquet")
        return [path]
    raise JobError(f"source {path} does not exist")


def iter_source_rows(src: Source) -> Iterator[tuple[str, Any, str | None]]:
    """Yield (where, row, parse_error) for every row, streaming (bounded memory)."""
    if src.kind == "hf":
        yield from _iter_hf(src)
        return
    for path in src.files:
        if path.name.endswith(".parquet"):
            yield from _iter_parquet(path)
        else:
            for lineno, raw in iter_lines(path):
                row, err = decode_json_line(raw)
                yield f"{path.name}:{lineno}", row, err


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise JobError(
            f"{path} is Parquet, and pyarrow is not installed in {sys.executable}; "
            "install regen[jobs] or convert the file to JSONL"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise JobError(f"cannot read Parquet file {path}: {exc}") from None
    n = 0
    batches = pf.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches)
            rows = batch.to_pylist()
        except StopIteration:
            return
        except Exception as exc:  # a damaged data page: pyarrow raises OSError or ArrowException subtypes
            raise JobError(
                f"Parquet file {path} is damaged after row {n} ({type(exc).__name__}: {exc}); replace it "
                "or convert what is readable to JSONL (the previous prompt set is kept)"
            ) from None
        for row in rows:
            n += 1
            yield f"{path.name}:row {n}", row, None


def _iter_hf(src: Source) -> Iterator[tuple[str, Any, str | None]]:
    # Optional: hosts that can reach the hub install `datasets`; everything else uses local files.
    try:
        import datasets
    except ImportError:
        raise JobError(
            f"source hf:{src.location} needs the `datasets` package in {sys.executable} "
            "(pip install datasets) and access to the Hugging Face hub; on offline hosts download "
            "the data elsewhere and pass it as a local JSONL/Parquet path"
        ) from None
    try:
        ds = datasets.load_dataset(
            src.location, src.config, split=src.split, revision=src.revision, streaming=True
        )
    except Exception as exc:  # network, auth, missing split: one clear line instead of a traceback
        raise JobError(
            f"cannot load hf:{src.location} (config={src.config}, split={src.split}): {exc}"
        ) from None
    for n, row in enumerate(ds, 1):
        yield f"{src.location}:row {n}", row, None


# ==================================================================================================
# Building the set
# ==================================================================================================


@dataclass
class Counts:
    read: int = 0
    rows: int = 0
    rejected: int = 0
    duplicates: int = 0
    id_conflicts: int = 0
    sampled_out: int = 0
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)


class _Sampler:
    """Keeps the n rows with the smallest keyed hash: reproducible and independent of row order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.heap: list[tuple[int, int, str, list, bytes]] = []  # (-key, order, id, turns, pkey)
        self.evicted = 0

    def offer(self, order: int, rid: str, turns: list, pkey: bytes) -> None:
        item = (-sample_key(self.seed, rid), order, rid, turns, pkey)
        if len(self.heap) < self.n:
            heapq.heappush(self.heap, item)
        elif item[0] > self.heap[0][0]:
            heapq.heapreplace(self.heap, item)
            self.evicted += 1
        else:
            self.evicted += 1

    def rows(self) -> list[tuple[int, str, list, bytes]]:
        return sorted((order, rid, turns, pkey) for _, order, rid, turns, pkey in self.heap)


class _ShardWriter:
    """Writes rows into temp shard files; each shard is renamed into place once complete."""

    def __init__(self, out: Path, fp8: str, shard_rows: int):
        self.out, self.fp8, self.shard_rows = out, fp8, shard_rows
        self.shards: list[dict[str, Any]] = []
        self._file: AtomicFile | None = None
        self._rows = 0
        self._bytes = 0
        self._hash = hashlib.sha256()
        self._buf: list[bytes] = []

    def write(self, rid: str, turns: list, category: str | None = None) -> None:
        if self._file is None:
            self._name = f"prompts-{self.fp8}-{len(self.shards):05d}.jsonl"
            self._file = AtomicFile(self.out / self._name)
        row: dict[str, Any] = {"id": rid, "conversations": turns}
        if category:
            row["category"] = category
        line = json.dumps(row, ensure_ascii=False).encode() + b"\n"
        self._buf.append(line)
        self._hash.update(line)
        self._rows += 1
        self._bytes += len(line)
        if len(self._buf) >= 1024:
            self._file.write(b"".join(self._buf))
            self._buf.clear()
        if self._rows >= self.shard_rows:
            self._finish()

    def _finish(self) -> None:
        if self._file is None:
            return
        self._file.write(b"".join(self._buf))
        self._buf.clear()
        self._file.commit()
        self.shards.append(
            {"path": self._name, "rows": self._rows, "bytes": self._bytes, "sha256": self._hash.hexdigest()}
        )
        self._file, self._rows, self._bytes, self._hash = None, 0, 0, hashlib.sha256()

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.abort()


def in_eval_split(seed: int, rid: str, fraction: float) -> bool:
    """Whether a row belongs to the held-out evaluation split: a keyed hash of (seed, id) below `fraction`.

    Decided per row from its id alone, so the split is stable under re-runs, file order and sampling, and a
    row never moves between training and evaluation unless the seed or the fraction changes.
    """
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"regen-eval-split:{seed}:{rid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


# ==================================================================================================
# Prompt-length statistics (the plan's length budget reads them from manifest.json)
# ==================================================================================================


def percentiles(values: list[int]) -> dict[str, int] | None:
    """p50/p90/p99/max by nearest rank (the value at ceil(q * n) in sorted order); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)

    def at(q: float) -> int:
        return ordered[max(1, math.ceil(q * n)) - 1]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": ordered[-1]}


def generated_turns(turns: list[dict[str, str]]) -> int:
    """Assistant turns the generate stage produces for a conversation (every assistant turn, plus one when it
    ends with the user), as its turn plan does."""
    count = sum(1 for t in turns if t["role"] == "assistant")
    return count + (0 if turns and turns[-1]["role"] == "assistant" else 1)


def prompt_view(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation as the server sees its prompt side: assistant turns emptied (they are regenerated)
    and a trailing assistant turn dropped (the generation prompt takes its place)."""
    view = [dict(t, content="") if t["role"] == "assistant" else dict(t) for t in turns]
    if view and view[-1]["role"] == "assistant":
        view.pop()
    return view


class PromptCounter:
    """Prompt tokens of conversations with the model's chat template (add_generation_prompt), batched."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self.fallbacks = 0

    def _plain(self, view: list[dict[str, str]]) -> int:
        # No template (or one that refuses this conversation): the contents, plus a few tokens per turn.
        ids = self.tokenizer("\n".join(t["content"] for t in view), add_special_tokens=True)["input_ids"]
        return len(ids) + 8 * len(view)

    def count(self, views: list[list[dict[str, str]]]) -> list[int]:
        out = []
        for view in views:
            if not self.template:
                out.append(self._plain(view))
                continue
            try:
                ids = self.tokenizer.apply_chat_template(view, tokenize=True, add_generation_prompt=True)
            except Exception:  # a template that rejects a shape (e.g. strict role alternation)
                self.fallbacks += 1
                out.append(self._plain(view))
                continue
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append(len(ids))
        return out


def load_prompt_counter(path: Path | None) -> tuple[PromptCounter | None, str]:
    """(counter, why not) for --tokenizer DIR: a tokenizer that does not load leaves tokens uncounted (the
    plan then bounds them by bytes and says so) rather than failing the prompt set."""
    if path is None:
        return None, "no --tokenizer was given"
    from regen.tokenization.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(str(path))
    except ImportError as exc:  # a job venv without transformers still builds the set
        return None, f"transformers does not import in this interpreter ({exc})"
    except JobError as exc:
        return None, str(exc)
    return PromptCounter(tokenizer), ""


class LengthStats:
    """Per-row prompt lengths of the generated set, summarized for the manifest (`lengths`)."""

    BATCH = 256

    def __init__(self, counter: PromptCounter | None, tokenizer: dict[str, Any] | None, why_not: str):
        self.counter = counter
        self.tokenizer = tokenizer
        self.why_not = why_not
        # machine integers (8 bytes a row each), not lists of int objects: a million-row set keeps
        # every row's lengths until the percentiles are taken at the end
        self.chars = array("q")
        self.utf8 = array("q")
        self.tokens = array("q")
        self.turns = array("q")
        self._pending: list[list[dict[str, str]]] = []

    def add(self, turns: list[dict[str, str]]) -> None:
        # the lengths of prompt_view(turns) without building it: assistant turns count nothing (emptied)
        chars = utf8 = 0
        for turn in turns:
            if turn["role"] != "assistant":
                content = turn["content"]
                chars += len(content)
                utf8 += len(content) if content.isascii() else len(content.encode("utf-8", "surrogatepass"))
        self.chars.append(chars)
        self.utf8.append(utf8)
        self.turns.append(generated_turns(turns))
        if self.counter is not None:
            self._pending.append(prompt_view(turns))
            if len(self._pending) >= self.BATCH:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            self.tokens.extend(self.counter.count(self._pending))
            self._pending.clear()

    def summary(self) -> dict[str, Any]:
        if self.counter is not None:
            self._flush()
        counted = self.counter is not None
        groups: dict[int, dict[str, Any]] = {}
        for i, turns in enumerate(self.turns):
            g = groups.setdefault(turns, {"turns": turns, "rows": 0, "max_chars": 0, "max_utf8_bytes": 0,
                                          "max_tokens": 0 if counted else None})
            g["rows"] += 1
            g["max_chars"] = max(g["max_chars"], self.chars[i])
            g["max_utf8_bytes"] = max(g["max_utf8_bytes"], self.utf8[i])
            if counted:
                g["max_tokens"] = max(g["max_tokens"], self.tokens[i])
        if counted:
            reason = "counted with the model's chat template (add_generation_prompt)"
            if self.counter.fallbacks:
                reason += (f"; {self.counter.fallbacks} conversation(s) the template refused counted as "
                           "plain text + 8 tokens per turn")
        else:
            reason = self.why_not
        return {
            "rows": len(self.chars),
            "chars": percentiles(self.chars),
            "utf8_bytes": percentiles(self.utf8),
            "tokens": percentiles(self.tokens) if counted else None,
            "tokens_reason": reason,
            "tokenizer": self.tokenizer,
            "by_turns": [groups[k] for k in sorted(groups)],
        }


def tokenizer_identity(path: Path | None) -> dict[str, Any] | None:
    """{path, digest} of --tokenizer DIR (its files' digest, as the tokenize job fingerprints them); None
    when not given or not a directory, so the prompt set is rebuilt (and recounted) when the model changes."""
    if path is None or not path.is_dir():
        return None
    from regen.tokenization.loader import tokenizer_digest

    return {"path": str(path), "digest": tokenizer_digest(path)}


def fingerprint(
    sources: list[Source], sample: int | None, seed: int, shard_rows: int, eval_fraction: float = 0.0,
    tokenizer: dict[str, Any] | None = None,
) -> str:
    desc = []
    for src in sources:
        d = src.describe()
        # content, not path or mtime: a copied file is the same input, an edited one is not
        d["files"] = [sha256_file(p) for p in src.files]
        desc.append(d)
    doc = {
        "schema": SCHEMA_VERSION,
        "sources": desc,
        "sample": sample,
        "seed": seed,
        "shard_rows": shard_rows,
    }
    if eval_fraction > 0:  # absent when off, so sets built before the split keep their fingerprint
        doc["eval_fraction"] = eval_fraction
    if tokenizer is not None:  # the token counts follow the tokenizer's files, not its path
        doc["tokenizer"] = tokenizer["digest"]
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def up_to_date(out: Path, fp: str) -> dict[str, Any] | None:
    """The existing manifest when the output already holds exactly this set, else None."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != fp:
        return None
    if not isinstance(manifest.get("lengths"), dict):  # a set built before the statistics existed
        return None
    for shard in manifest.get("shards", []) + [
        dict(s, path=f"{EVAL_DIR}/{s['path']}") for s in (manifest.get("eval") or {}).get("shards", [])
    ]:
        p = out / shard["path"]
        if not p.is_file() or p.stat().st_size != shard["bytes"]:
            return None
    if not (out / "rejects.jsonl").is_file():
        return None
    return manifest


def build(
    sources: list[Source],
    out: Path,
    *,
    sample: int | None,
    seed: int,
    shard_rows: int,
    check: bool = False,
    force: bool = False,
    eval_fraction: float = 0.0,
    tokenizer: Path | None = None,
) -> dict[str, Any]:
    identity = tokenizer_identity(tokenizer)
    fp = fingerprint(sources, sample, seed, shard_rows, eval_fraction, identity)
    existing = None if force else up_to_date(out, fp)
    if existing is not None:
        return {
            "changed": False,
            "rows": existing["rows"],
            "rejected": existing["rejected"],
            "duplicates": existing["duplicates"],
            "eval_rows": (existing.get("eval") or {}).get("rows", 0),
            "manifest": str(out / "manifest.json"),
            "fingerprint": fp,
            "lengths": existing["lengths"],
        }
    if check:
        return {"changed": True, "manifest": str(out / "manifest.json"), "fingerprint": fp}

    prepare_output_dir(out)
    # one builder per directory: a second one is refused with the first one's pid (two would swap
    # shards and manifests under each other)
    with DirectoryLock(out, "prompts"):
        try:
            if tokenizer is not None and identity is None:
                counter, why_not = None, f"--tokenizer {tokenizer} is not a directory"
            else:
                counter, why_not = load_prompt_counter(tokenizer)
            lengths = LengthStats(counter, identity, why_not)
            return _build(
                sources, out, fp, sample=sample, seed=seed, shard_rows=shard_rows,
                eval_fraction=eval_fraction, lengths=lengths,
            )
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
            raise OutputError(
                f"cannot write the prompt set to {out}: {exc.strerror}; nothing was committed (the "
                "manifest is written last): the previous prompt set there, if any, is kept as it was, and "
                "the next build sweeps the shards this one left; free space (the sources' size is a fair "
                "estimate of what the set needs) or choose another --output-dir, and run again"
            ) from None


def _build(
    sources: list[Source],
    out: Path,
    fp: str,
    *,
    sample: int | None,
    seed: int,
    shard_rows: int,
    eval_fraction: float,
    lengths: LengthStats | None = None,
) -> dict[str, Any]:
    t0 = time.monotonic()
    lengths = lengths if lengths is not None else LengthStats(None, None, "no --tokenizer was given")
    counts = Counts()
    writer = _ShardWriter(out, fp[:8], shard_rows)
    eval_writer = None
    if eval_fraction > 0:
        (out / EVAL_DIR).mkdir(exist_ok=True)
        eval_writer = _ShardWriter(out / EVAL_DIR, fp[:8], shard_rows)

    # A source row's `category` (code/math/chat...) travels with its prompt, so the evaluate stage can
    # report per category; the first row kept under an id decides it.
    categories: dict[str, str] = {}

    def put(rid: str, turns: list) -> None:
        """Training shards, or the held-out evaluation split (never trained on)."""
        if eval_writer is not None and in_eval_split(seed, rid, eval_fraction):
            eval_writer.write(rid, turns, categories.get(rid))
        else:
            writer.write(rid, turns, categories.get(rid))
            lengths.add(turns)

    rejects = AtomicFile(out / "rejects.jsonl")
    seen_prompts: set[bytes] = set()  # prompt keys already in the set (16 bytes each)
    seen_ids: set[bytes] = set()  # id digests, to tell a duplicate from a clash (16 bytes each)
    global_sampler = _Sampler(sample, seed) if sample else None
    order = 0

    def reject(src: Source, where: str, reason: str, row: Any) -> None:
        counts.rejected += 1
        counts.per_source[src.name]["rejected"] += 1
        excerpt = row if isinstance(row, str) else json.dumps(row, ensure_ascii=False, default=str)
        doc = {"source": src.name, "where": where, "reason": reason, "row": excerpt[:REJECT_EXCERPT]}
        rejects.write(_json_line(doc))

    def admit(src: Source, rid: str, turns: list, pkey: bytes, o: int, where: str) -> bool:
        """Dedup against rows already in the set; True when the row is new."""
        idd = hashlib.blake2b(rid.encode(), digest_size=16).digest()
        if pkey in seen_prompts:
            counts.duplicates += 1
            counts.per_source[src.name]["duplicates"] += 1
            return False
        if idd in seen_ids:
            counts.id_conflicts += 1
            reject(
                src,
                where,
                f"id {rid!r} is already used by a different prompt; set id_prefix for this "
                "source or fix its ids",
                {"id": rid, "conversations": turns},
            )
            return False
        seen_prompts.add(pkey)
        seen_ids.add(idd)
        return True

    def emit(src: Source, rid: str, turns: list, pkey: bytes, o: int, where: str) -> None:
        if not admit(src, rid, turns, pkey, o, where):
            return
        counts.per_source[src.name]["kept"] += 1
        if global_sampler is not None:
            global_sampler.offer(o, rid, turns, pkey)
        else:
            put(rid, turns)

    try:
        for src in sources:
            counts.per_source[src.name] = {
                "read": 0,
                "kept": 0,
                "rejected": 0,
                "duplicates": 0,
                "sampled_out": 0,
            }
            per = _Sampler(src.sample, src.seed if src.seed is not None else seed) if src.sample else None
            local_seen: set[bytes] = set()
            for where, row, err in iter_source_rows(src):
                counts.read += 1
                counts.per_source[src.name]["read"] += 1
                if err is not None:
                    reject(src, where, err, row)
                    continue
                try:
                    turns = normalize_conversation(row, src.mapping)
                    rid = row_id(row, turns, src.mapping, src.id_prefix)
                except Reject as exc:
                    reject(src, where, str(exc), row)
                    continue
                bad_unicode = lone_surrogate(rid, turns)
                if bad_unicode is not None:
                    reject(src, where, bad_unicode, row)
                    continue
                pkey = prompt_key(asked_turns(turns))
                order += 1
                category = row_category(row)
                if category and pkey not in seen_prompts and pkey not in local_seen:
                    categories.setdefault(rid, category)
                if per is None:
                    emit(src, rid, turns, pkey, order, where)
                elif pkey in local_seen or pkey in seen_prompts:
                    counts.duplicates += 1
                    counts.per_source[src.name]["duplicates"] += 1
                else:
                    local_seen.add(pkey)
                    per.offer(order, rid, turns, pkey)
            if per is not None:
                counts.per_source[src.name]["sampled_out"] = per.evicted
                counts.sampled_out += per.evicted
                for o, rid, turns, pkey in per.rows():
                    emit(src, rid, turns, pkey, o, f"{src.name}:sampled")
            log.info("source read", extra=kv(source=src.name, **counts.per_source[src.name]))
        if global_sampler is not None:
            counts.sampled_out += global_sampler.evicted
            for _, rid, turns, _ in global_sampler.rows():
                put(rid, turns)
        shards = writer.close()
        eval_shards = eval_writer.close() if eval_writer is not None else []
    except BaseException:
        writer.abort()
        if eval_writer is not None:
            eval_writer.abort()
        rejects.abort()
        raise
    rejects.commit()
    counts.rows = sum(s["rows"] for s in shards)
    if counts.rows == 0:
        raise JobError(
            f"no usable prompts: {counts.read} rows read, {counts.rejected} rejected "
            f"(reasons in {out / 'rejects.jsonl'}), {counts.duplicates} duplicates"
        )
    manifest = {
        "schema": SCHEMA_VERSION,
        "fingerprint": fp,
        "generator": f"regen {__version__}",
        "created_at": time.time(),
        "format": "jsonl: {id, conversations: [{role, content}], category?}",
        "shards": shards,
        "rows": counts.rows,
        "read": counts.read,
        "rejected": counts.rejected,
        "duplicates": counts.duplicates,
        "id_conflicts": counts.id_conflicts,
        "sampled_out": counts.sampled_out,
        "sample": sample,
        "seed": seed,
        "sources": [dict(src.describe(), counts=counts.per_source[src.name]) for src in sources],
        "lengths": lengths.summary(),
    }
    eval_rows = sum(s["rows"] for s in eval_shards)
    if eval_writer is not None:
        manifest["eval"] = {
            "dir": EVAL_DIR,
            "fraction": eval_fraction,
            "rows": eval_rows,
            "shards": eval_shards,
        }
    atomic_write_json(out / "manifest.json", manifest)  # the commit point
    stop_signals_done()  # committed: a late SIGTERM must not report "nothing committed"
    _remove_stale(out, {s["path"] for s in shards})
    if (out / EVAL_DIR).is_dir():
        _remove_stale(out / EVAL_DIR, {s["path"] for s in eval_shards})
    log.info(
        "prompt set written",
        extra=kv(rows=counts.rows, shards=len(shards), seconds=f"{time.monotonic() - t0:.2f}"),
    )
    return {
        "changed": True,
        "rows": counts.rows,
        "rejected": counts.rejected,
        "duplicates": counts.duplicates,
        "sampled_out": counts.sampled_out,
        "eval_rows": eval_rows,
        "manifest": str(out / "manifest.json"),
        "fingerprint": fp,
        "lengths": manifest["lengths"],
    }


_OWN_FILE = re.compile(
    # shards, and the temporary files (regen.fsio's `.<name>.<random>.tmp`) of a killed run
    r"^(prompts-[0-9a-f]{8}-\d{5}\.jsonl|\.(?:prompts-[0-9a-f]{8}-\d{5}|rejects)\.jsonl(?:\.\w+)?\.tmp)$"
)


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Shards of an earlier set (or temp files of a killed run) go once the new manifest is committed."""
    removed = False
    for entry in os.scandir(out):
        if _OWN_FILE.match(entry.name) and entry.name not in keep:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed = True
    if removed:
        fsync_dir(out)


# ==================================================================================================
# CLI
# ==================================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m regen.jobs.prompts", __doc__, status=False, progress=False)
    p.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="SPEC",
        help="path, builtin:demo, hf:NAME or a JSON object (repeatable)",
    )
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument(
        "--sample", type=int, help="keep this many prompts of the whole set (after per-source samples)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--shard-rows", type=int, default=100_000, help="rows per output shard")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help=f"hold out this share of the prompts (by a seeded hash of their id) in OUTPUT_DIR/{EVAL_DIR}/",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="model directory whose tokenizer and chat template count the prompt tokens in the manifest's "
        "lengths (loaded with trust_remote_code); without it, or when it does not load, only characters "
        "and bytes are counted",
    )
    p.add_argument("--check", action="store_true", help="only report whether a build would change the output")
    p.add_argument("--force", action="store_true", help="rebuild even when the output is up to date")
    p.add_argument(
        "--hf-token-file",
        type=Path,
        metavar="PATH",
        help="file holding a Hugging Face token for hf: sources (kept off the command line; sets HF_TOKEN "
        "for this process only)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    stop_on_sigterm()
    setup_logging(a.log_level, a.log_format)
    if a.sample is not None and a.sample < 1:
        raise JobError("--sample must be a positive integer")
    if a.shard_rows < 1:
        raise JobError("--shard-rows must be a positive integer")
    if not 0 <= a.eval_fraction < 1:
        raise JobError("--eval-fraction must be at least 0 and below 1 (e.g. 0.1 holds out a tenth)")
    if a.hf_token_file is not None:
        try:
            token = a.hf_token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise JobError(
                f"--hf-token-file {a.hf_token_file} cannot be read: {exc.strerror or exc}"
            ) from None
        if token:
            os.environ["HF_TOKEN"] = token  # read by `datasets`/`huggingface_hub` in this process only
    sources = [parse_source(s) for s in a.source]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise JobError(f"two sources share a name ({names}); give them distinct `name`s")
    result = build(
        sources,
        a.output_dir,
        sample=a.sample,
        seed=a.seed,
        shard_rows=a.shard_rows,
        check=a.check,
        force=a.force,
        eval_fraction=a.eval_fraction,
        tokenizer=a.tokenizer,
    )
    if not a.check:
        state = "written" if result["changed"] else "up to date"
        print(
            f"prompts: {state}: rows={result['rows']} rejected={result['rejected']} "
            f"duplicates={result['duplicates']} -> {a.output_dir}",
            file=sys.stderr,
        )
    print(json.dumps(result), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_main(main, own_process=True))
