"""Probe prompts with known answers, and the pure check of an answer against its expectation.

A probe is one chat request whose right answer any working instruction model gives: arithmetic, a
capital city, repeat-this-string. The default set lives in `default_probes.jsonl` next to this file;
a model that needs others (another language, a base model that needs a completion-style prompt) gets
its own file through `--probes FILE` / `sglang_server_quality_probes`.

Probe fields:
  id         unique name (shown in failures)
  prompt     the user message (or `messages`: a full chat list)
  expect     {"kind": "number", "value": 391}             some number in the answer equals value
             {"kind": "contains", "value": "Paris"}       the answer contains value (case-insensitive,
                                                          whole words)
             {"kind": "exact", "value": "..."}            the stripped answer equals value
             {"kind": "regex", "value": "..."}            the regex matches somewhere (re.S | re.I)
  max_tokens optional, per probe (the checker's --max-tokens otherwise)
Files: JSON (a list, or {"probes": [...]}), JSON lines, or YAML (.yml/.yaml, needs PyYAML).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .detector import strip_reasoning

EXPECT_KINDS = ("number", "contains", "exact", "regex")
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


class ProbeError(ValueError):
    """A probe file or entry is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class Probe:
    id: str
    messages: list[dict[str, str]]
    expect_kind: str
    expect_value: Any
    max_tokens: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def parse_probe(obj: Any, where: str) -> Probe:
    if not isinstance(obj, dict):
        raise ProbeError(f"{where}: a probe must be an object with id, prompt (or messages) and expect")
    pid = obj.get("id")
    if not isinstance(pid, str) or not pid:
        raise ProbeError(f"{where}: 'id' must be a non-empty string")
    if "messages" in obj:
        messages = obj["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise ProbeError(f"{where} ({pid}): 'messages' must be a non-empty list of {{role, content}}")
    elif isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ProbeError(f"{where} ({pid}): give 'prompt' (a string) or 'messages'")
    expect = obj.get("expect")
    if not isinstance(expect, dict) or expect.get("kind") not in EXPECT_KINDS or "value" not in expect:
        raise ProbeError(
            f"{where} ({pid}): 'expect' must be {{kind, value}} with kind one of {', '.join(EXPECT_KINDS)}"
        )
    kind, value = expect["kind"], expect["value"]
    if kind == "number" and not isinstance(value, int | float):
        raise ProbeError(f"{where} ({pid}): a 'number' expectation needs a numeric value, not {value!r}")
    if kind != "number" and not isinstance(value, str):
        raise ProbeError(f"{where} ({pid}): a {kind!r} expectation needs a string value")
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise ProbeError(f"{where} ({pid}): bad regex {value!r}: {exc}") from None
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ProbeError(f"{where} ({pid}): 'max_tokens' must be a positive integer")
    known = {"id", "prompt", "messages", "expect", "max_tokens", "note"}
    return Probe(
        pid,
        messages,
        kind,
        value,
        max_tokens,
        str(obj.get("note", "")),
        {k: v for k, v in obj.items() if k not in known},
    )


def parse_probes(items: Any, where: str) -> list[Probe]:
    if isinstance(items, dict) and "probes" in items:
        items = items["probes"]
    if not isinstance(items, list) or not items:
        raise ProbeError(f'{where}: expected a non-empty list of probes (or {{"probes": [...]}})')
    probes = [parse_probe(obj, f"{where} entry {i + 1}") for i, obj in enumerate(items)]
    seen: set[str] = set()
    for p in probes:
        if p.id in seen:
            raise ProbeError(f"{where}: probe id {p.id!r} appears twice")
        seen.add(p.id)
    return probes


def load_probes(path: str | Path | None = None) -> list[Probe]:
    """The probes of a JSON/JSONL/YAML file; the packaged default set when `path` is None."""
    if path is None:
        text = resources.files("regen.quality").joinpath("default_probes.jsonl").read_text(encoding="utf-8")
        return parse_probes(_json_lines(text, "default_probes.jsonl"), "default_probes.jsonl")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProbeError(f"cannot read the probe file {p}: {exc.strerror}") from None
    if p.suffix in (".yml", ".yaml"):
        try:
            import yaml
        except ImportError:
            raise ProbeError(
                f"{p}: reading YAML needs PyYAML in this venv; or write the probes as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ProbeError(f"{p}: not valid YAML: {exc}") from None
    elif p.suffix == ".jsonl":
        data = _json_lines(text, str(p))
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProbeError(f"{p}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
    return parse_probes(data, str(p))


def _json_lines(text: str, where: str) -> list[Any]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ProbeError(f"{where} line {n}: not valid JSON: {exc.msg}") from None
    return out


def numbers_in(text: str) -> list[float]:
    """Every number written in the text ('1,024' counts as 1024)."""
    out = []
    for raw in _NUMBER.findall(text):
        try:
            out.append(float(raw.replace(",", "")))
        except ValueError:
            continue
    return out


def check_answer(probe: Probe, content: str | None) -> tuple[bool, str]:
    """(passed, why) for the answer text of one probe; an inline <think> block is ignored."""
    answer = strip_reasoning(content or "").strip()
    if not answer:
        return False, "no answer text"
    value = probe.expect_value
    if probe.expect_kind == "number":
        found = numbers_in(answer)
        if any(abs(x - float(value)) < 1e-9 for x in found):
            return True, f"the answer contains {value}"
        return False, f"expected the number {value}, the answer has {[_fmt(x) for x in found] or 'no number'}"
    if probe.expect_kind == "contains":
        if re.search(rf"(?<!\w){re.escape(value)}(?!\w)", answer, re.I):
            return True, f"the answer contains {value!r}"
        return False, f"expected {value!r} in the answer"
    if probe.expect_kind == "exact":
        if answer == value:
            return True, "exact match"
        return False, f"expected exactly {value!r}"
    if re.search(value, answer, re.S | re.I):
        return True, f"matches /{value}/"
    return False, f"expected a match for /{value}/"


def _fmt(x: float) -> str:
    return str(int(x)) if x.is_integer() else str(x)
