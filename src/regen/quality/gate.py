"""Run the probe set against an OpenAI-compatible endpoint on loopback and give a verdict with reasons.

Every probe is one `POST /v1/chat/completions` (temperature 0, standard library HTTP), judged twice: its
answer against the expectation (regen.quality.probes.check_answer) and its text for degenerate shapes
(regen.quality.detector.degeneration). The verdict:

  pass            every probe answered right and nothing looked degenerate
  fail            some probe failed; `failed` lists them with the reasons
  not_applicable  the caller said why the probes cannot pass (the demo model is too small to answer): they
                  still run, and their results are reported, but do not fail the gate
  unavailable     the endpoint did not answer (connection refused, HTTP errors, timeouts); always fatal

Only endpoints on this machine are accepted, loopback or one of its own addresses (a server bound to its
cluster address): the gate runs on the serving host, next to the server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..module_utils.regen_net import is_own_address
from .detector import DEFAULT_THRESHOLDS, Thresholds, degeneration, strip_reasoning
from .probes import Probe, check_answer


class GateError(ValueError):
    """Bad input to the gate (an endpoint on another machine, bad extra body); the message says the fix."""


class EndpointUnavailable(RuntimeError):
    """The endpoint did not answer a probe; the message has the URL and the error."""


def check_local_endpoint(endpoint: str) -> str:
    """The endpoint without a trailing slash or /v1; raises GateError unless it is http(s) on this machine."""
    parsed = urllib.parse.urlsplit(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise GateError(f"--endpoint must be an http(s) URL such as http://127.0.0.1:30000, not {endpoint!r}")
    host = parsed.hostname
    if not is_own_address(host):
        raise GateError(
            f"the quality gate only talks to a server on its own machine (loopback, or an address of this "
            f"machine's), not {host!r}: run it on the serving host against the address the server listens on"
        )
    base = endpoint.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


@dataclass
class ProbeResult:
    id: str
    passed: bool
    reasons: list[str]
    content: str
    finish_reason: str | None
    findings: list[str]
    latency_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "passed": self.passed,
            "reasons": self.reasons,
            "content": self.content[:500],
            "finish_reason": self.finish_reason,
            "findings": self.findings,
            "latency_s": round(self.latency_s, 3),
        }


def post_chat(
    base: str, body: dict[str, Any], api_key: str | None, timeout: float
) -> tuple[dict[str, Any], float]:
    """One chat completion; returns (response JSON, seconds). Raises EndpointUnavailable."""
    url = f"{base}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        raise EndpointUnavailable(f"{url} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EndpointUnavailable(f"{url} did not answer: {reason}") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EndpointUnavailable(f"{url} answered with a body that is not JSON: {raw[:200]!r}") from None
    return doc, time.monotonic() - start


def judge(
    probe: Probe,
    doc: dict[str, Any],
    latency_s: float,
    *,
    tokenizer: Any = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> ProbeResult:
    """A probe's result from the server's response document (pure; unit-tested without a server)."""
    try:
        choice = doc["choices"][0]
        message = choice.get("message") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        return ProbeResult(
            probe.id,
            False,
            [f"the response has no choices[0].message: {str(doc)[:200]}"],
            "",
            None,
            [],
            latency_s,
        )
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    finish = choice.get("finish_reason")
    reasons: list[str] = []
    passed, why = check_answer(probe, content)
    if not passed:
        if not strip_reasoning(content).strip() and reasoning and finish == "length":
            why += (
                " (the reasoning used the whole max_tokens budget: raise --max-tokens or turn thinking off "
                "with --extra-body '{\"chat_template_kwargs\": {...}}')"
            )
        reasons.append(why)
    findings = [
        str(f) for f in degeneration(strip_reasoning(content), tokenizer=tokenizer, thresholds=thresholds)
    ]
    if reasoning:
        findings += [
            f"reasoning: {f}"
            for f in degeneration(reasoning, tokenizer=tokenizer, thresholds=thresholds)
            if f.kind != "empty"
        ]
    # An empty answer is already the answer's failure; other findings fail the probe on their own.
    extra = [f for f in findings if not f.startswith("empty")]
    reasons += [f"degenerate: {f}" for f in extra]
    return ProbeResult(probe.id, passed and not extra, reasons, content, finish, findings, latency_s)


def run_probes(
    endpoint: str,
    model: str,
    probes: Sequence[Probe],
    *,
    api_key: str | None = None,
    max_tokens: int = 256,
    timeout: float = 120.0,
    extra_body: dict[str, Any] | None = None,
    tokenizer: Any = None,
    not_applicable_reason: str | None = None,
) -> dict[str, Any]:
    """Run every probe and return the verdict document (see the module docstring)."""
    base = check_local_endpoint(endpoint)
    extra_body = dict(extra_body or {})
    clash = {"model", "messages", "stream"} & set(extra_body)
    if clash:
        raise GateError(f"--extra-body may not set {sorted(clash)}: the gate owns them")
    results: list[ProbeResult] = []
    for probe in probes:
        body = {
            "model": model,
            "messages": probe.messages,
            "max_tokens": probe.max_tokens or max_tokens,
            "temperature": 0,
            "stream": False,
            **extra_body,
        }
        try:
            doc, seconds = post_chat(base, body, api_key, timeout)
        except EndpointUnavailable as exc:
            return {
                "verdict": "unavailable",
                "endpoint": base,
                "model": model,
                "reasons": [str(exc)],
                "failed": [probe.id],
                "probes": [r.as_dict() for r in results],
                "not_applicable_reason": not_applicable_reason or None,
            }
        results.append(judge(probe, doc, seconds, tokenizer=tokenizer))
    failed = [r for r in results if not r.passed]
    if not_applicable_reason:
        verdict = "not_applicable"
        reasons = [f"probes not applicable: {not_applicable_reason}"] + [
            f"{r.id}: {'; '.join(r.reasons)} (not enforced)" for r in failed
        ]
    else:
        verdict = "fail" if failed else "pass"
        reasons = [f"{r.id}: {'; '.join(r.reasons)}" for r in failed]
    return {
        "verdict": verdict,
        "endpoint": base,
        "model": model,
        "passed": sum(r.passed for r in results),
        "total": len(results),
        "failed": [r.id for r in failed],
        "reasons": reasons,
        "probes": [r.as_dict() for r in results],
        "not_applicable_reason": not_applicable_reason or None,
    }
