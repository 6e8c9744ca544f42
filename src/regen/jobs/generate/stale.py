"""Which completions no longer answer the prompt set: superseded (the prompt under their id was edited),
orphaned (their id left the set) or settings_changed (made with other answer-shaping settings). The job
moves them aside (`ShardStore.move_aside` into `superseded.jsonl`, never deleted) and generates the
superseded and re-settled prompts again, so later stages read only completions of the prompts as they are
now, made with the settings of this run.

A record's key is its id, a hash of its prompt side (`prompt_key`: the system and user turns, in order;
assistant turns are what the job writes, so they are left out) and a hash of the settings that change the
answer (`settings_key`: model, max_tokens, sampling, chat_template_kwargs, reasoning; see
`Settings.answer_settings`). A run whose settings differ from the directory's (run.json) is refused unless
--allow-config-change says to regenerate (`GenerateJob.check_config`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from regen.jobs._common import canonical_json, iter_lines, sha256_file
from regen.jobs._ledger import id_digest, line_id
from regen.jobs.generate.rows import BadRow, parse_prompt_row

ASIDE_NAME = "superseded.jsonl"
# New records carry their key right after the id, so the check reads it without parsing the record.
_KEYED = re.compile(
    rb'^\{"id": ?"([^"\\]*)", ?"prompt_key": ?"([0-9a-f]{32})"(?:, ?"settings_key": ?"([0-9a-f]{32})")?'
)
# What of a record's provenance shapes its answer (records older than `settings_key` carry only that).
ANSWER_KEYS = ("model", "max_tokens", "sampling", "chat_template_kwargs", "reasoning")


def prompt_key(conversation: Iterable[Mapping[str, Any]]) -> str:
    side = [[t.get("role"), t.get("content")] for t in conversation if t.get("role") != "assistant"]
    return hashlib.blake2b(canonical_json(side), digest_size=16).hexdigest()


def settings_key(answer_settings: Mapping[str, Any]) -> str:
    """The hash of the settings that change a completion (`Settings.answer_settings`)."""
    doc = {k: answer_settings.get(k) for k in ANSWER_KEYS}
    return hashlib.blake2b(canonical_json(doc), digest_size=16).hexdigest()


def inputs_digest(files: Iterable[Path]) -> str:
    """One hash of the prompt files' bytes, in order: when it is unchanged, so is every record's key."""
    h = hashlib.sha256()
    for path in files:
        h.update(sha256_file(path).encode() + b"\n")
    return h.hexdigest()


def input_keys(files: Iterable[Path]) -> dict[bytes, str]:
    """id digest -> prompt key of every valid input row (invalid ones are reported by the run itself)."""
    keys: dict[bytes, str] = {}
    for path in files:
        for _, raw in iter_lines(path):
            try:
                rid, conv = parse_prompt_row(json.loads(raw))
            except (ValueError, UnicodeDecodeError, BadRow):
                continue
            keys.setdefault(id_digest(rid), prompt_key(conv))
    return keys


def stale_reason(keys: Mapping[bytes, str], settings: str) -> Callable[[bytes], str | None]:
    """For `ShardStore.move_aside`: "orphaned", "superseded", "settings_changed", or None for a record that
    still answers its prompt with these settings (`settings`: the run's `settings_key`)."""

    def reason(line: bytes) -> str | None:
        rid = key = made_with = None
        m = _KEYED.match(line)
        if m is not None:
            try:
                rid, key = m.group(1).decode("utf-8"), m.group(2).decode()
            except UnicodeDecodeError:
                rid = key = None
            made_with = m.group(3).decode() if (rid is not None and m.group(3)) else None
        if rid is None or made_with is None:
            rid = line_id(line)
            if rid is None:
                return None  # not a record (the store repairs torn lines itself)
            try:
                record = json.loads(line)
            except ValueError:
                return None
            key = record.get("prompt_key") or prompt_key(record.get("conversations") or [])
            # a record older than settings_key: its provenance says what it was made with
            made_with = record.get("settings_key") or settings_key(record.get("provenance") or {})
        wanted = keys.get(id_digest(rid))
        if wanted is None:
            return "orphaned"
        if wanted != key:
            return "superseded"
        return None if made_with == settings else "settings_changed"

    return reason
