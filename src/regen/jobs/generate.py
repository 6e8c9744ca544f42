"""Regenerate the assistant turns of every prompt with the served target model (OpenAI-compatible API).

    python -m regen.jobs.generate --input PROMPTS.jsonl --output-dir DIR --endpoint URL [--endpoint URL ...]
        --model NAME --concurrency N --max-tokens N [--api-key-env VAR]

Input: the normalized prompt JSONL (`{"id", "conversations": [{"role", "content"}, ...]}`), a file, several
`--input`s, or the prompts job's output directory. Output in DIR:
  completions-NNNNN.jsonl  one object per prompt: id, conversations (assistant turns regenerated in order),
                           finish_reason, truncated, usage, latency, model and sampling provenance
  dropped-NNNNN.jsonl      truncated completions when `--truncated drop`
  errors.jsonl             prompts that failed in this run, with the reason (retried by the next run)
  ledger.bin, run.json     the id index that makes restarts exactly-once, and the generation settings
  status.json              progress, rewritten atomically every few seconds (the Ansible role polls it)
Exit codes: 0 every prompt done; 1 some prompts ended in errors.jsonl; 2 bad arguments or input;
3 stopped because every endpoint stayed down longer than --max-outage; 130/143 interrupted.

Kill it at any moment (SIGKILL included) and start it again with the same arguments: finished prompts are
skipped, a torn last line is repaired, nothing is lost or written twice (see `regen.jobs._ledger`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import email.utils
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .. import __version__
from ._common import (
    EXIT_FAILED_RECORDS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    JobError,
    Reservoir,
    StatusFile,
    add_logging_arguments,
    add_status_arguments,
    atomic_write_json,
    count_lines,
    fmt_seconds,
    iter_lines,
    kv,
    make_progress,
    run_main,
    setup_logging,
    want_progress,
    write_all,
)
from ._ledger import ShardStore, id_digest, line_id

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
    return str(rid), out


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
        raise JobError(f"endpoint {url!r} is not an http(s) URL; pass e.g. --endpoint http://127.0.0.1:30000")
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


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


# ==================================================================================================
# Endpoints: per-endpoint concurrency, least-loaded choice, circuit breaker, 429 pauses
# ==================================================================================================


class EndpointsDown(Exception):
    """Every endpoint stayed unreachable longer than --max-outage."""


@dataclass(eq=False)
class Endpoint:
    url: str
    chat_url: str
    limit: int
    in_flight: int = 0
    state: str = "closed"  # closed (healthy) | open (cooling down) | half_open (one probe allowed)
    failures: int = 0  # consecutive
    cooldown: float = 1.0
    open_until: float = 0.0
    paused_until: float = 0.0  # 429 Retry-After
    probe_in_flight: bool = False
    ok: int = 0
    errors: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "in_flight": self.in_flight,
            "ok": self.ok,
            "errors": self.errors,
        }


class EndpointPool:
    """Hands out endpoint slots FIFO-fairly; one waiter is woken per freed slot (no thundering herd)."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        *,
        threshold: int,
        cooldown: float,
        cooldown_max: float,
        max_outage: float,
    ):
        self.endpoints = endpoints
        self.threshold = threshold
        self.cooldown_base = cooldown
        self.cooldown_max = cooldown_max
        self.max_outage = max_outage
        for ep in endpoints:
            ep.cooldown = cooldown
        self._waiters: collections.deque[tuple[asyncio.Future, Endpoint | None]] = collections.deque()
        self._rr = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.outage_since: float | None = None
        self.outage_total = 0.0
        self.fatal: EndpointsDown | None = None

    # -- choosing
    def _usable(self, ep: Endpoint, now: float) -> tuple[bool, bool]:
        if ep.in_flight >= ep.limit or ep.paused_until > now:
            return False, False
        if ep.state == "open":
            if now < ep.open_until:
                return False, False
            ep.state = "half_open"
        if ep.state == "half_open":
            return (not ep.probe_in_flight), True
        return True, False

    def _pick(self, preferred: Endpoint | None, now: float) -> tuple[Endpoint, bool] | None:
        if preferred is not None:
            ok, probe = self._usable(preferred, now)
            if ok and not probe:
                return preferred, False
        best: tuple[Endpoint, bool] | None = None
        best_load = 2.0
        n = len(self.endpoints)
        self._rr = (self._rr + 1) % n
        for k in range(n):
            ep = self.endpoints[(self._rr + k) % n]
            ok, probe = self._usable(ep, now)
            if not ok:
                continue
            load = ep.in_flight / ep.limit
            if load < best_load:
                best, best_load = (ep, probe), load
        return best

    def _take(self, ep: Endpoint, probe: bool) -> None:
        ep.in_flight += 1
        if probe:
            ep.probe_in_flight = True

    async def acquire(self, preferred: Endpoint | None = None) -> tuple[Endpoint, bool]:
        if self.fatal is not None:
            raise self.fatal
        if not self._waiters:
            picked = self._pick(preferred, time.monotonic())
            if picked is not None:
                self._take(*picked)
                return picked
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, preferred))
        self._dispatch()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                ep, probe = fut.result()
                self._release_slot(ep, probe)
            raise

    # -- outcomes
    def _release_slot(self, ep: Endpoint, probe: bool) -> None:
        ep.in_flight -= 1
        if probe:
            ep.probe_in_flight = False
        self._dispatch()

    def release(self, ep: Endpoint, probe: bool, outcome: str, retry_after: float | None = None) -> None:
        """outcome: ok | down (connection, timeout, 5xx) | paused (429) | neutral (a 4xx or a malformed body:
        the server answered, the request was the problem)."""
        now = time.monotonic()
        if outcome == "down":
            ep.errors += 1
            ep.failures += 1
            if ep.state != "open" and (probe or ep.failures >= self.threshold):
                ep.state = "open"
                ep.open_until = now + ep.cooldown
                log.warning(
                    "endpoint failing; circuit opened",
                    extra=kv(endpoint=ep.url, failures=ep.failures, retry_in=f"{ep.cooldown:.1f}s"),
                )
                ep.cooldown = min(self.cooldown_max, ep.cooldown * 2)
        else:
            # any answer proves the endpoint is reachable
            if outcome == "ok":
                ep.ok += 1
            else:
                ep.errors += 1
            if ep.state != "closed":
                log.info("endpoint is answering again; circuit closed", extra=kv(endpoint=ep.url))
            ep.failures, ep.state, ep.cooldown = 0, "closed", self.cooldown_base
            if outcome == "paused" and retry_after:
                ep.paused_until = max(ep.paused_until, now + retry_after)
        self._release_slot(ep, probe)

    # -- waking waiters, outage accounting
    def _dispatch(self) -> None:
        now = time.monotonic()
        while self._waiters:
            fut, pref = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            picked = self._pick(pref, now)
            if picked is None:
                break
            self._waiters.popleft()
            self._take(*picked)
            fut.set_result(picked)
        self._track_outage(now)
        self._arm_timer(now)

    def _all_down(self) -> bool:
        return all(ep.state != "closed" for ep in self.endpoints)

    def _track_outage(self, now: float) -> None:
        if self._all_down():
            if self.outage_since is None:
                self.outage_since = now
                log.warning(
                    "every endpoint is down; pausing (no retry budget is spent while paused)",
                    extra=kv(max_outage=f"{self.max_outage:.0f}s"),
                )
            elif now - self.outage_since > self.max_outage and self.fatal is None:
                self.fatal = EndpointsDown(
                    f"every endpoint stayed down for more than {self.max_outage:.0f}s "
                    f"({', '.join(ep.url for ep in self.endpoints)})"
                )
                while self._waiters:
                    fut, _ = self._waiters.popleft()
                    if not fut.done():
                        fut.set_exception(self.fatal)
        elif self.outage_since is not None:
            self.outage_total += now - self.outage_since
            self.outage_since = None

    def outage_seconds(self) -> float:
        extra = (time.monotonic() - self.outage_since) if self.outage_since is not None else 0.0
        return self.outage_total + extra

    def _arm_timer(self, now: float) -> None:
        if not self._waiters and self.outage_since is None:
            return
        wake = [t for ep in self.endpoints for t in (ep.open_until, ep.paused_until) if t > now]
        if self.outage_since is not None:
            wake.append(self.outage_since + self.max_outage + 0.01)
        if not wake:
            return
        at = min(wake)
        if (
            self._timer is not None
            and not self._timer.cancelled()
            and self._timer_at <= at
            and self._timer_at > now
        ):
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_at = at
        self._timer = loop.call_at(loop.time() + (at - now), self._dispatch)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


