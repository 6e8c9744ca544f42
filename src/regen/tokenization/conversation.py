"""One completion record -> one checked conversation, or a `RowError` naming what is wrong with it.

Accepted shapes (one JSON object per line):
- the generation job's records: ``{"id": ..., "messages": [{"role", "content", "reasoning_content"?,
  "tool_calls"?, "tool_call_id"?, "name"?}, ...], "tools"?: [...]}``;
- SpecForge's training data: ``{"id": ..., "conversations": [...]}``, where messages may be ShareGPT-style
  (``from``/``value``, roles ``human``/``gpt``) and list/dict fields may be JSON strings (SpecForge's own
  reader stores them that way for Arrow).

What is rejected, with the reason that goes into the rejects file:
``not_an_object``, ``no_messages``, ``bad_message``, ``unknown_role``, ``non_text_content``,
``empty_content``, ``no_assistant_turn``, ``bad_tool_calls``, ``invalid_utf8`` (lone surrogates that JSON
can carry but UTF-8 cannot). Unparsable lines (``invalid_json``, ``invalid_utf8``) are caught by the job
before this module sees them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names (SpecForge accepts these too) mapped to chat roles.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "function": "tool", "observation": "tool"}


class RowError(Exception):
    """A row that cannot become a training sample; `reason` is a stable key, `detail` says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    # Record fields other than the conversation itself (kept for the SpecForge JSONL, never rendered).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def assistant_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def _check_text(value: str, where: str) -> str:
    # json.loads accepts "\ud800" escapes; such strings cannot be encoded (nor tokenized) as UTF-8.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError(
            "invalid_utf8", f"{where} holds an unpaired surrogate at character {exc.start}"
        ) from None
    return value


def _maybe_json(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise RowError("bad_tool_calls", f"{where} is a string that is not JSON") from None
    return value


def _content(message: dict[str, Any], where: str) -> str | None:
    content = message.get("content", message.get("value"))
    if content is None or isinstance(content, str):
        return None if content is None else _check_text(content, f"{where}.content")
    if isinstance(content, list):
        # OpenAI-style parts: text parts are joined; anything else (images, audio) is not trainable text.
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(
                    "non_text_content", f"{where}.content has a {kind!r} part; only text is supported"
                )
        return _check_text("".join(texts), f"{where}.content")
    raise RowError("bad_message", f"{where}.content is a {type(content).__name__}, expected a string")


def _tool_calls(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    calls = _maybe_json(message.get("tool_calls"), f"{where}.tool_calls")
    if calls in (None, []):
        return []
    if not isinstance(calls, list):
        raise RowError("bad_tool_calls", f"{where}.tool_calls is a {type(calls).__name__}, expected a list")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RowError("bad_tool_calls", f"{here} is not an object")
        function = call.get("function", call)
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise RowError("bad_tool_calls", f"{here} has no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            _check_text(arguments, f"{here}.function.arguments")
        elif not isinstance(arguments, dict):
            raise RowError("bad_tool_calls", f"{here}.function.arguments must be a JSON string or an object")
        normalized: dict[str, Any] = {
            "type": call.get("type") or "function",
            "function": {
                "name": _check_text(function["name"], f"{here}.function.name"),
                "arguments": arguments,
            },
        }
        if isinstance(call.get("id"), str) and call["id"]:
            normalized["id"] = _check_text(call["id"], f"{here}.id")
        out.append(normalized)
    return out


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(message, dict):
        raise RowError("bad_message", f"{where} is a {type(message).__name__}, expected an object")
    role = message.get("role", message.get("from"))
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise RowError("unknown_role", f"{where} has role {role!r}; expected one of {', '.join(ROLES)}")
    content = _content(message, where)
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise RowError("bad_message", f"{where}.reasoning_content is a {type(reasoning).__name__}")
        if reasoning:
            out["reasoning_content"] = _check_text(reasoning, f"{where}.reasoning_content")
        calls = _tool_calls(message, where)
        if calls:
            out["tool_calls"] = calls
        # Reasoning alone is allowed (a thinking model cut at max_tokens); the renderer rejects the turn
        # if the reasoning policy leaves nothing of it in the text.
        if not out["content"].strip() and not calls and not reasoning:
            raise RowError("empty_content", f"{where} (assistant) has no content, reasoning or tool calls")
    elif not out["content"].strip():
        raise RowError("empty_content", f"{where} ({role}) has empty content")
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = _check_text(message["tool_call_id"], f"{where}.tool_call_id")
    if isinstance(message.get("name"), str) and message["name"]:
        out["name"] = _check_text(message["name"], f"{where}.name")
    return out


def conversation_from_record(record: Any, fallback_id: str) -> Conversation:
    """Check and normalize one parsed JSONL record; raises `RowError`."""
    if not isinstance(record, dict):
        raise RowError("not_an_object", f"the line is a JSON {type(record).__name__}, expected an object")
    key = "messages" if "messages" in record else "conversations"
    raw = _maybe_json(record.get(key), key) if key in record else None
    if not isinstance(raw, list) or not raw:
        raise RowError("no_messages", "the record has no non-empty 'messages' (or 'conversations') list")
    messages = [normalize_message(m, i) for i, m in enumerate(raw)]
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn", "the conversation has no assistant turn, so nothing to train on")
    tools = _maybe_json(record.get("tools"), "tools") if record.get("tools") not in (None, "", []) else None
    if tools is not None and not isinstance(tools, list):
        raise RowError("bad_tool_calls", "'tools' must be a list of tool declarations")
    rid = record.get("id")
    ident = (
        str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) else fallback_id
    )
    extra = {k: v for k, v in record.items() if k not in ("id", "messages", "conversations", "tools")}
    return Conversation(id=_check_text(ident, "id"), messages=messages, tools=tools, extra=extra)
