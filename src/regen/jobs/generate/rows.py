"""Pure logic of the generation job: prompt rows, turn plans, responses, retry timing (no I/O)."""

from __future__ import annotations

import email.utils
import json
import logging
import random
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regen.jobs._common import (
    JobError,
    control_character,
    sha256_file,
)
from regen.module_utils.regen_net import redact_url

log = logging.getLogger("regen.jobs.generate")

KIND_COMPLETIONS = 0
KIND_DROPPED = 1
ROLES = ("system", "user", "assistant")
# Statuses worth another attempt. 429 pauses the endpoint for Retry-After; the 5xx family (and timeouts,
# resets) also count towards the endpoint's circuit breaker.
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
CIRCUIT_STATUS = frozenset({500, 502, 503, 504})
# Keys the job owns in the request body; --extra-body may not override them.
RESERVED_BODY_KEYS = frozenset({"model", "messages", "max_tokens", "stream", "n"})


# ==================================================================================================
# Pure logic: prompt rows, turn plans, responses (unit-tested without a server)
# ==================================================================================================


class BadRow(ValueError):
    """An input row that cannot be regenerated; the message is the reason written to errors.jsonl."""


def parse_prompt_row(obj: Any) -> tuple[str, list[dict[str, str]]]:
    """Validate one normalized prompt row; return (id, conversation) or raise BadRow with the reason."""
    if not isinstance(obj, dict):
        raise BadRow(f"row is a JSON {type(obj).__name__}, expected an object with id and conversations")
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int) or rid == "":
        raise BadRow(
            "row has no usable 'id' (a non-empty string); normalize the prompts with regen.jobs.prompts"
        )
    conv = obj.get("conversations", obj.get("messages"))
    if not isinstance(conv, list) or not conv:
        raise BadRow("row has no 'conversations' list of {role, content} turns")
    out: list[dict[str, str]] = []
    seen_user = False
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        role = turn.get("role")
        if role not in ROLES:
            raise BadRow(
                f"turn {i} has role {role!r}; only system, user and assistant turns can be regenerated"
            )
        content = turn.get("content")
        if role == "assistant":
            if not seen_user:
                raise BadRow(
                    f"turn {i} is an assistant turn before any user turn; there is nothing to answer"
                )
            if out and out[-1]["role"] == "assistant":
                raise BadRow(f"turns {i - 1} and {i} are consecutive assistant turns")
            content = ""  # regenerated; the source's answer is not sent anywhere
        elif not isinstance(content, str):
            raise BadRow(f"turn {i} ({role}) has content of type {type(content).__name__}, expected a string")
        if role == "system" and i != 0:
            raise BadRow(f"turn {i} is a system turn after the start of the conversation")
        if role == "user":
            seen_user = True
        out.append({"role": role, "content": content})
    if not seen_user:
        raise BadRow("conversation has no user turn")
    _check_unicode(str(rid), "the id")
    bad = control_character(str(rid))
    if bad is not None:
        raise BadRow(f"the id {str(rid)[:40]!r} holds the control character {bad!r}; ids are printable text")
    for i, turn in enumerate(out):
        _check_unicode(turn["content"], f"turn {i} ({turn['role']})")
    return str(rid), out


def _check_unicode(text: str, what: str) -> None:
    """JSON may escape a lone surrogate ("\\ud800"); no server can be sent it as UTF-8, so say so."""
    if text.isascii():  # no surrogate, and no copy of the text to find that out
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRow(
            f"{what} holds a lone surrogate ({text[exc.start : exc.end].encode('unicode_escape').decode()} "
            f"at character {exc.start}), which is not valid Unicode; fix or remove the row in the input"
        ) from None


def turn_plan(conv: Sequence[dict[str, str]]) -> list[int]:
    """Indices of the assistant turns to generate, in order; a conversation that ends with a user turn
    gets one more assistant turn appended (index == len(conv))."""
    plan = [i for i, t in enumerate(conv) if t["role"] == "assistant"]
    if conv[-1]["role"] != "assistant":
        plan.append(len(conv))
    return plan


@dataclass
class Completion:
    content: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str | None


class MalformedResponse(ValueError):
    pass


