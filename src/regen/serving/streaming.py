"""One streamed chat completion through the generation client's request shape, timed token by token.

The generation job asks for whole completions; the layout sweep (`regen.jobs.sweep`) needs to know when
the first token arrived and how fast the rest followed, which only a streamed response shows. The body is
the job's own (`Settings.base_body()`: model, max_tokens, sampling, chat_template_kwargs, extra body) with
`"stream": true` and `stream_options.include_usage`, so the server counts the output tokens itself; a
server that ignores `stream_options` (transformers serve) still sends `usage` on its last chunk, and one
that sends none is counted by content chunks and says so (`tokens_counted_by`).

`parse_sse_events` and `StreamTiming` are pure (unit-tested on recorded streams); `stream_completion` is
the aiohttp request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class StreamError(Exception):
    """The stream ended without a usable completion; the message says what the server sent instead."""


def parse_sse_events(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any] | None]:
    """The JSON payloads of a server-sent-event stream, one per `data:` line; None for `data: [DONE]`.

    Comment lines (`:` keep-alives), `event:`/`id:` fields and blank separators are skipped. A payload
    that is not JSON, or an `{"error": ...}` payload, raises StreamError with the server's words.
    """
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            yield None
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            raise StreamError(f"the stream sent a line that is not JSON ({exc}): {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise StreamError(f"the stream sent a JSON {type(event).__name__}, expected an object")
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(f"the server reported an error mid-stream: {message}")
        yield event


@dataclass
class StreamTiming:
    """What one streamed completion took: fed the events with their arrival times (seconds)."""

    started: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    content_chunks: int = 0
    content: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    def feed(self, event: dict[str, Any], now: float) -> None:
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            # Reasoning tokens are output tokens too: the first of either kind is the first token.
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if piece:
                self.content_chunks += 1
                self.content.append(delta.get("content") or "")
                if self.first_token_at is None:
                    self.first_token_at = now
                self.last_token_at = now
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def result(self, ended: float) -> dict[str, Any]:
        """The request's record: ttft_s, latency_s, output_tokens, tpot_s (None for one token)."""
        if self.first_token_at is None:
            raise StreamError("the stream ended without a single content token")
        tokens = None
        counted_by = "usage"
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            tokens = self.usage["completion_tokens"]
        if tokens is None:
            tokens, counted_by = self.content_chunks, "chunks"
        latency = ended - self.started
        ttft = self.first_token_at - self.started
        # Time per output token after the first (SGLang's bench_serving definition).
        tpot = (latency - ttft) / (tokens - 1) if tokens > 1 else None
        return {
            "ttft_s": ttft,
            "latency_s": latency,
            "tpot_s": tpot,
            "output_tokens": tokens,
            "prompt_tokens": (self.usage or {}).get("prompt_tokens"),
            "tokens_counted_by": counted_by,
            "finish_reason": self.finish_reason,
            "text": "".join(self.content),
        }


def streaming_body(base_body: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
    """The generation job's request body, streamed, asking the server to count the output tokens."""
    body = dict(base_body)
    body["messages"] = messages
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


async def stream_completion(
    session, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> dict[str, Any]:
    """POST one streamed chat completion and time it; raises StreamError (or aiohttp's errors)."""
    import aiohttp

    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    started = time.perf_counter()
    timing = StreamTiming(started=started)
    async with session.post(
        url, data=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        if resp.status != 200:
            text = (await resp.read())[:300].decode("utf-8", "replace")
            raise StreamError(f"HTTP {resp.status}: {text}")
        async for raw in resp.content:
            now = time.perf_counter()
            for event in parse_sse_events([raw]):
                if event is None:
                    break
                timing.feed(event, now)
    return timing.result(time.perf_counter())
