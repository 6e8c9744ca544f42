"""The generation job: settings, counters, the run loop over the endpoint pool, the dry run."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from regen import __version__
from regen.fsio import atomic_write_json, write_all
from regen.jobs._common import (
    EXIT_FAILED_RECORDS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_TERMINATED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    JobError,
    OutputError,
    Reservoir,
    StatusFile,
    count_lines,
    fmt_seconds,
    iter_lines,
    kv,
    make_progress,
    prepare_output_dir,
    stop_signals_done,
)
from regen.jobs._ledger import ShardStore, id_digest, line_id
from regen.jobs.eta import RateMeter, fmt_eta
from regen.jobs.generate.endpoints import Endpoint, EndpointPool, EndpointsDown
from regen.jobs.generate.judging import Judge
from regen.jobs.generate.rows import (
    CIRCUIT_STATUS,
    KIND_COMPLETIONS,
    KIND_DROPPED,
    RETRY_STATUS,
    BadRow,
    Completion,
    MalformedResponse,
    assistant_message,
    backoff_delay,
    normalize_endpoint,
    parse_completion,
    parse_prompt_row,
    parse_retry_after,
    redact_url,
    resolve_inputs,
    turn_plan,
    url_secrets,
    verify_manifest,
)
from regen.jobs.generate.stale import (
    ANSWER_KEYS,
    ASIDE_NAME,
    input_keys,
    inputs_digest,
    prompt_key,
    settings_key,
    stale_reason,
)
from regen.quality.detector import RollingDegeneration
from regen.status import Status

# HTTP statuses that say the request is not allowed: every other request would be refused the same way.
AUTH_STATUS = frozenset({401, 403})
# Output errors a user fixes (free space, another directory), in the words the job uses for them.
_OUTPUT_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the filesystem is read-only",
}

log = logging.getLogger("regen.jobs.generate")
# The per-request encoders, built once: json.dumps with options builds a new JSONEncoder on every call. No
# circular check: a request body and a record are trees the job builds itself. Same output as json.dumps.
_encode_body = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
_encode_record = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode

# ==================================================================================================
# The job
# ==================================================================================================


class AuthRejected(Exception):
    """The server refused the credentials (HTTP 401/403): the job stops at once."""


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
    api_key_source: str | None = None  # where the key came from (named in the 401/403 message)
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
    stop_grace: float = 30.0  # after SIGTERM: how long requests in flight may finish before they are cut
    # The rolling degeneration stop (regen.quality.detector): judge the last N answers, stop when more than
    # `degenerate_threshold` of them are garbage; window 0 turns it off. Not part of the provenance: it
    # decides whether the job goes on, never what an answer says.
    degenerate_window: int = 200
    degenerate_threshold: float = 0.2
    degenerate_min_samples: int = 20
    # Where the degeneration checks run (regen.jobs.generate.judging): in this many worker processes, 0 in
    # the event loop. Decides only where the CPU is spent, never a verdict. The CLI's default is 1
    # (--judge-workers); 0 here keeps a job built in-process (tests, the dry run) free of child processes.
    judge_workers: int = 0

    def provenance(self) -> dict[str, Any]:
        """What determines the content of a completion and where it goes (run.json, every record)."""
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

    def answer_settings(self) -> dict[str, Any]:
        """The part of the provenance that changes the answer: hashed into every record's `settings_key`.
        The truncation policy is left out: it decides where a record goes, not what it says."""
        provenance = self.provenance()
        return {k: provenance[k] for k in ANSWER_KEYS}

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
        self.status = StatusFile(s.status_file, s.status_interval, job="generate", item="record")
        self.total: int | None = None
        self.started = time.time()
        self._t0 = time.monotonic()
        self._first_request: float | None = None  # generation window: first request .. last durable write
        self._last_write: float | None = None
        self._timeout = aiohttp.ClientTimeout(total=s.request_timeout)
        self._rng = random.Random(s.seed)
        self._stopping = False
        self._stop_deadline: float | None = None
        # a fatal end decided while running: (reason, exit code); HTTP 401/403 or an unwritable output
        self._fatal: tuple[str, int] | None = None
        self._written_bytes = 0  # record bytes this run wrote (sizes the "needs N more" of a full disk)
        self._written_records = 0
        self._previous_inputs: str | None = None  # run.json's inputs_sha256: the set last reconciled
        self._previous_settings: str | None = None  # run.json's settings_key: the settings last reconciled
        self._moved: dict[str, int] = {}  # records moved aside this run, by reason
        self._interrupted = 0
        self._inflight: set[bytes] = set()
        self._tasks: set[asyncio.Task] = set()
        self._state = "starting"
        self._bar = None
        self._provenance = s.provenance()
        self._provenance_record = dict(self._provenance, generator=f"regen {__version__}")
        self._settings_key = settings_key(s.answer_settings())
        self.pool = EndpointPool(
            # `url` is what is shown and stored (status.json, errors, logs): credentials in it are redacted
            [
                Endpoint(url=redact_url(u), chat_url=normalize_endpoint(u), limit=s.concurrency)
                for u in s.endpoints
            ],
            threshold=s.circuit_threshold,
            cooldown=s.circuit_cooldown,
            cooldown_max=s.circuit_cooldown_max,
            max_outage=s.max_outage,
        )
        self._headers = {"Content-Type": "application/json"}
        if s.api_key:
            self._headers["Authorization"] = f"Bearer {s.api_key}"
        self._base_body = s.base_body()
        self.degeneration = (
            RollingDegeneration(
                window=s.degenerate_window,
                threshold=s.degenerate_threshold,
                min_samples=s.degenerate_min_samples,
            )
            if s.degenerate_window
            else None
        )
        self._judge: Judge | None = None  # started by run() when the rolling detector is on
        # the ETA's rate: records finished (written, dropped or failed) over the last minutes of work
        self.meter = RateMeter()
        self._secrets = sorted(
            {x for u in s.endpoints for x in url_secrets(u)} | ({s.api_key} if s.api_key else set()),
            key=len,
            reverse=True,
        )

    def _scrub(self, text: str) -> str:
        """Text the job writes or shows, without the API key or a password from an endpoint URL."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _error_line(self, err: dict[str, Any]) -> bytes:
        if isinstance(err.get("error"), str):
            err["error"] = self._scrub(err["error"])
        try:
            return json.dumps(err, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # an id with a lone surrogate: escaped, the line stays valid UTF-8
            return json.dumps(err).encode()

    # ------------------------------------------------------------------ config guard

    def check_config(self) -> None:
        """Refuse settings other than the directory's (run.json) unless --allow-config-change: then the
        completions made with other answer-shaping settings are moved aside and generated again
        (`set_aside_stale`); a changed truncation policy applies to new completions."""
        path = self.s.output_dir / "run.json"
        if not path.is_file():
            return
        try:
            doc = json.loads(path.read_text())
            previous = doc.get("provenance")
            self._previous_inputs = doc.get("inputs_sha256")
            self._previous_settings = doc.get("settings_key")
        except (ValueError, AttributeError):
            previous = None
        if not isinstance(previous, dict) or previous == self._provenance:
            return
        diffs = [
            f"{k}: {previous.get(k)!r} -> {self._provenance.get(k)!r}"
            for k in sorted(set(previous) | set(self._provenance))
            if previous.get(k) != self._provenance.get(k)
        ]
        answer_changed = any(previous.get(k) != self._provenance.get(k) for k in ANSWER_KEYS)
        done = len(self.store.index)
        if not self.s.allow_config_change:
            if answer_changed:
                consequence = (
                    f"pass --allow-config-change to generate them again with these settings (the {done} "
                    f"completion(s) there move to {ASIDE_NAME}, reason settings_changed)"
                )
            else:
                consequence = (
                    "pass --allow-config-change to apply the new truncation policy to new completions"
                )
            raise JobError(
                f"{self.s.output_dir} holds completions made with other settings ({'; '.join(diffs)}); "
                f"use a new --output-dir, or {consequence}"
            )
        log.warning(
            "settings changed (--allow-config-change): completions made with the old ones are generated again"
            if answer_changed
            else "truncation policy changed (--allow-config-change): it applies to new completions",
            extra=kv(changes="; ".join(diffs)),
        )

    def _write_run_json(self, inputs_sha256: str) -> None:
        doc = {
            "provenance": self._provenance,
            "settings_key": self._settings_key,
            "inputs_sha256": inputs_sha256,
            "generator": f"regen {__version__}",
        }
        atomic_write_json(self.s.output_dir / "run.json", doc)

    def set_aside_stale(self, files: list[Path]) -> None:
        """Completions whose prompt was edited or removed, or that were made with other answer-shaping
        settings, leave the output for superseded.jsonl (reported, never deleted); their prompts are
        generated again. run.json is written after: a kill before it makes the next run reconcile again."""
        digest = inputs_digest(files)
        aside = self.s.output_dir / ASIDE_NAME
        pending = self.store.move_aside_pending(aside)
        if digest == self._previous_inputs and self._settings_key == self._previous_settings and not pending:
            return  # the prompt set and settings last reconciled: every record's key still holds
        # With no completion yet none can be stale: the map of every prompt's key (about 200 bytes and a
        # JSON parse per prompt, held at once) is built only where there is something to compare it with.
        if len(self.store.index) or pending:
            keys = input_keys(files)
            self._moved = self.store.move_aside(stale_reason(keys, self._settings_key), aside)
            if self._moved:
                log.warning(
                    "completions of edited or removed prompts, or made with other settings, moved aside; "
                    "the edited and re-settled ones are generated again",
                    extra=kv(**self._moved, to=str(aside)),
                )
        self._write_run_json(digest)

    # ------------------------------------------------------------------ status

    def _status_doc(self, exit_code: int | None = None) -> dict[str, Any]:
        """The status document (`regen.status`), with this job's own details beside its keys."""
        st = self.stats
        elapsed = time.monotonic() - self._t0
        rate = st.done / elapsed if elapsed > 0 else 0.0
        remaining = self._remaining()
        eta = self._eta(remaining)
        status = Status(
            job="generate",
            state=self._state,
            item="record",
            line=self.summary_line(),
            done=st.done,
            total=self.total,
            failed=st.failed,
            tokens=st.tokens_out,
            tokens_per_s=round(st.tokens_out / elapsed, 1) if elapsed else 0.0,
            eta_s=round(eta, 1) if eta is not None else None,
            exit_code=exit_code,
            error=self._error_text(),
        )
        return status.document(
            started_at=self.started,
            elapsed_s=round(elapsed, 3),
            generating_s=round(self._last_write - self._first_request, 3)
            if (self._first_request is not None and self._last_write is not None)
            else None,
            output_dir=str(self.s.output_dir),
            inputs=[str(i) for i in self.s.inputs],
            dropped=st.dropped,
            invalid=st.invalid,
            skipped=st.skipped,
            duplicates=st.duplicates,
            truncated=st.truncated,
            in_flight=len(self._inflight),
            remaining=remaining,
            tokens_in=st.tokens_in,
            requests=st.requests,
            retries=st.retries,
            records_per_s=round(rate, 3),
            # the rate the ETA is computed from: the last minutes of work, not the whole run
            recent_records_per_s=round(self.meter.rate() or 0.0, 3),
            latency_p50_s=self.latency.quantile(0.5),
            latency_p99_s=self.latency.quantile(0.99),
            outage_s=round(self.pool.outage_seconds(), 1),
            endpoints=[ep.public() for ep in self.pool.endpoints],
            recovery=self.store.report.as_dict(),
            provenance=self._provenance,
            heartbeat_s=self.s.status_interval,
            superseded=self._moved.get("superseded", 0),
            orphaned=self._moved.get("orphaned", 0),
            settings_changed=self._moved.get("settings_changed", 0),
            degeneration=self._degeneration_summary(),
        )

    def _degeneration_summary(self) -> dict[str, Any] | None:
        if self.degeneration is None:
            return None
        summary = self.degeneration.summary()
        if self._judge is not None:
            summary["judge_workers"] = self._judge.workers
            summary["unjudged"] = self._judge.unjudged
        return summary

    def _error_text(self) -> str | None:
        if self._fatal is not None:
            return self._fatal[0]
        if self.pool.fatal is not None:
            return self._scrub(str(self.pool.fatal))
        return None

    def _remaining(self) -> int | None:
        st = self.stats
        accounted = st.done + st.dropped + st.failed + st.skipped + st.duplicates
        return (self.total - accounted) if self.total is not None else None

    def _eta(self, remaining: int | None) -> float | None:
        """Seconds left at the rate measured over the last minutes (None until there is one)."""
        if self._state in ("done", "failed", "interrupted", "endpoints_down"):
            return 0.0 if remaining == 0 else None
        return self.meter.eta_s(remaining)

    def summary_line(self) -> str:
        st = self.stats
        elapsed = time.monotonic() - self._t0
        line = (
            f"generate: state={self._state} done={st.done} failed={st.failed} skipped={st.skipped} "
            f"dropped={st.dropped} truncated={st.truncated} duplicates={st.duplicates} "
            f"tokens_in={st.tokens_in} tokens_out={st.tokens_out} "
            f"p50={fmt_seconds(self.latency.quantile(0.5))} p99={fmt_seconds(self.latency.quantile(0.99))} "
            f"elapsed={elapsed:.1f}s rate={st.done / elapsed if elapsed > 0 else 0:.1f}/s"
        )
        if self._state == "running":
            line += f" eta={fmt_eta(self._eta(self._remaining()))}"
        return line

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
        payload = _encode_body(body).encode()
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
                    if status in AUTH_STATUS:
                        self.pool.release(ep, probe, "neutral")
                        raise AuthRejected(last)
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
                # second and third: read without parsing the record (stale.py)
                "prompt_key": prompt_key(conv),
                "settings_key": self._settings_key,
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
            if self.degeneration is not None:
                assert self._judge is not None
                self._flag(record, rid, comp.content, await self._judge.findings(comp.content))
            kind = KIND_DROPPED if (truncated and self.s.truncated == "drop") else KIND_COMPLETIONS
            line = _encode_record(record).encode()
            await queue.put(("ok", kind, digest, line, usage_in, usage_out, truncated))
        except FinalFailure as f:
            err = {
                "id": rid,
                "error": f.reason,
                "status": f.status,
                "attempts": f.attempts,
                "ts": time.time(),
            }
            await queue.put(("err", None, digest, self._error_line(err), 0, 0, False))
        except EndpointsDown:
            self._stopping = True
            self._inflight.discard(digest)
        except AuthRejected as exc:
            # not this prompt's fault: it stays pending for the run after the key is fixed
            self._inflight.discard(digest)
            if self._fatal is None:
                self._fatal = (self._auth_message(str(exc)), EXIT_USAGE)
            self._stopping = True
        except asyncio.CancelledError:
            self._inflight.discard(digest)
            raise
        except Exception as exc:
            # Whatever went wrong, the prompt ends as a record with its reason: a task is never dropped.
            log.exception("unexpected error while generating a prompt", extra=kv(id=rid))
            err = {
                "id": rid,
                "error": f"unexpected error ({type(exc).__name__}: {exc}); retried by the next run",
                "status": None,
                "attempts": 0,
                "ts": time.time(),
            }
            await queue.put(("err", None, digest, self._error_line(err), 0, 0, False))
        finally:
            sem.release()

    def _flag(self, record: dict[str, Any], rid: str, answer: str | None, findings: list | None) -> None:
        """Feed the last answer's findings to the rolling detector. A degenerate answer is kept, flagged in
        the record (`quality`); once the recent share passes the threshold the job stops, keeping what it
        wrote: a broken server must not fill the whole run with garbage. `findings` None: the judge was
        too far behind to check this answer (regen.jobs.generate.judging); it is counted, not judged."""
        assert self.degeneration is not None
        if findings is None:
            return
        findings = self.degeneration.add(answer, key=rid, judge=lambda _text: findings)
        if findings:
            record["quality"] = [str(f) for f in findings]
        if self.degeneration.tripped and self._fatal is None:
            self._fatal = (self.degeneration.message(), EXIT_UNAVAILABLE)
            self._stopping = True

    def _auth_message(self, reason: str) -> str:
        where = self.s.api_key_source
        if where:
            fix = f"check the API key in {where}"
        else:
            fix = (
                "no API key was sent: put the server's key in an environment variable and name it with "
                "--api-key-env (the completions role: completions_api_key)"
            )
        return (
            f"the server refused the request ({self._scrub(reason)}); stopped at once, every prompt left "
            f"is still pending: {fix}, then run again"
        )

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
            if self._fatal is not None and self._fatal[1] == EXIT_OUTPUT:
                # the output could not take the last batch: write nothing more (those prompts stay pending)
                for _, _, digest, *_ in items:
                    self._inflight.discard(digest)
                continue
            if store_items or error_lines:
                try:
                    await asyncio.to_thread(self._write_sync, store_items, error_lines, errors_fd)
                except OSError as exc:
                    self._output_failed(exc, len(store_items))
                    for _, _, digest, *_ in items:
                        self._inflight.discard(digest)
                    continue
                self._last_write = time.monotonic()
                self._written_records += len(store_items)
                self._written_bytes += sum(len(line) + 1 for _, _, line in store_items)
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
            self.meter.add(time.monotonic(), st.done + st.dropped + st.failed)
            self._tick(len(items))
            self._refresh_bar()
            self.status.maybe_write(self._status_doc)

    @contextlib.contextmanager
    def _preparing(self):
        """A full disk (or a read-only one) while the run is prepared (the ledger repaired, superseded
        completions moved aside, run.json written): one line that says nothing was generated and what
        is kept, instead of the bare OS error."""
        try:
            yield
        except OSError as exc:
            what = _OUTPUT_ERRNOS.get(exc.errno or -1)
            if what is None:
                raise
            found = sum(self.store.report.done_by_kind.values())
            raise OutputError(
                f"cannot write to {self.s.output_dir}: {what} ({exc.strerror or exc}) while the run was "
                f"being prepared (the ledger checked, superseded completions moved aside, run.json written); "
                f"this "
                f"run generated nothing, the {found} completion(s) found there are kept (a move aside that "
                "was cut short is finished by the next run); free space (or choose another --output-dir) "
                "and run again"
            ) from None

    def _output_failed(self, exc: OSError, lost: int) -> None:
        """The output stopped taking writes (full disk, read-only): stop, and say what was kept."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        written = self.stats.done + self.stats.dropped
        kept = len(self.store.index)
        accounted = written + self.stats.failed + self.stats.skipped + self.stats.duplicates
        remaining = (self.total - accounted) if self.total is not None else None
        avg = self._written_bytes / self._written_records if self._written_records else None
        need = ""
        if remaining is not None and avg is not None:
            need = f"; the {remaining} prompt(s) left need about {remaining * avg / 1e6:.1f} MB more"
        elif remaining is not None:
            need = f"; {remaining} prompt(s) are left"
        what = _OUTPUT_ERRNOS.get(exc.errno or -1, f"{exc.strerror or exc}")
        reason = (
            f"cannot write to {self.s.output_dir}: {what} ({exc.strerror or exc}); this run wrote "
            f"{written} record(s) before it, {kept} record(s) are kept in total (every one whole: a torn "
            f"last line is repaired by the next run), {lost} finished record(s) of the last batch were "
            f"not written and stay pending{need}; free space (or choose another --output-dir) and run again"
        )
        if self._fatal is None:
            self._fatal = (reason, EXIT_OUTPUT)
        log.error(reason)

    # ------------------------------------------------------------------ feeding

    async def _error_now(self, queue: asyncio.Queue, rid: str | None, where: str, reason: str) -> None:
        self.stats.invalid += 1
        err = {
            "id": rid,
            "input": where,
            "error": f"invalid input row: {reason} (not retryable: fix or remove it in the input)",
            "status": None,
            "attempts": 0,
            "retryable": False,
            "ts": time.time(),
        }
        await queue.put(("err", None, b"", self._error_line(err), 0, 0, False))

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

    # ------------------------------------------------------------------ main loop

    def _on_signal(self, signum: int) -> None:
        self._interrupted = signum
        if self._stop_deadline is None:
            self._stopping = True
            self._stop_deadline = time.monotonic() + self.s.stop_grace
            # a timer, not a check in the wait loop: the feeder may be blocked on a slot that only a
            # finished (or cut) request frees
            asyncio.get_running_loop().call_later(self.s.stop_grace, self._grace_over)
            log.warning(
                "stopping: no new prompts; waiting for requests in flight (signal again to abort them)",
                extra=kv(in_flight=len(self._inflight), grace=f"{self.s.stop_grace:g}s"),
            )
            return
        self._abort_in_flight("a second signal")

    def _grace_over(self) -> None:
        self._abort_in_flight(f"the stop grace of {self.s.stop_grace:g}s is over")

    def _abort_in_flight(self, why: str) -> None:
        if self._tasks:
            log.warning(
                f"aborting the requests in flight ({why}); their prompts stay pending for the next run",
                extra=kv(in_flight=len(self._inflight)),
            )
        for task in list(self._tasks):
            task.cancel()

    async def _heartbeat(self) -> None:
        """status.json rewritten every --status-interval even when nothing finishes: a reader tells a
        slow job (fresh `updated_at`, live `pid`) from a dead one (`regen.status.liveness`)."""
        while True:
            await asyncio.sleep(max(0.05, self.s.status_interval))
            if self._first_request is not None:
                # a reading while nothing finishes too: a stalled server empties the window (no ETA)
                st = self.stats
                self.meter.add(time.monotonic(), st.done + st.dropped + st.failed)
            self.status.maybe_write(self._status_doc, force=True)

    async def run(self) -> int:
        files = resolve_inputs(self.s.inputs)
        prepare_output_dir(self.s.output_dir)
        self.status.arm()  # from here on, an error ends as `failed` in status.json (run_main)
        # this run's document at once (state "starting"): a run that ends before its first request (a bad
        # manifest, SIGTERM while it checks the inputs) never leaves the last run's `done` for a reader
        self.status.maybe_write(self._status_doc, force=True)
        # before a single request: a shard cut short or edited since the prompts job wrote it, or a
        # damaged .gz, stops the job here, not after half of it was generated
        await asyncio.to_thread(verify_manifest, self.s.inputs)
        self.total = await asyncio.to_thread(lambda: sum(count_lines(p) for p in files))
        with self._preparing():
            report = self.store.open()
        try:
            if report.recovered_lines or report.truncated_bytes or report.ledger_dropped:
                log.info(
                    "recovered after an interrupted run",
                    extra=kv(**{k: v for k, v in report.as_dict().items() if v}),
                )
            self.check_config()
            errors_path = self.s.output_dir / "errors.jsonl"
            with self._preparing():
                await asyncio.to_thread(self.set_aside_stale, files)
                if errors_path.exists():
                    # this run retries those prompts; keep the last run's reasons next to it for reference
                    os.replace(errors_path, self.s.output_dir / "errors.previous.jsonl")
                errors_fd = os.open(errors_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._state = "running"
            self._bar = make_progress(self.s.progress, self.total, "generate")
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            counter = asyncio.create_task(self._heartbeat())
            queue: asyncio.Queue = asyncio.Queue()
            total_limit = self.s.concurrency * len(self.pool.endpoints)
            # Records waiting out a backoff hold no endpoint slot, so allow twice as many records in flight
            # as slots to keep every endpoint busy; memory stays bounded by this number.
            sem = asyncio.Semaphore(2 * total_limit)
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=75)
            writer = asyncio.create_task(self._writer(queue, errors_fd))
            self.status.maybe_write(self._status_doc, force=True)
            try:
                if self.degeneration is not None:
                    self._judge = Judge(self.s.judge_workers)
                    self._judge.start()
                async with aiohttp.ClientSession(connector=connector, auto_decompress=True) as session:
                    await self._feed(session, files, queue, sem)
                    while self._tasks:
                        await asyncio.wait(list(self._tasks), timeout=0.2)
                        if self.pool.fatal is not None or self._fatal is not None:
                            # requests still hanging on a dead server would only delay the exit
                            for task in list(self._tasks):
                                task.cancel()

            finally:
                await queue.put(None)
                await writer
                counter.cancel()
                os.close(errors_fd)
                if self._judge is not None:
                    self._judge.close()
                self.pool.close()
        finally:
            self.store.close()
        # The end is decided from here on (every request over, the store closed): the loop's handlers go
        # (asyncio would put back the default, SIGTERM's kill, when the loop closes) and late signals are
        # ignored, so a finished run cannot end as a killed one beside a status.json that says `done`.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
        stop_signals_done()
        st = self.stats
        if self._fatal is not None:
            self._state, code = "failed", self._fatal[1]
            print(f"error: {self._fatal[0]}", file=sys.stderr)
        elif self.pool.fatal is not None:
            self._state, code = "endpoints_down", EXIT_UNAVAILABLE
            log.error(str(self.pool.fatal) + "; unfinished prompts will be retried by the next run")
        elif self._interrupted:
            self._state, code = (
                "interrupted",
                (EXIT_INTERRUPTED if self._interrupted == signal.SIGINT else EXIT_TERMINATED),
            )
        elif st.failed:
            self._state, code = "failed", EXIT_FAILED_RECORDS
        else:
            self._state, code = "done", EXIT_OK
        if self._bar is not None:
            self._refresh_bar()
            self._bar.close()
        self.status.disarm()
        self.status.maybe_write(lambda: self._status_doc(exit_code=code), force=True, durable=True)
        print(self._status_doc(exit_code=code)["line"], flush=True)
        if st.failed:
            retryable = st.failed - st.invalid
            parts = []
            if retryable:
                parts.append(f"{retryable} prompt(s) failed and are retried by the next run")
            if st.invalid:
                parts.append(
                    f"{st.invalid} row(s) are invalid and are not retryable: fix or remove them in the input"
                )
            print(
                f"generate: {'; '.join(parts)}; reasons in {self.s.output_dir / 'errors.jsonl'}",
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
    total = pending = done = unreadable = duplicates = invalid = 0
    pending_ids: set[bytes] = set()
    batch: list[tuple[bytes, bytes]] = []

    def flush() -> None:
        nonlocal pending, done, duplicates, invalid
        known_flags = store.index.contains_many([d for d, _ in batch])
        for (d, raw), known in zip(batch, known_flags, strict=True):
            if known:
                done += 1
            elif d in pending_ids:
                duplicates += 1
            else:
                pending_ids.add(d)
                try:  # a row no run can generate is not work left: counted apart, so it stays visible
                    parse_prompt_row(json.loads(raw))
                except (ValueError, UnicodeDecodeError):
                    invalid += 1
                else:
                    pending += 1
        batch.clear()

    for path in files:
        for _, raw in iter_lines(path):
            total += 1
            rid = line_id(raw)
            if rid is None:
                unreadable += 1
                continue
            batch.append((id_digest(rid), raw))
            if len(batch) >= 4096:
                flush()
    flush()
    run_json = s.output_dir / "run.json"
    previous = previous_inputs = None
    if run_json.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            doc = json.loads(run_json.read_text())
            previous, previous_inputs = doc.get("provenance"), doc.get("inputs_sha256")
    has_output = done > 0 or store.shard_files() != []
    # prompts edited or removed since the last run: their completions are moved aside by the next run
    inputs_changed = has_output and previous_inputs != inputs_digest(files)
    config_matches = previous is None or previous == s.provenance()
    answer_changed = isinstance(previous, dict) and any(
        previous.get(k) != s.provenance().get(k) for k in ANSWER_KEYS
    )
    if answer_changed:
        # every completion there was made with the directory's settings: a run allowed to change them
        # (--allow-config-change) generates them all again
        pending, done = pending + done, 0
    return {
        "total": total,
        "pending": pending,
        "done": done,
        "unreadable": unreadable,
        "invalid": invalid,
        "duplicates": duplicates,
        # invalid rows keep it incomplete: the run reports them (errors.jsonl), never a silent pass
        "complete": pending == 0
        and unreadable == 0
        and invalid == 0
        and not inputs_changed
        and config_matches,
        "inputs_changed": inputs_changed,
        "config_matches": config_matches,
        "output_dir": str(s.output_dir),
    }