# ==================================================================================================
# The job
# ==================================================================================================


class FinalFailure(Exception):
    def __init__(self, reason: str, attempts: int, status: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.status = status


@dataclass
class Settings:
    inputs: list[str]
    output_dir: Path
    endpoints: list[str]
    model: str
    concurrency: int
    max_tokens: int
    api_key: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: str = "field"
    truncated: str = "keep"
    max_retries: int = 8
    request_timeout: float = 1800.0
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    retry_after_max: float = 300.0
    circuit_threshold: int = 3
    circuit_cooldown: float = 2.0
    circuit_cooldown_max: float = 60.0
    max_outage: float = 1800.0
    status_file: Path | None = None
    status_interval: float = 2.0
    progress: bool = False
    shard_records: int = 100_000
    fsync: bool = True
    allow_config_change: bool = False
    seed: int | None = None

    def provenance(self) -> dict[str, Any]:
        """What determines the content of a completion; a resumed run must use the same."""
        sampling: dict[str, Any] = {}
        if self.temperature is not None:
            sampling["temperature"] = self.temperature
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        sampling.update(self.extra_body)
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "sampling": sampling,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning": self.reasoning,
            "truncated": self.truncated,
        }

    def base_body(self) -> dict[str, Any]:
        # Only what was asked for: strict servers (transformers serve) reject fields they do not know.
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        body.update(self.extra_body)
        return body


