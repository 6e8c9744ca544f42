"""Tokenize completions into DFlash/EAGLE training samples with the target model's own chat template.

    python -m regen.jobs.tokenize --input COMPLETIONS --output-dir DIR --tokenizer MODEL_DIR
        [--max-length N] [--workers N] [--reasoning last|keep|drop] [--mask-token-id ID] ...

Input: the generation job's records (``{"id", "conversations" | "messages": [...], "finish_reason"?}``), a
JSONL file or a directory (its ``completions-*.jsonl``, else every ``*.jsonl`` but ``errors.jsonl`` and
``dropped-*``). Output in DIR:
  data/<shard>.parquet            input_ids (int32), loss_mask (int8), id, length, supervised_tokens,
                                  truncated -- one row per sample
  conversations.jsonl             the kept conversations in the shape SpecForge's data path reads
                                  ({"id", "conversations": [...]}), merged from conversations/<shard>.jsonl
  rejects.jsonl                   every row left out, with its reason (merged from rejects/<shard>.jsonl)
  stats.json                      samples, tokens, supervised fraction, truncation/drop/reject counts,
                                  reasoning accounting, length percentiles and histogram, mask-token check
  length_histogram.png            the histogram as a picture
  state/<shard>.json              per-shard commit marker (input hash + settings hash + the shard's stats)
Input files are cut into shards of --shard-size lines; a shard whose marker matches its input bytes and
the settings is skipped, so a killed run resumes and a re-run over unchanged input writes nothing.
Every file is written to a temporary name and renamed; the marker is written last.

What is trained on (loss mask 1): each assistant turn after its generation prompt, through its end-of-turn
token; system, user and tool turns and the role headers are 0. See `regen.tokenization.render` for the
reasoning policies (--reasoning) and `regen.tokenization.encode` for how the mask meets the tokens.

Exit codes: 0 done (rows left out are counted in stats.json and listed in rejects.jsonl); 2 bad arguments,
an unusable tokenizer or template, a mask token id the tokenizer does not have, a damaged .gz input, or an
id that occurs twice across the inputs; 4 crashed (a bug: traceback on stderr); 5 the output cannot be
written (the message says which shards were kept); 130/143 interrupted by SIGINT/SIGTERM. status.json
says the same (state, exit_code, error) and is rewritten every --status-interval while the job runs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from regen.fsio import AtomicFile, atomic_write_bytes
from regen.jobs._common import (
    EXIT_OK,
    JobError,
    OutputError,
    StatusFile,
    count_lines,
    decode_json_line,
    iter_lines,
    job_parser,
    json_object_arg,
    kv,
    make_progress,
    open_binary,
    prepare_output_dir,
    readable_input,
    run_main,
    setup_logging,
    stop_on_sigterm,
    stop_signals_done,
    want_progress,
)
from regen.status import Status
from regen.tokenization.loader import load_tokenizer, tokenizer_digest

log = logging.getLogger("regen.jobs.tokenize")

FORMAT_VERSION = "regen.tokenize/1"


@dataclass
class Settings:
    """Everything that shapes the output; hashed into every shard marker."""

    tokenizer: str
    max_length: int | None = 8192
    truncation: str = "truncate"
    reasoning: str = "last"
    train_turns: str = "all"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    special_in_content: str = "text"
    mask_token_id: int | None = None
    unfinished: str = "keep"
    think_tags: tuple[str, str] = ("<think>", "</think>")
    trust_remote_code: bool = True
    tokenizer_digest: str = ""

    def fingerprint(self) -> str:
        doc = {"format": FORMAT_VERSION, **asdict(self)}
        doc.pop("tokenizer")  # the path may move; the files' digest is what matters
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


# ==================================================================================================
# One worker process: tokenizer + renderer + encoder, shard in, files out
# ==================================================================================================

_CTX: dict[str, Any] = {}


def _init_worker(settings: Settings) -> None:
    if _CTX.get("settings") == settings:
        return  # a forked worker inherits the driver's tokenizer, renderer and encoder
    from regen.tokenization.encode import PieceEncoder
    from regen.tokenization.render import ChatRenderer, TemplateError

    tokenizer = load_tokenizer(settings.tokenizer, settings.trust_remote_code)
    try:
        renderer = ChatRenderer(
            tokenizer,
            chat_template_kwargs=settings.chat_template_kwargs,
            reasoning=settings.reasoning,
            train_turns=settings.train_turns,
            think_tags=tuple(settings.think_tags),
        )
    except TemplateError as exc:
        raise JobError(f"the chat template in {settings.tokenizer} cannot be used: {exc}") from None
    _CTX.update(
        settings=settings,
        tokenizer=tokenizer,
        renderer=renderer,
        encoder=PieceEncoder(tokenizer, special_in_content=settings.special_in_content),
    )


@dataclass
class ShardTask:
    """One shard: `lines` of a file, or (for plain files) only where they are, so the driver sends a few
    numbers to a worker instead of the data, and holds no more than the line it is reading."""

    name: str
    source: str
    fingerprint: str
    output_dir: str = ""
    lines: list[tuple[int, bytes]] | None = None  # (line number, raw line) for compressed inputs
    span: tuple[int, int, int] | None = None  # (byte offset, end offset, first line number)

    def read(self) -> Iterator[tuple[int, bytes]]:
        if self.lines is not None:
            yield from self.lines
            return
        assert self.span is not None
        start, end, lineno = self.span
        with open(self.source, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        for offset, raw in enumerate(data.split(b"\n")):
            line = raw.rstrip(b"\r")
            if line.strip():
                yield lineno + offset, line


def _drop_end_of_turn(rendered: Any) -> None:
    """The generation stopped at max_tokens: the model never wrote the end-of-turn, so do not train it."""
    pieces = rendered.pieces
    last_content = max((i for i, p in enumerate(pieces) if p.content), default=len(pieces) - 1)
    del pieces[last_content + 1 :]


def _spec_message(message: dict[str, Any]) -> dict[str, Any]:
    # One key set for every message: Arrow (SpecForge reads this with `datasets`) needs uniform rows, and
    # SpecForge's parser json-decodes string tool_calls. reasoning_content is "" rather than null because
    # a template printing `message.get('reasoning_content', '')` would render null as "None".
    return {
        "role": message["role"],
        "content": message["content"],
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": json.dumps(message["tool_calls"], ensure_ascii=False)
        if message.get("tool_calls")
        else None,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


def _arrow(values: array, kind: Any) -> Any:
    import pyarrow as pa

    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def process_shard(task: ShardTask) -> dict[str, Any]:
    """Tokenize and commit one shard (data, conversations, rejects, then the marker); return the marker."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from regen.tokenization.conversation import RowError, conversation_from_record
    from regen.tokenization.policy import apply_length_policy, check_supervision
    from regen.tokenization.stats import Stats

    settings: Settings = _CTX["settings"]
    renderer, encoder = _CTX["renderer"], _CTX["encoder"]
    stats = Stats()
    rejects: list[bytes] = []
    # Token ids and masks go straight into flat C arrays (4 + 1 bytes a token, not ~40 as Python ints).
    ids_flat, mask_flat, offsets = array("i"), array("b"), array("i", [0])
    rows: dict[str, list[Any]] = {k: [] for k in ("id", "length", "supervised_tokens", "truncated")}
    conversations: list[bytes] = []

    def reject(where: str, rid: str | None, reason: str, detail: str) -> None:
        stats.rejected[reason] += 1
        rejects.append(
            json.dumps(
                {"source": where, "id": rid, "reason": reason, "detail": detail}, ensure_ascii=False
            ).encode()
            + b"\n"
        )

    pending: list[tuple[str, Any, Any]] = []  # (where, conversation, rendered)

    def encode_all() -> list[Any]:
        try:
            return encoder.encode_many([r for _, _, r in pending])
        except Exception:  # the job never dies on one row: find the row, row by row
            out: list[Any] = []
            for where, _, rendered in pending:
                try:
                    out.extend(encoder.encode_many([rendered]))
                except Exception as exc:
                    log.warning("unexpected error on a row", extra=kv(where=where, error=repr(exc)))
                    out.append(RowError("internal_error", f"{type(exc).__name__}: {exc}"))
            return out

    def flush() -> None:
        results = encode_all()
        for (where, conv, rendered), encoded in zip(pending, results, strict=True):
            try:
                if isinstance(encoded, RowError):
                    raise encoded
                ids, mask, truncated = apply_length_policy(
                    encoded.input_ids, encoded.loss_mask, settings.max_length, settings.truncation
                )
                check_supervision(mask)
                if settings.mask_token_id is not None and settings.mask_token_id in ids:
                    raise RowError(
                        "contains_mask_token",
                        f"token id {settings.mask_token_id} (the drafter's mask token) occurs in the sample",
                    )
            except RowError as exc:
                reject(where, conv.id, exc.reason, exc.detail)
                continue
            supervised = sum(mask)
            rows["id"].append(conv.id)
            ids_flat.extend(ids)
            mask_flat.extend(mask)
            offsets.append(len(ids_flat))
            rows["length"].append(len(ids))
            rows["supervised_tokens"].append(supervised)
            rows["truncated"].append(truncated)
            stats.samples += 1
            stats.tokens += len(ids)
            stats.supervised_tokens += supervised
            stats.truncated += int(truncated)
            stats.lengths.append(len(ids))
            stats.assistant_turns += rendered.assistant_turns
            stats.supervised_turns += rendered.supervised_turns
            stats.reasoning_turns += rendered.reasoning_turns
            stats.reasoning_rendered += rendered.reasoning_rendered
            stats.reasoning_synthesized += rendered.reasoning_synthesized
            stats.reasoning_dropped += rendered.reasoning_dropped
            stats.special_in_content += int(encoded.special_in_content > 0)
            stats.straddles += encoded.straddles
            stats.trimmed_by_template += int(rendered.trimmed_by_template)
            doc: dict[str, Any] = {
                "id": conv.id,
                "conversations": [_spec_message(m) for m in rendered.messages],
            }
            if conv.tools:
                doc["tools"] = json.dumps(conv.tools, ensure_ascii=False)
            conversations.append(json.dumps(doc, ensure_ascii=False).encode() + b"\n")
        pending.clear()

    for lineno, raw in task.read():
        stats.input_rows += 1
        where = f"{task.source}:{lineno}"
        record, error = decode_json_line(raw)
        if error is not None:
            reject(
                where, None, "invalid_utf8" if error.startswith("invalid UTF-8") else "invalid_json", error
            )
            continue
        try:
            conv = conversation_from_record(record, fallback_id=where)
            unfinished = isinstance(record, dict) and record.get("finish_reason") == "length"
            if unfinished and settings.unfinished == "drop":
                raise RowError(
                    "unfinished_generation", "the final turn stopped at max_tokens (--unfinished drop)"
                )
            rendered = renderer.render(conv)
            if unfinished and conv.messages[-1]["role"] == "assistant":
                _drop_end_of_turn(rendered)
                stats.unfinished += 1
        except RowError as exc:
            rid = (
                record.get("id")
                if isinstance(record, dict) and isinstance(record.get("id"), (str, int))
                else None
            )
            reject(where, None if rid is None else str(rid), exc.reason, exc.detail)
            continue
        except Exception as exc:  # the job never dies on one row
            log.warning("unexpected error on a row", extra=kv(where=where, error=repr(exc)))
            reject(where, None, "internal_error", f"{type(exc).__name__}: {exc}")
            continue
        pending.append((where, conv, rendered))
        if len(pending) >= 64:
            flush()
    if pending:
        flush()

    out = Path(task.output_dir)
    table = pa.table(
        {
            "id": pa.array(rows["id"], type=pa.string()),
            "input_ids": pa.ListArray.from_arrays(_arrow(offsets, pa.int32()), _arrow(ids_flat, pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(_arrow(offsets, pa.int32()), _arrow(mask_flat, pa.int8())),
            "length": pa.array(rows["length"], type=pa.int32()),
            "supervised_tokens": pa.array(rows["supervised_tokens"], type=pa.int32()),
            "truncated": pa.array(rows["truncated"], type=pa.bool_()),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    marker = {
        "name": task.name,
        "source": task.source,
        "fingerprint": task.fingerprint,
        "stats": stats.to_json(),
    }
    # The marker commits the shard. An old one goes first: from here until the new one lands, the shard
    # is not committed. A write that fails (a full disk, SIGTERM) takes the shard's new files with it, so
    # no later stage finds a shard in data/ that no marker vouches for (a SIGKILL can leave one; the next
    # run redoes it, and the train stage refuses a tokenize run that did not finish).
    (out / "state" / f"{task.name}.json").unlink(missing_ok=True)
    try:
        atomic_write_bytes(out / "data" / f"{task.name}.parquet", sink.getvalue().to_pybytes())
        atomic_write_bytes(out / "conversations" / f"{task.name}.jsonl", b"".join(conversations))
        atomic_write_bytes(out / "rejects" / f"{task.name}.jsonl", b"".join(rejects))
        atomic_write_bytes(
            out / "state" / f"{task.name}.json", json.dumps(marker, separators=(",", ":")).encode()
        )
    except BaseException:
        with contextlib.suppress(OSError):
            _remove_shard(out, task.name)
        raise
    return marker


# ==================================================================================================
# The driver: plan shards, skip committed ones, fan out, merge
# ==================================================================================================


def resolve_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(path.glob("completions-*.jsonl"))
            if not found:
                found = sorted(
                    p
                    for p in path.glob("*.jsonl")
                    if p.name != "errors.jsonl" and not p.name.startswith("dropped-")
                )
            if not found:
                raise JobError(
                    f"{path} holds no completions-*.jsonl (nor any other *.jsonl); point --input at "
                    f"the generation job's output directory or a JSONL file"
                )
            files.extend(found)
        else:
            raise JobError(f"--input {item}: no such file or directory")
    return files


def _shard_stem(path: Path, taken: set[str]) -> str:
    stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "input"
    if stem in taken:  # same file name in two input directories
        stem = f"{stem}-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    taken.add(stem)
    return stem


_ID_STRING = re.compile(rb'^\{"id": ?("[^"\\]*")')


def id_token(raw: bytes) -> bytes | None:
    """The id of one input line as its JSON value (`7` and `"7"` differ), or None when it has none."""
    m = _ID_STRING.match(raw)
    if m is not None:
        return m.group(1)
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or "id" not in record:
        return None
    return json.dumps(record["id"], sort_keys=True).encode("utf-8", "surrogatepass")


def duplicate_ids(files: list[Path], limit: int = 5) -> tuple[int, list[tuple[str, list[str]]]]:
    """Ids that occur more than once across all inputs: (how many, the first `limit` with where each is).

    One streaming pass keeps 16-byte digests in a numpy array (160 MB for ten million rows); only when
    some repeat does a second pass look for where they are.
    """
    import numpy as np

    digests = bytearray()
    for path in files:
        for _, raw in iter_lines(path):
            token = id_token(raw)
            if token is not None:
                digests += hashlib.blake2b(token, digest_size=16).digest()
    if not digests:
        return 0, []
    keys = np.frombuffer(bytes(digests), dtype="V16")
    ordered = np.sort(keys)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if not len(repeated):
        return 0, []
    unique = np.unique(repeated)
    wanted = {bytes(k) for k in unique[:limit]}
    found: dict[bytes, tuple[bytes, list[str]]] = {}
    for path in files:
        for lineno, raw in iter_lines(path):
            token = id_token(raw)
            if token is None:
                continue
            d = hashlib.blake2b(token, digest_size=16).digest()
            if d in wanted:
                found.setdefault(d, (token, []))[1].append(f"{path}:{lineno}")
    shown = [(token.decode("utf-8", "backslashreplace"), where) for token, where in found.values()]
    return len(unique), shown


def plan_shards(files: list[Path], shard_size: int, settings_fp: str) -> Iterator[ShardTask]:
    """Cut every input file into shards of `shard_size` non-blank lines, streaming; each carries its
    fingerprint (settings + line numbers + bytes), so a changed line or setting redoes exactly its shard."""
    taken: set[str] = set()
    for path in files:
        stem = _shard_stem(path, taken)
        compressed = path.name.endswith(".gz")
        index = count = 0
        h = hashlib.sha256(settings_fp.encode())
        lines: list[tuple[int, bytes]] = []
        start = first = pos = end = 0

        with readable_input(path), open_binary(path) as fh:
            for lineno, raw in enumerate(fh, 1):
                line_start, pos = pos, pos + len(raw)
                line = raw.rstrip(b"\r\n")
                if not line.strip():
                    continue
                if count == 0:
                    start, first = line_start, lineno
                h.update(b"%d\0" % lineno + line + b"\n")
                if compressed:
                    lines.append((lineno, line))
                end, count = pos, count + 1
                if count >= shard_size:
                    yield _shard(stem, index, path, h, lines if compressed else None, (start, end, first))
                    index, count, lines = index + 1, 0, []
                    h = hashlib.sha256(settings_fp.encode())
        if count:
            yield _shard(stem, index, path, h, lines if compressed else None, (start, end, first))


def _shard(
    stem: str,
    index: int,
    path: Path,
    h: Any,
    lines: list[tuple[int, bytes]] | None,
    span: tuple[int, int, int],
) -> ShardTask:
    return ShardTask(
        name=f"{stem}-{index:05d}",
        source=str(path),
        fingerprint=h.hexdigest(),
        lines=lines,
        span=None if lines is not None else span,
    )


def _committed(out: Path, task: ShardTask) -> dict[str, Any] | None:
    try:
        marker = json.loads((out / "state" / f"{task.name}.json").read_bytes())
    except (OSError, ValueError):
        return None
    if marker.get("fingerprint") != task.fingerprint:
        return None
    for sub, ext in (("data", "parquet"), ("conversations", "jsonl"), ("rejects", "jsonl")):
        if not (out / sub / f"{task.name}.{ext}").is_file():
            return None
    return marker


def merge_digest(names: list[str], fingerprints: list[str]) -> str:
    """What the merged files (conversations.jsonl, rejects.jsonl, stats.json) were made of: the shards,
    in order, by name and fingerprint. stats.json records it, last: a merge that did not finish (a full
    disk, a kill after the last shard) leaves another digest there, and the next run merges again."""
    h = hashlib.sha256()
    for name, fingerprint in zip(names, fingerprints, strict=True):
        h.update(f"{name}\t{fingerprint}\n".encode())
    return h.hexdigest()


def _merged_digest(out: Path) -> str | None:
    try:
        return json.loads((out / "stats.json").read_bytes()).get("merged")
    except (OSError, ValueError, AttributeError):
        return None


def _concat(out: Path, names: list[str], sub: str, target: str) -> None:
    """Merge shard files in shard order into one file, atomically."""
    with AtomicFile(out / target) as merged:
        for name in names:
            with open(out / sub / f"{name}.jsonl", "rb") as src:
                shutil.copyfileobj(src, merged.file, 1 << 20)


def _output_failure(out: Path, exc: OSError, written: int, rows_done: int, rows_total: int) -> str:
    """What a full (or read-only) disk cost: what this run committed and kept, what the rest needs."""
    used = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    left = max(0, rows_total - rows_done)
    need = f"about {used / rows_done * left / 1e6:.1f} MB more" if rows_done else "more space"
    return (
        f"cannot write to {out}: {exc.strerror}; this run committed {written} shard(s): {rows_done} of "
        f"{rows_total} rows are tokenized and kept (each shard whole), the {left} left are tokenized by the "
        f"next run and need {need}; free space or choose another --output-dir, and run again"
    )


def _lock(out: Path) -> Any:
    import fcntl

    fh = open(out / ".lock", "a")  # noqa: SIM115 - kept open for the life of the run; "a" leaves mtime alone
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise JobError(f"another tokenize job is writing {out}; wait for it or stop it first") from None
    return fh


def _write_if_changed(path: Path, data: bytes) -> bool:
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return False
    atomic_write_bytes(path, data)
    return True


def _stale_shards(out: Path, keep: set[str]) -> list[str]:
    state = out / "state"
    return sorted(p.stem for p in state.glob("*.json") if p.stem not in keep) if state.is_dir() else []


def _remove_shard(out: Path, name: str) -> None:
    for sub, ext in (
        ("state", "json"),
        ("data", "parquet"),
        ("conversations", "jsonl"),
        ("rejects", "jsonl"),
    ):
        with contextlib.suppress(FileNotFoundError):
            (out / sub / f"{name}.{ext}").unlink()


def build_settings(args: argparse.Namespace) -> Settings:
    model_dir = Path(args.tokenizer)
    if not model_dir.is_dir():
        raise JobError(
            f"--tokenizer {model_dir}: not a directory; pass the model directory holding the tokenizer"
        )
    kwargs = json_object_arg(args.chat_template_kwargs, "--chat-template-kwargs")
    tags = tuple(t.strip() for t in args.think_tags.split(","))
    if len(tags) != 2 or not all(tags):
        raise JobError("--think-tags takes OPEN,CLOSE, e.g. '<think>,</think>'")
    if args.max_length is not None and args.max_length < 2:
        raise JobError("--max-length must be at least 2 (or 0 for no limit)")
    return Settings(
        tokenizer=str(model_dir.resolve()),
        max_length=args.max_length,
        truncation=args.truncation,
        reasoning=args.reasoning,
        train_turns=args.train_turns,
        chat_template_kwargs=kwargs,
        special_in_content="control" if args.allow_special_in_content else args.special_in_content,
        mask_token_id=args.mask_token_id,
        unfinished=args.unfinished,
        think_tags=tags,  # type: ignore[arg-type]
        trust_remote_code=args.trust_remote_code,
        tokenizer_digest=tokenizer_digest(model_dir),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from regen.tokenization.policy import check_mask_token
    from regen.tokenization.stats import Stats, histogram_png, report

    settings = build_settings(args)
    out = Path(args.output_dir)
    files = resolve_inputs(args.input)
    fingerprint = settings.fingerprint()

    if args.dry_run:  # file names and bytes only, no tokenizer: quick enough to run on every play
        tasks = list(plan_shards(files, args.shard_size, fingerprint))
        pending = [t.name for t in tasks if _committed(out, t) is None]
        stale = _stale_shards(out, {t.name for t in tasks})
        merged = all(
            (out / f).is_file() for f in ("stats.json", "conversations.jsonl", "rejects.jsonl")
        ) and _merged_digest(out) == merge_digest([t.name for t in tasks], [t.fingerprint for t in tasks])
        return {
            "shards": len(tasks),
            "pending": len(pending),
            "stale": len(stale),
            "complete": not pending and not stale and merged,
            "output_dir": str(out),
        }

    prepare_output_dir(out)
    lock = _lock(out)  # held until the process exits; the kernel drops it if the process is killed
    # Temporary files of a killed run: their shards have no marker (or an old one) and are redone below.
    for leftover in [
        *out.glob(".*.tmp"),
        *(p for sub in ("data", "conversations", "rejects", "state") for p in (out / sub).glob(".*.tmp")),
    ]:
        leftover.unlink(missing_ok=True)
    status = StatusFile(
        args.status_file or out / "status.json", interval=args.status_interval, job="tokenize"
    )
    status.arm()  # an error from here on ends as `failed` in status.json (run_main)

    # Before the slow part (loading the tokenizer): from now on status.json is this run's, so a run that
    # ends early (bad settings, SIGTERM) never leaves the last run's `done` there for a reader to believe;
    # it beats while the tokenizer loads too (a thread, joined before any worker is forked).
    def starting() -> dict[str, Any]:
        return Status(
            job="tokenize",
            state="starting",
            item="row",
            line="tokenize: state=starting (loading the tokenizer)",
            done=0,
        ).document(heartbeat_s=args.status_interval)

    status.maybe_write(starting, force=True)
    loaded = threading.Event()

    def beat_while_loading() -> None:
        while not loaded.wait(max(0.05, args.status_interval)):
            status.maybe_write(starting, force=True)

    loading_beat = threading.Thread(target=beat_while_loading, name="status-heartbeat-start", daemon=True)
    loading_beat.start()
    try:
        # The driver loads the tokenizer too: bad settings fail here, once, before any worker starts.
        _init_worker(settings)
        mask_doc = None
        if settings.mask_token_id is not None:
            try:
                token = check_mask_token(_CTX["tokenizer"], settings.mask_token_id)
            except ValueError as exc:
                raise JobError(
                    f"--mask-token-id: {exc}; take the id from the model facts (plan.drafter.mask_token_id)"
                ) from None
            mask_doc = {"id": settings.mask_token_id, "token": token, "in_vocab": True}
    finally:
        loaded.set()
        loading_beat.join()
    rows_total = sum(count_lines(p) for p in files)
    repeated, examples = duplicate_ids(files)
    if repeated:
        shown = "; ".join(f"id {token} at {', '.join(where[:3])}" for token, where in examples)
        raise JobError(
            f"{repeated} id(s) occur more than once across the inputs ({shown}); a training set holds each "
            'conversation once: remove the copies or give them distinct ids (7 and "7" are distinct ids)'
        )
    if args.workers > 1:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread in a process that forks workers
    progress = make_progress(want_progress(args.progress), rows_total, "tokenize", unit="row")
    totals = Stats()
    names: list[str] = []
    fingerprints: list[str] = []
    written = 0
    started = time.monotonic()

    def status_doc(state: str, **final: Any) -> dict[str, Any]:
        """The status document (`regen.status`); `final` adds the job's summary at the end."""
        rejected = sum(totals.rejected.values())
        line = (
            f"tokenize: state={state} rows={totals.input_rows}/{rows_total} samples={totals.samples} "
            f"tokens={totals.tokens} rejected={rejected} shards={len(names)}"
        )
        return Status(
            job="tokenize",
            state=state,
            item="row",
            line=line,
            done=totals.input_rows,
            total=rows_total,
            tokens=totals.tokens,
            exit_code=EXIT_OK if state == "done" else None,  # the other endings are written by run_main
        ).document(
            samples=totals.samples,
            rejected=rejected,
            shards_done=len(names),
            shards_written=written,
            elapsed_s=round(time.monotonic() - started, 1),
            heartbeat_s=args.status_interval,
            **final,
        )

    def beat() -> None:
        """Rewritten every --status-interval even while a long shard runs: pid and updated_at tell a
        slow job from a dead one (`regen.status.liveness`)."""
        # RuntimeError: the counters changed under the heartbeat thread's read; the next beat writes
        with contextlib.suppress(RuntimeError):
            status.maybe_write(lambda: status_doc("running"), force=True)

    def account(marker: dict[str, Any]) -> None:
        shard = Stats.from_json(marker["stats"])
        totals.add(shard)
        if progress is not None:
            progress.update(shard.input_rows)
            progress.set_postfix(
                samples=totals.samples, rejected=sum(totals.rejected.values()), refresh=False
            )
        status.maybe_write(lambda: status_doc("running"))

    status.maybe_write(lambda: status_doc("running"), force=True)
    beat_every = max(0.05, args.status_interval)
    stop_beating = threading.Event()
    beater: threading.Thread | None = None
    try:
        if args.workers <= 1:
            # shards run on this thread; a thread beats meanwhile (no fork here: no pool of workers)
            def heartbeat() -> None:
                while not stop_beating.wait(beat_every):
                    beat()

            beater = threading.Thread(target=heartbeat, name="status-heartbeat", daemon=True)
            beater.start()
            for task in plan_shards(files, args.shard_size, fingerprint):
                names.append(task.name)
                fingerprints.append(task.fingerprint)
                marker = _committed(out, task)
                if marker is None:
                    task.output_dir = str(out)
                    marker = process_shard(task)
                    written += 1
                account(marker)
        else:
            import multiprocessing

            # fork (where there is one) hands every worker the driver's loaded tokenizer for free; the driver
            # starts no threads (no tqdm monitor, TOKENIZERS_PARALLELISM=false) that a fork could break.
            ctx = multiprocessing.get_context(args.start_method)
            with ProcessPoolExecutor(
                max_workers=args.workers, mp_context=ctx, initializer=_init_worker, initargs=(settings,)
            ) as pool:
                inflight: set[Future] = set()
                for task in plan_shards(files, args.shard_size, fingerprint):
                    names.append(task.name)
                    fingerprints.append(task.fingerprint)
                    marker = _committed(out, task)
                    if marker is not None:
                        account(marker)
                        continue
                    task.output_dir = str(out)
                    inflight.add(pool.submit(process_shard, task))
                    # Bounded: at most two shards per worker queued (a task is a file span, not its data).
                    while len(inflight) >= 2 * args.workers:
                        # a timeout, not a thread, for the heartbeat: the driver forks workers
                        done, inflight = wait(inflight, timeout=beat_every, return_when=FIRST_COMPLETED)
                        for fut in done:
                            marker = fut.result()
                            written += 1
                            account(marker)
                        beat()
                while inflight:
                    done, inflight = wait(inflight, timeout=beat_every, return_when=FIRST_COMPLETED)
                    for fut in done:
                        marker = fut.result()
                        written += 1
                        account(marker)
                    beat()
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        raise OutputError(_output_failure(out, exc, written, totals.input_rows, rows_total)) from None
    except BaseException:
        status.maybe_write(lambda: status_doc("interrupted"), force=True, durable=True)
        raise
    finally:
        stop_beating.set()
        if beater is not None:
            beater.join()  # no "running" beat may land after the final document
        if progress is not None:
            progress.close()

    try:
        stale = _stale_shards(out, set(names))
        for name in stale:
            log.info("removing a shard whose input is gone", extra=kv(shard=name))
            _remove_shard(out, name)
        changed = bool(written or stale)
        merged = merge_digest(names, fingerprints)
        remerge = changed or _merged_digest(out) != merged  # the last run may have stopped before its merge
        if remerge or not (out / "conversations.jsonl").is_file():
            _concat(out, names, "conversations", "conversations.jsonl")
            changed = True
        if remerge or not (out / "rejects.jsonl").is_file():
            _concat(out, names, "rejects", "rejects.jsonl")
            changed = True

        if mask_doc is not None:
            mask_doc["occurrences_in_samples"] = (
                0  # rows holding it were dropped (counted as contains_mask_token)
            )
            mask_doc["samples_dropped"] = totals.rejected.get("contains_mask_token", 0)
        config = {k: v for k, v in asdict(settings).items() if k != "tokenizer_digest"}
        config["think_tags"] = list(settings.think_tags)
        config["inputs"] = [str(p) for p in files]
        config["shard_size"] = args.shard_size
        doc = report(totals, config=config, mask_token=mask_doc)
        doc["shards"] = len(names)
        doc["merged"] = merged
        changed |= _write_if_changed(
            out / "stats.json", (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        )
        stop_signals_done()  # the dataset is committed: a late SIGTERM must not fail a finished run
        changed |= _write_if_changed(out / "length_histogram.png", histogram_png(doc))
        lock.close()
        summary = {
            "changed": changed,
            "shards": len(names),
            "shards_written": written,
            "shards_removed": len(stale),
            "input_rows": totals.input_rows,
            "samples": totals.samples,
            "tokens": totals.tokens,
            "supervised_fraction": doc["supervised_fraction"],
            "dropped": doc["dropped_total"],
            "rejected": doc["rejected_total"],
            "truncated": totals.truncated,
            "elapsed_s": round(time.monotonic() - started, 3),
            "output_dir": str(out),
        }
        status.maybe_write(lambda: status_doc("done", result=summary), force=True, durable=True)
        status.disarm()
        return summary
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        raise OutputError(
            f"cannot write to {out}: {exc.strerror}; every one of the {len(names)} shard(s) is tokenized "
            f"and committed ({totals.input_rows} of {rows_total} rows are kept, each shard whole), only "
            "merging conversations.jsonl, rejects.jsonl and stats.json is left (it needs about as much "
            "space again as conversations/ takes); free space or choose another --output-dir, and run "
            "again: the next run only merges"
        ) from None


# ==================================================================================================
# CLI
# ==================================================================================================


def _max_length(text: str) -> int | None:
    value = int(text)
    return None if value == 0 else value


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m regen.jobs.tokenize", __doc__, status=True, progress=True)
    io = p.add_argument_group("input and output")
    io.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="COMPLETIONS",
        help="completions JSONL file or the generation job's directory (repeatable)",
    )
    io.add_argument("--output-dir", required=True, type=Path)
    io.add_argument(
        "--tokenizer",
        required=True,
        metavar="MODEL_DIR",
        help="model directory with the tokenizer and chat template (loaded with trust_remote_code)",
    )
    io.add_argument("--shard-size", type=int, default=2000, help="input lines per shard (the unit of resume)")
    io.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1; 0: one per core)")
    io.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default="fork" if sys.platform.startswith("linux") else "spawn",
        help="how --workers processes start (default: fork on Linux)",
    )
    io.add_argument(
        "--dry-run",
        action="store_true",
        help="print JSON {shards, pending, stale, complete} and write nothing",
    )
    io.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    tpl = p.add_argument_group("template and masks")
    tpl.add_argument(
        "--chat-template-kwargs",
        default="{}",
        metavar="JSON",
        help="variables for the chat template, e.g. '{\"thinking\": true}' (take them from the facts)",
    )
    tpl.add_argument(
        "--reasoning",
        choices=("last", "keep", "drop"),
        default="last",
        help="last: the final turn as served (its prompt, the reasoning after the generation prompt's "
        "<think>, the answer); keep: only what the template renders; drop: none",
    )
    tpl.add_argument(
        "--train-turns",
        choices=("all", "last"),
        default="all",
        help="supervise every assistant turn, or only the last one",
    )
    tpl.add_argument(
        "--special-in-content",
        choices=("text", "reject", "control"),
        default="text",
        help="special-token strings inside messages: encode as text (counted), reject the row, or "
        "encode as control tokens",
    )
    tpl.add_argument(
        "--allow-special-in-content", action="store_true", help="same as --special-in-content control"
    )
    tpl.add_argument("--think-tags", default="<think>,</think>", metavar="OPEN,CLOSE")
    tpl.add_argument("--no-trust-remote-code", dest="trust_remote_code", action="store_false")

    pol = p.add_argument_group("samples")
    pol.add_argument("--max-length", type=_max_length, default=8192, help="tokens per sample (0: no limit)")
    pol.add_argument(
        "--truncation",
        choices=("truncate", "drop"),
        default="truncate",
        help="longer samples: cut to --max-length, or drop them",
    )
    pol.add_argument(
        "--mask-token-id",
        type=int,
        help="the drafter's mask token (facts: plan.drafter.mask_token_id); checked to exist and "
        "samples containing it are dropped",
    )
    pol.add_argument(
        "--unfinished",
        choices=("keep", "drop"),
        default="keep",
        help="completions that stopped at max_tokens: keep without an end-of-turn token, or drop",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()
    setup_logging(args.log_level, args.log_format)
    if args.workers == 0:
        affinity = getattr(os, "sched_getaffinity", None)
        args.workers = len(affinity(0)) if affinity else os.cpu_count() or 1
    if args.workers < 1 or args.shard_size < 1:
        raise JobError("--workers must be 0 (one per core) or more, --shard-size at least 1")
    summary = run(args)
    if args.json or args.dry_run:
        print(json.dumps(summary, sort_keys=True))
    else:
        log.info("tokenize done", extra=kv(**{k: v for k, v in summary.items() if k != "output_dir"}))
        print(
            f"tokenized {summary['samples']} samples ({summary['tokens']} tokens, "
            f"{summary['supervised_fraction']:.1%} supervised) from {summary['input_rows']} rows; "
            f"dropped {summary['dropped']}, rejected {summary['rejected']}, truncated {summary['truncated']} "
            f"-> {summary['output_dir']}"
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_main(main, own_process=True))