def parse_completion(data: bytes) -> Completion:
    """Read an OpenAI chat.completion body (SGLang, vLLM, transformers serve). Raise MalformedResponse."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedResponse(f"response is not JSON ({exc}): {data[:120]!r}") from None
    if not isinstance(doc, dict):
        raise MalformedResponse("response is not a JSON object")
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        err = doc.get("error")
        raise MalformedResponse(f"response has no choices{f': {err}' if err else ''}")
    choice = choices[0]
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise MalformedResponse("response choice has no message")
    content = msg.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise MalformedResponse(f"message content is a {type(content).__name__}, expected a string")
    # SGLang and transformers serve say `reasoning_content`; newer vLLM says `reasoning`.
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
    if reasoning is not None and not isinstance(reasoning, str):
        reasoning = None
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
    return Completion(
        content=content,
        reasoning=reasoning,
        finish_reason=str(choice.get("finish_reason") or "unknown"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        model=doc.get("model") if isinstance(doc.get("model"), str) else None,
    )


def assistant_message(c: Completion, reasoning_mode: str) -> dict[str, str]:
    """The stored assistant turn: reasoning in its own field, or inline as <think>...</think> first."""
    if reasoning_mode == "inline":
        text = f"<think>{c.reasoning}</think>{c.content}" if c.reasoning else c.content
        return {"role": "assistant", "content": text}
    msg = {"role": "assistant", "content": c.content}
    if c.reasoning:
        msg["reasoning_content"] = c.reasoning
    return msg


def normalize_endpoint(url: str) -> str:
    """Base URL (with or without /v1, or the full route) -> the chat-completions URL."""
    u = url.strip().rstrip("/")
    if not (u.startswith("http://") or u.startswith("https://")):
        raise JobError(
            f"endpoint {redact_url(url)!r} is not an http(s) URL; pass e.g. --endpoint http://127.0.0.1:30000"
        )
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


def url_secrets(url: str) -> list[str]:
    """The credentials inside a URL (to scrub from any text the job writes), raw and percent-decoded."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return []
    found = []
    raw_userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    secret = raw_userinfo.partition(":")[2] if ":" in raw_userinfo else raw_userinfo
    if secret:
        found += [secret, urllib.parse.unquote(secret)]
    return [s for s in dict.fromkeys(found) if len(s) >= 3]


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds (a number, or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (now if now is not None else time.time()))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with 'equal jitter': half fixed, half random, so retries spread out but
    never collapse to zero."""
    d = min(cap, base * (2 ** max(0, attempt - 1)))
    return d / 2 + rng.uniform(0, d / 2)


def verify_manifest(paths: Sequence[str]) -> None:
    """Every shard a prompts manifest lists holds the rows and the bytes (sha256) it says, or a JobError.

    A shard cut short, edited or swapped since the prompts job wrote it would be generated without a
    word otherwise, and the training set would silently be another one than the manifest records.
    """
    for raw in paths:
        p = Path(raw)
        manifest = p / "manifest.json"
        if not (p.is_dir() and manifest.is_file()):
            continue
        try:
            shards = json.loads(manifest.read_text())["shards"]
            expected = [(p / s["path"], s.get("rows"), s.get("sha256")) for s in shards]
        except (ValueError, KeyError, TypeError) as exc:
            raise JobError(f"{manifest} is not a prompts manifest ({exc}); rerun the prompts job") from None
        for shard, rows, digest in expected:
            if not shard.is_file():
                raise JobError(f"{shard} (listed in {manifest}) is missing; rerun the prompts job")
            if rows is not None:
                with open(shard, "rb") as fh:
                    got = sum(1 for line in fh if line.strip())
                if got != rows:
                    raise JobError(
                        f"{shard} holds {got} rows but {manifest} says {rows}: it was cut short or "
                        "edited after the prompts job wrote it; rerun the prompts job "
                        "(playbooks/prompts.yml, or python -m regen.jobs.prompts --force)"
                    )
            if digest is not None and sha256_file(shard) != digest:
                raise JobError(
                    f"{shard} does not match the sha256 in {manifest}: it was changed after the prompts "
                    "job wrote it; rerun the prompts job (playbooks/prompts.yml, or python -m "
                    "regen.jobs.prompts --force)"
                )


def resolve_inputs(paths: Sequence[str]) -> list[Path]:
    """Files to read: a file, or a directory (the prompts job's manifest, else its *.jsonl in order)."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            manifest = p / "manifest.json"
            if manifest.is_file():
                try:
                    shards = json.loads(manifest.read_text())["shards"]
                    files.extend(p / s["path"] for s in shards)
                except (ValueError, KeyError, TypeError) as exc:
                    raise JobError(
                        f"{manifest} is not a prompts manifest ({exc}); rerun the prompts job"
                    ) from None
                continue
            found = sorted(list(p.glob("*.jsonl")) + list(p.glob("*.jsonl.gz")))
            if not found:
                raise JobError(f"input directory {p} holds no *.jsonl files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise JobError(
                f"input {p} does not exist; build the prompt set first (playbooks/prompts.yml or "
                "python -m regen.jobs.prompts) or fix --input"
            )
    return files