@dataclass
class Stats:
    done: int = 0
    dropped: int = 0
    failed: int = 0
    invalid: int = 0
    skipped: int = 0
    duplicates: int = 0
    truncated: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    requests: int = 0
    retries: int = 0


class GenerateJob:
    def __init__(self, s: Settings):
        self.s = s
        self.stats = Stats()
        self.latency = Reservoir()
        self.store = ShardStore(
            s.output_dir, kinds=("completions", "dropped"), shard_records=s.shard_records, fsync=s.fsync
        )
        self.status = StatusFile(s.status_file, s.status_interval)
        self.total: int | None = None
        self.started = time.time()
        self._t0 = time.monotonic()
        self._first_request: float | None = None  # generation window: first request .. last durable write
        self._last_write: float | None = None
        self._timeout = aiohttp.ClientTimeout(total=s.request_timeout)
        self._rng = random.Random(s.seed)
        self._stopping = False
        self._interrupted = 0
        self._inflight: set[bytes] = set()
        self._tasks: set[asyncio.Task] = set()
        self._state = "starting"
        self._bar = None
        self._provenance = s.provenance()
        self._provenance_record = dict(self._provenance, generator=f"regen {__version__}")
        self.pool = EndpointPool(
            [Endpoint(url=u, chat_url=normalize_endpoint(u), limit=s.concurrency) for u in s.endpoints],
            threshold=s.circuit_threshold,
            cooldown=s.circuit_cooldown,
            cooldown_max=s.circuit_cooldown_max,
            max_outage=s.max_outage,
        )
        self._headers = {"Content-Type": "application/json"}
        if s.api_key:
            self._headers["Authorization"] = f"Bearer {s.api_key}"
        self._base_body = s.base_body()

    # ------------------------------------------------------------------ config guard

    def check_config(self) -> None:
        path = self.s.output_dir / "run.json"
        if path.is_file():
            try:
                previous = json.loads(path.read_text()).get("provenance")
            except ValueError:
                previous = None
            if previous is not None and previous != self._provenance:
                diffs = [
                    f"{k}: {previous.get(k)!r} -> {self._provenance.get(k)!r}"
                    for k in sorted(set(previous) | set(self._provenance))
                    if previous.get(k) != self._provenance.get(k)
                ]
                if not self.s.allow_config_change:
                    raise JobError(
                        f"{self.s.output_dir} holds completions made with other settings "
                        f"({'; '.join(diffs)}); "
                        "use a new --output-dir, or pass --allow-config-change to mix them on purpose"
                    )
                log.warning(
                    "settings changed; new completions will carry the new provenance",
                    extra=kv(changes="; ".join(diffs)),
                )
        atomic_write_json(path, {"provenance": self._provenance, "generator": f"regen {__version__}"})

    # ------------------------------------------------------------------ status

    def _status_doc(self) -> dict[str, Any]:
        st = self.stats
        elapsed = time.monotonic() - self._t0
        rate = st.done / elapsed if elapsed > 0 else 0.0
        accounted = st.done + st.dropped + st.failed + st.skipped + st.duplicates
        remaining = (self.total - accounted) if self.total is not None else None
        eta = (remaining / rate) if (remaining is not None and rate > 0) else None
        return {
            "job": "generate",
            "state": self._state,
            "pid": os.getpid(),
            "started_at": self.started,
            "updated_at": time.time(),
            "elapsed_s": round(elapsed, 3),
            "generating_s": round(self._last_write - self._first_request, 3)
            if (self._first_request is not None and self._last_write is not None)
            else None,
            "output_dir": str(self.s.output_dir),
            "inputs": [str(i) for i in self.s.inputs],
            "total": self.total,
            "done": st.done,
            "dropped": st.dropped,
            "failed": st.failed,
            "invalid": st.invalid,
            "skipped": st.skipped,
            "duplicates": st.duplicates,
            "truncated": st.truncated,
            "in_flight": len(self._inflight),
            "remaining": remaining,
            "tokens_in": st.tokens_in,
            "tokens_out": st.tokens_out,
            "requests": st.requests,
            "retries": st.retries,
            "records_per_s": round(rate, 3),
            "tokens_out_per_s": round(st.tokens_out / elapsed, 1) if elapsed else 0,
            "eta_s": round(eta, 1) if eta is not None else None,
            "latency_p50_s": self.latency.quantile(0.5),
            "latency_p99_s": self.latency.quantile(0.99),
            "outage_s": round(self.pool.outage_seconds(), 1),
            "endpoints": [ep.public() for ep in self.pool.endpoints],
            "recovery": self.store.report.as_dict(),
            "provenance": self._provenance,
        }

    def summary_line(self) -> str:
        st = self.stats
        elapsed = time.monotonic() - self._t0
        return (
            f"generate: state={self._state} done={st.done} failed={st.failed} skipped={st.skipped} "
            f"dropped={st.dropped} truncated={st.truncated} duplicates={st.duplicates} "
            f"tokens_in={st.tokens_in} tokens_out={st.tokens_out} "
            f"p50={fmt_seconds(self.latency.quantile(0.5))} p99={fmt_seconds(self.latency.quantile(0.99))} "
            f"elapsed={elapsed:.1f}s rate={st.done / elapsed if elapsed > 0 else 0:.1f}/s"
        )

    def _tick(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def _refresh_bar(self) -> None:
        if self._bar is None:
            return
        elapsed = max(1e-9, time.monotonic() - self._t0)
        self._bar.set_postfix_str(
            f"ok={self.stats.done} fail={self.stats.failed} {self.stats.tokens_out / elapsed:.0f} tok/s",
            refresh=False,
        )

    # ------------------------------------------------------------------ requests

    async def _request(
        self, session, body: dict[str, Any], affinity: Endpoint | None
    ) -> tuple[Completion, Endpoint, float, int]:
        """One completion with retries; returns (completion, endpoint, latency, attempts)."""
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        timeout = self._timeout
        if self._first_request is None:
            self._first_request = time.monotonic()
        spent = 0  # attempts charged against --max-retries
        probes = 0  # failed probes of a down endpoint (not charged, but capped)
        attempts = 0
        last = "no attempt made"
        status: int | None = None
        while True:
            ep, probe = await self.pool.acquire(affinity)
            attempts += 1
            self.stats.requests += 1
            t0 = time.monotonic()
            retry_after = None
            try:
                async with session.post(
                    ep.chat_url, data=payload, headers=self._headers, timeout=timeout
                ) as resp:
                    status = resp.status
                    data = await resp.read()
                    retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            except TimeoutError:
                self.pool.release(ep, probe, "down")
                last, status = f"timed out after {self.s.request_timeout:g}s ({ep.url})", None
            except (aiohttp.ClientError, OSError) as exc:
                self.pool.release(ep, probe, "down")
                last, status = f"{type(exc).__name__}: {exc} ({ep.url})", None
            else:
                latency = time.monotonic() - t0
                if status == 200:
                    try:
                        comp = parse_completion(data)
                    except MalformedResponse as exc:
                        self.pool.release(ep, probe, "neutral")
                        last = f"{exc} ({ep.url})"
                    else:
                        self.pool.release(ep, probe, "ok")
                        return comp, ep, latency, attempts
                else:
                    text = data[:300].decode("utf-8", "replace")
                    last = f"HTTP {status} from {ep.url}: {text}"
                    if status == 429:
                        ra = min(retry_after, self.s.retry_after_max) if retry_after is not None else None
                        self.pool.release(ep, probe, "paused", ra)
                    elif status in CIRCUIT_STATUS:
                        self.pool.release(ep, probe, "down")
                    else:
                        self.pool.release(ep, probe, "neutral")
                    if status not in RETRY_STATUS:
                        raise FinalFailure(last, attempts, status)
            # A probe of an endpoint that was already down costs nothing: the circuit, not the record,
            # is what failed. Everything else spends one retry. Free probes are capped too, so a request
            # that kills the server every time (a poison prompt) still ends in errors.jsonl.
            if probe:
                probes += 1
            else:
                spent += 1
            if spent > self.s.max_retries or probes > self.s.max_retries:
                raise FinalFailure(f"gave up after {attempts} attempts: {last}", attempts, status)
            self.stats.retries += 1
            if retry_after is not None and status == 429:
                delay = min(retry_after, self.s.retry_after_max) * (1 + 0.1 * self._rng.random())
            else:
                delay = backoff_delay(spent, self.s.backoff_base, self.s.backoff_max, self._rng)
            log.debug("retrying", extra=kv(reason=last, attempt=attempts, wait=f"{delay:.2f}s"))
            await asyncio.sleep(delay)

    async def _process(
        self,
        session,
        rid: str,
        digest: bytes,
        conv: list[dict[str, str]],
        queue: asyncio.Queue,
        sem: asyncio.Semaphore,
    ) -> None:
        try:
            out: list[dict[str, str]] = []
            ctx: list[dict[str, str]] = []  # what the server sees: generated answers without reasoning
            turns = []
            usage_in = usage_out = 0
            total_latency = 0.0
            served_model = None
            truncated = False
            affinity: Endpoint | None = None
            t_start = time.monotonic()
            plan = set(turn_plan(conv))
            for i in range(len(conv) + 1):
                if i in plan:
                    body = dict(self._base_body)
                    body["messages"] = list(ctx)
                    comp, affinity, latency, attempts = await self._request(session, body, affinity)
                    self.latency.add(latency)
                    total_latency += latency
                    usage_in += comp.prompt_tokens
                    usage_out += comp.completion_tokens
                    served_model = served_model or comp.model
                    truncated = truncated or comp.finish_reason == "length"
                    out.append(assistant_message(comp, self.s.reasoning))
                    ctx.append({"role": "assistant", "content": comp.content})
                    turns.append(
                        {
                            "index": i,
                            "finish_reason": comp.finish_reason,
                            "prompt_tokens": comp.prompt_tokens,
                            "completion_tokens": comp.completion_tokens,
                            "latency_s": round(latency, 4),
                            "attempts": attempts,
                        }
                    )
                elif i < len(conv):
                    out.append(conv[i])
                    ctx.append(conv[i])
            record = {
                "id": rid,
                "conversations": out,
                "finish_reason": turns[-1]["finish_reason"],
                "truncated": truncated,
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out},
                "latency_s": round(total_latency, 4),
                "wall_s": round(time.monotonic() - t_start, 4),
                "model": served_model or self.s.model,
                "turns": turns,
                "provenance": self._provenance_record,
            }
            kind = KIND_DROPPED if (truncated and self.s.truncated == "drop") else KIND_COMPLETIONS
            line = json.dumps(record, ensure_ascii=False).encode()
            await queue.put(("ok", kind, digest, line, usage_in, usage_out, truncated))
        except FinalFailure as f:
            err = {
                "id": rid,
                "error": f.reason,
                "status": f.status,
                "attempts": f.attempts,
                "ts": time.time(),
            }
            await queue.put(("err", None, digest, json.dumps(err, ensure_ascii=False).encode(), 0, 0, False))
        except EndpointsDown:
            self._stopping = True
            self._inflight.discard(digest)
        except asyncio.CancelledError:
            self._inflight.discard(digest)
            raise
        finally:
            sem.release()

    # ------------------------------------------------------------------ writer

    def _write_sync(self, store_items, error_lines, errors_fd: int) -> None:
        if store_items:
            self.store.append(store_items)
        if error_lines:
            write_all(errors_fd, b"".join(line + b"\n" for line in error_lines))

    async def _writer(self, queue: asyncio.Queue, errors_fd: int) -> None:
        stop = False
        while not stop:
            batch = [await queue.get()]
            while True:
                try:
                    batch.append(queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            stop = any(item is None for item in batch)
            items = [item for item in batch if item is not None]
            store_items = [(kind, digest, line) for tag, kind, digest, line, *_ in items if tag == "ok"]
            error_lines = [line for tag, _, _, line, *_ in items if tag == "err"]
            if store_items or error_lines:
                await asyncio.to_thread(self._write_sync, store_items, error_lines, errors_fd)
                self._last_write = time.monotonic()
            st = self.stats
            for tag, kind, digest, _, t_in, t_out, truncated in items:
                if tag == "ok":
                    self.store.index.add(digest)
                    st.tokens_in += t_in
                    st.tokens_out += t_out
                    st.truncated += truncated
                    if kind == KIND_DROPPED:
                        st.dropped += 1
                    else:
                        st.done += 1
                else:
                    st.failed += 1
                self._inflight.discard(digest)
            self._tick(len(items))
            self._refresh_bar()
            self.status.maybe_write(self._status_doc)

    # ------------------------------------------------------------------ feeding

    async def _error_now(self, queue: asyncio.Queue, rid: str | None, where: str, reason: str) -> None:
        self.stats.invalid += 1
        err = {
            "id": rid,
            "input": where,
            "error": f"invalid input row: {reason}",
            "status": None,
            "attempts": 0,
            "ts": time.time(),
        }
        await queue.put(("err", None, b"", json.dumps(err, ensure_ascii=False).encode(), 0, 0, False))

    async def _feed(self, session, files: list[Path], queue: asyncio.Queue, sem: asyncio.Semaphore) -> None:
        batch: list[tuple[int, bytes]] = []

        async def flush(path: str) -> None:
            # Ids and the done-check for the whole batch at once: a resumed run mostly skips, and
            # skipping must cost microseconds per line.
            ids = [line_id(raw) for _, raw in batch]
            valid = [i for i, rid in enumerate(ids) if rid is not None]
            digests = [id_digest(ids[i]) for i in valid]
            known = self.store.index.contains_many(digests)
            skipped = sum(known)
            if skipped:
                self.stats.skipped += skipped
                self._tick(skipped)
            todo = sorted(
                [i for i, rid in enumerate(ids) if rid is None]
                + [valid[k] for k, done in enumerate(known) if not done]
            )
            digest_of = dict(zip(valid, digests, strict=True))
            for i in todo:
                if self._stopping:
                    return
                lineno, raw = batch[i]
                rid = ids[i]
                where = f"{path}:{lineno}"
                if rid is None:
                    try:
                        obj = json.loads(raw)
                    except (ValueError, UnicodeDecodeError) as exc:
                        await self._error_now(queue, None, where, f"not JSON ({exc})")
                        continue
                    try:
                        parse_prompt_row(obj)
                    except BadRow as exc:
                        await self._error_now(queue, None, where, str(exc))
                    continue
                digest = digest_of[i]
                try:
                    _, conv = parse_prompt_row(json.loads(raw))
                except (ValueError, UnicodeDecodeError) as exc:  # BadRow is a ValueError
                    await self._error_now(queue, rid, where, str(exc))
                    continue
                await sem.acquire()
                if self._stopping:
                    sem.release()
                    return
                # Checked after the wait: an earlier line with the same id may have finished meanwhile.
                if digest in self._inflight or digest in self.store.index:
                    sem.release()
                    self.stats.duplicates += 1
                    self._tick()
                    log.warning("duplicate id in the input; generated once", extra=kv(id=rid, at=where))
                    continue
                self._inflight.add(digest)
                task = asyncio.create_task(self._process(session, rid, digest, conv, queue, sem))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        for path in files:
            name = str(path)
            for item in iter_lines(path):
                batch.append(item)
                if len(batch) >= 1024:
                    await flush(name)
                    batch.clear()
                    if self._stopping:
                        return
                    await asyncio.sleep(0)  # let the writer, the status file and signals run
            if batch:
                await flush(name)
                batch.clear()

    async def _count_total(self, files: list[Path]) -> None:
        def count() -> int:
            return sum(count_lines(p) for p in files)

        try:
            self.total = await asyncio.to_thread(count)
        except OSError:
            return
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    # ------------------------------------------------------------------ main loop

    def _on_signal(self, signum: int) -> None:
        self._interrupted = signum
        if not self._stopping:
            self._stopping = True
            log.warning(
                "stopping: no new prompts; waiting for requests in flight (signal again to abort them)",
                extra=kv(in_flight=len(self._inflight)),
            )
            return
        for task in list(self._tasks):
            task.cancel()

    async def run(self) -> int:
        files = resolve_inputs(self.s.inputs)
        report = self.store.open()
        try:
            if report.recovered_lines or report.truncated_bytes or report.ledger_dropped:
                log.info(
                    "recovered after an interrupted run",
                    extra=kv(**{k: v for k, v in report.as_dict().items() if v}),
                )
            self.check_config()
            errors_path = self.s.output_dir / "errors.jsonl"
            if errors_path.exists():
                # this run retries those prompts; keep the last run's reasons next to it for reference
                os.replace(errors_path, self.s.output_dir / "errors.previous.jsonl")
            errors_fd = os.open(errors_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._state = "running"
            self._bar = make_progress(self.s.progress, None, "generate")
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            counter = asyncio.create_task(self._count_total(files))
            queue: asyncio.Queue = asyncio.Queue()
            total_limit = self.s.concurrency * len(self.pool.endpoints)
            # Records waiting out a backoff hold no endpoint slot, so allow twice as many records in flight
            # as slots to keep every endpoint busy; memory stays bounded by this number.
            sem = asyncio.Semaphore(2 * total_limit)
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=75)
            writer = asyncio.create_task(self._writer(queue, errors_fd))
            self.status.maybe_write(self._status_doc, force=True)
            try:
                async with aiohttp.ClientSession(connector=connector, auto_decompress=True) as session:
                    await self._feed(session, files, queue, sem)
                    while self._tasks:
                        await asyncio.wait(list(self._tasks), timeout=1.0)
                        if self.pool.fatal is not None:
                            # requests still hanging on a dead server would only delay the exit
                            for task in list(self._tasks):
                                task.cancel()
            finally:
                await queue.put(None)
                await writer
                counter.cancel()
                os.close(errors_fd)
                self.pool.close()
        finally:
            self.store.close()
        st = self.stats
        if self.pool.fatal is not None:
            self._state, code = "endpoints_down", EXIT_UNAVAILABLE
            log.error(str(self.pool.fatal) + "; unfinished prompts will be retried by the next run")
        elif self._interrupted:
            self._state, code = (
                "interrupted",
                (EXIT_INTERRUPTED if self._interrupted == signal.SIGINT else 143),
            )
        elif st.failed:
            self._state, code = "failed", EXIT_FAILED_RECORDS
        else:
            self._state, code = "done", EXIT_OK
        if self._bar is not None:
            self._refresh_bar()
            self._bar.close()
        doc = self._status_doc()
        doc["exit_code"] = code
        doc["summary"] = self.summary_line()
        if self.s.status_file is not None:
            atomic_write_json(self.s.status_file, doc)
        print(doc["summary"], flush=True)
        if st.failed:
            print(
                f"generate: {st.failed} prompt(s) failed; reasons in {self.s.output_dir / 'errors.jsonl'}; "
                "run again to retry them",
                file=sys.stderr,
            )
        return code


def dry_run(s: Settings) -> dict[str, Any]:
    """What a run would do, without writing anything: pending/done counts and whether settings match."""
    try:
        files = resolve_inputs(s.inputs)
    except JobError as exc:
        # check mode before the prompts stage ran: report, do not fail; a real run fails with this reason
        return {
            "total": None,
            "pending": None,
            "done": None,
            "complete": False,
            "config_matches": True,
            "input_error": str(exc),
            "output_dir": str(s.output_dir),
        }
    store = ShardStore(s.output_dir, read_only=True)
    store.open()
    total = pending = done = unreadable = duplicates = 0
    pending_ids: set[bytes] = set()
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal pending, done, duplicates
        for d, known in zip(batch, store.index.contains_many(batch), strict=True):
            if known:
                done += 1
            elif d in pending_ids:
                duplicates += 1
            else:
                pending_ids.add(d)
                pending += 1
        batch.clear()

    for path in files:
        for _, raw in iter_lines(path):
            total += 1
            rid = line_id(raw)
            if rid is None:
                unreadable += 1
                continue
            batch.append(id_digest(rid))
            if len(batch) >= 4096:
                flush()
    flush()
    run_json = s.output_dir / "run.json"
    previous = None
    if run_json.is_file():
        with contextlib.suppress(ValueError):
            previous = json.loads(run_json.read_text()).get("provenance")
    return {
        "total": total,
        "pending": pending,
        "done": done,
        "unreadable": unreadable,
        "duplicates": duplicates,
        "complete": pending == 0 and unreadable == 0,
        "config_matches": previous is None or previous == s.provenance(),
        "output_dir": str(s.output_dir),
    }


# ==================================================================================================
# CLI
# ==================================================================================================


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise JobError(
            f"{flag} is not valid JSON ({exc}); pass an object such as '{{\"thinking\": true}}'"
        ) from None
    if not isinstance(value, dict):
        raise JobError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m regen.jobs.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("input and output")
    io.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PROMPTS",
        help="normalized prompt JSONL file or the prompts job's directory (repeatable)",
    )
    io.add_argument("--output-dir", required=True, type=Path)
    add_status_arguments(io, interval_help="seconds between status updates")
    io.add_argument("--shard-records", type=int, default=100_000, help="records per output shard")
    io.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="skip fsync (survives a killed process, not a power loss)",
    )
    io.add_argument(
        "--dry-run",
        action="store_true",
        help="print what a run would do (JSON: pending, done, config_matches) and write nothing",
    )
    io.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume an output directory that was produced with different generation settings",
    )

    srv = p.add_argument_group("server")
    srv.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL",
        help="server base URL, with or without /v1 (repeatable; or one router URL)",
    )
    srv.add_argument("--model", required=True, help="model name the server serves")
    srv.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    srv.add_argument("--concurrency", type=int, default=64, help="requests in flight per endpoint")
    srv.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-tokens", type=int, default=4096)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument(
        "--extra-body",
        default="{}",
        metavar="JSON",
        help="more request fields, e.g. '{\"top_k\": 20}' (only what the server accepts)",
    )
    gen.add_argument(
        "--chat-template-kwargs",
        default="{}",
        metavar="JSON",
        help="sent as chat_template_kwargs, e.g. '{\"thinking\": true}' (Kimi) or "
        "'{\"enable_thinking\": false}' (Qwen3); take it from the model facts",
    )
    gen.add_argument(
        "--reasoning",
        choices=("field", "inline"),
        default="field",
        help="keep the server's reasoning_content in its own field, or inline as <think>...</think>",
    )
    gen.add_argument(
        "--truncated",
        choices=("keep", "drop"),
        default="keep",
        help="finish_reason=length completions: keep (flagged truncated) or move to dropped-*.jsonl",
    )
    gen.add_argument("--keep-truncated", dest="truncated", action="store_const", const="keep")
    gen.add_argument("--drop-truncated", dest="truncated", action="store_const", const="drop")
    gen.add_argument("--seed", type=int, help="seed for retry jitter (tests)")

    f = p.add_argument_group("faults")
    f.add_argument("--max-retries", type=int, default=8, help="retries per request (circuit pauses are free)")
    f.add_argument("--backoff-base", type=float, default=1.0)
    f.add_argument("--backoff-max", type=float, default=60.0)
    f.add_argument("--retry-after-max", type=float, default=300.0, help="cap on a server's Retry-After")
    f.add_argument(
        "--circuit-threshold", type=int, default=3, help="consecutive failures that open a circuit"
    )
    f.add_argument(
        "--circuit-cooldown", type=float, default=2.0, help="first pause of an open circuit (doubles)"
    )
    f.add_argument("--circuit-cooldown-max", type=float, default=60.0)
    f.add_argument(
        "--max-outage",
        type=float,
        default=1800.0,
        help="stop (exit 3) when every endpoint has been down this long",
    )

    o = p.add_argument_group("output")
    g = o.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")
    add_logging_arguments(o)
    return p


def settings_from_args(a: argparse.Namespace) -> Settings:
    if a.concurrency < 1:
        raise JobError("--concurrency must be at least 1")
    if a.max_tokens < 1:
        raise JobError("--max-tokens must be at least 1")
    api_key = None
    if a.api_key_env:
        api_key = os.environ.get(a.api_key_env)
        if not api_key:
            raise JobError(
                f"environment variable {a.api_key_env} (named by --api-key-env) is not set or empty"
            )
    extra = _json_object(a.extra_body, "--extra-body")
    clash = RESERVED_BODY_KEYS & set(extra)
    if clash:
        raise JobError(f"--extra-body may not set {sorted(clash)}; use the dedicated flags")
    for url in a.endpoint:
        normalize_endpoint(url)
    return Settings(
        inputs=a.input,
        output_dir=a.output_dir,
        endpoints=a.endpoint,
        model=a.model,
        concurrency=a.concurrency,
        max_tokens=a.max_tokens,
        api_key=api_key,
        temperature=a.temperature,
        top_p=a.top_p,
        extra_body=extra,
        chat_template_kwargs=_json_object(a.chat_template_kwargs, "--chat-template-kwargs"),
        reasoning=a.reasoning,
        truncated=a.truncated,
        max_retries=a.max_retries,
        request_timeout=a.request_timeout,
        backoff_base=a.backoff_base,
        backoff_max=a.backoff_max,
        retry_after_max=a.retry_after_max,
        circuit_threshold=a.circuit_threshold,
        circuit_cooldown=a.circuit_cooldown,
        circuit_cooldown_max=a.circuit_cooldown_max,
        max_outage=a.max_outage,
        status_file=a.status_file or (a.output_dir / "status.json"),
        status_interval=a.status_interval,
        progress=want_progress(a.progress),
        shard_records=a.shard_records,
        fsync=a.fsync,
        allow_config_change=a.allow_config_change,
        seed=a.seed,
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    s = settings_from_args(a)
    if a.dry_run:
        print(json.dumps(dry_run(s)))
        return EXIT_OK
    return asyncio.run(GenerateJob(s).run())


if __name__ == "__main__":
    sys.exit(run_main(main))
