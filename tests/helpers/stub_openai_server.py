"""A STUB OpenAI-compatible chat-completions server on loopback, for fault injection and benchmarks.

This is not a model server: it answers `/v1/chat/completions` with deterministic filler text after a
fixed delay, so that the generation client can be measured against a known limit and exercised against
failures a real server produces rarely and unpredictably. Real-server behaviour is tested against the
demo model served by the serving role; this stub exists for what that cannot do on demand.

Fault switches (all off by default; each `*_rate` is a probability per request):
  --error-rate R --error-status 429,500,503   HTTP errors (429 carries `Retry-After: --retry-after`)
  --reset-rate R                              the connection is aborted without an answer
  --stall-rate R --stall-seconds S            the answer is held back for S seconds (a hung server)
  --malformed-rate R                          status 200 with a body that is not valid JSON
  --length-rate R                             finish_reason "length" (a truncated completion)
  --fail-first N --fail-kind KIND             the first N attempts of every distinct request fail
                                              (KIND: 429, 500, 503, reset, stall, malformed)
  --fail-match TEXT --fail-kind KIND          requests whose last user turn contains TEXT always fail
                                              (poison prompts)
  --down                                      every request fails (503, or resets with --down-mode reset)
  --reasoning never|always|when_thinking      add `reasoning_content` (when_thinking: only when
                                              chat_template_kwargs has thinking/enable_thinking true)
  --replies-json '{"TEXT": "ANSWER"}'         canned answers: a request whose last user turn contains
                                              TEXT is answered with ANSWER (first match wins), e.g. right
                                              and wrong answers for the quality gate's probes
All switches can be changed at run time: `POST /stub/config` with a JSON object of the same names
(underscores), and `GET /stub/stats` returns counters; `GET /stub/requests` the recorded requests
({path, authorization, body}) when started with --record.

Run: `python -m tests.helpers.stub_openai_server --port 0 --delay 0.2` prints `STUB_URL=http://127.0.0.1:PORT`.
It refuses to bind anything but a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from regen.module_utils.regen_net import is_loopback
from tests.helpers.threaded_app import ThreadedApp

FAIL_KINDS = ("429", "500", "503", "reset", "stall", "malformed")


@dataclasses.dataclass
class StubConfig:
    delay: float = 0.0
    jitter: float = 0.0
    tokens: int = 16
    error_rate: float = 0.0
    error_status: tuple[int, ...] = (503,)
    retry_after: float | None = 1.0
    reset_rate: float = 0.0
    stall_rate: float = 0.0
    stall_seconds: float = 3600.0
    malformed_rate: float = 0.0
    length_rate: float = 0.0
    fail_first: int = 0
    fail_kind: str = "503"
    fail_match: str | None = None
    down: bool = False
    down_mode: str = "503"
    reasoning: str = "never"
    replies: dict[str, str] = dataclasses.field(default_factory=dict)
    model_name: str = "stub-model"
    record: bool = False
    seed: int = 0

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in changes.items():
            if key not in names:
                raise ValueError(f"unknown stub setting {key!r}; known: {sorted(names)}")
            if key == "error_status":
                value = tuple(int(v) for v in (value if isinstance(value, list | tuple) else [value]))
            if key == "replies" and not (
                isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
            ):
                raise ValueError("replies must be an object of {substring: answer text}")
            if key == "fail_kind" and str(value) not in FAIL_KINDS:
                raise ValueError(f"fail_kind must be one of {FAIL_KINDS}")
            setattr(self, key, value)


@functools.lru_cache(maxsize=256)
def _words(n: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(max(0, n)))


def _prompt_tokens(messages: list[dict]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content.split()) + 4
    return total


class StubApp:
    """The aiohttp application; state lives here so tests can read counters and change faults."""

    def __init__(self, config: StubConfig):
        self.config = config
        self.stats: Counter[str] = Counter()
        self.requests: list[dict] = []
        self._attempts: Counter[str] = Counter()
        self._rng = random.Random(config.seed)
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        r = self.app.router
        for prefix in ("/v1", ""):
            r.add_post(f"{prefix}/chat/completions", self.chat)
            r.add_get(f"{prefix}/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/stub/stats", self.get_stats)
        r.add_get("/stub/requests", self.get_requests)
        r.add_post("/stub/config", self.set_config)

    # ------------------------------------------------------------------ control endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.config.model_name, "object": "model", "owned_by": "regen-stub"}],
            }
        )

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.stats))

    async def get_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            self.config.update(await request.json())
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(dataclasses.asdict(self.config))

    # ------------------------------------------------------------------ faults

    async def _fault(self, kind: str, request: web.Request) -> web.StreamResponse:
        self.stats[f"fault_{kind}"] += 1
        if kind == "reset":
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # nothing is sent; aiohttp drops the handler quietly
        if kind == "stall":
            await asyncio.sleep(self.config.stall_seconds)
            kind = "503"
        if kind == "malformed":
            return web.Response(
                body=b'{"id": "stub", "choices": [{"message": ', status=200, content_type="application/json"
            )
        status = int(kind)
        headers = {}
        if status == 429 and self.config.retry_after is not None:
            headers["Retry-After"] = f"{self.config.retry_after:g}"
        return web.json_response(
            {"error": {"message": f"stub injected HTTP {status}", "code": status}},
            status=status,
            headers=headers,
        )

    def _pick_fault(self, key: str, last_user: str) -> str | None:
        c = self.config
        if c.down:
            return "reset" if c.down_mode == "reset" else "503"
        if c.fail_match and c.fail_match in last_user:
            return c.fail_kind
        if c.fail_first:
            self._attempts[key] += 1
            if self._attempts[key] <= c.fail_first:
                return c.fail_kind
        rng = self._rng
        if c.error_rate and rng.random() < c.error_rate:
            return str(rng.choice(c.error_status))
        if c.reset_rate and rng.random() < c.reset_rate:
            return "reset"
        if c.stall_rate and rng.random() < c.stall_rate:
            return "stall"
        if c.malformed_rate and rng.random() < c.malformed_rate:
            return "malformed"
        return None

    # ------------------------------------------------------------------ chat completions

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.stats["requests"] += 1
        try:
            body = json.loads(raw)
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
        except (ValueError, KeyError, TypeError) as exc:
            self.stats["bad_request"] += 1
            return web.json_response({"error": {"message": f"bad request: {exc}"}}, status=400)
        c = self.config
        if c.record:
            self.requests.append(
                {"path": request.path, "authorization": request.headers.get("Authorization"), "body": body}
            )
        # the per-request key is only needed to count attempts of the same request (--fail-first)
        key = (
            hashlib.blake2b(json.dumps(messages, sort_keys=True).encode(), digest_size=8).hexdigest()
            if c.fail_first
            else str(self.stats["requests"])
        )
        last_user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
        fault = self._pick_fault(key, str(last_user))
        if fault is not None:
            return await self._fault(fault, request)
        delay = c.delay + (self._rng.uniform(0, c.jitter) if c.jitter else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        turn = sum(1 for m in messages if m.get("role") == "assistant") + 1
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 1 << 30
        n_out = min(c.tokens, int(max_tokens))
        truncated = n_out < c.tokens or (c.length_rate and self._rng.random() < c.length_rate)
        canned = next((text for needle, text in c.replies.items() if needle in str(last_user)), None)
        if canned is not None:
            content, n_out, truncated = canned, len(canned.split()), False
        else:
            content = f"stub reply {turn} to: {str(last_user)[:60]} | {_words(max(0, n_out - 8))}"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
        if c.reasoning == "always" or (c.reasoning == "when_thinking" and thinking):
            message["reasoning_content"] = f"stub reasoning about: {str(last_user)[:40]}"
        prompt_tokens = _prompt_tokens(messages)
        doc = {
            "id": f"chatcmpl-stub-{key}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or c.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": "length" if truncated else "stop"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n_out,
                "total_tokens": prompt_tokens + n_out,
            },
        }
        self.stats["ok"] += 1
        return web.Response(body=json.dumps(doc).encode(), content_type="application/json")


def _check_loopback(host: str) -> None:
    if is_loopback(host):
        return
    raise SystemExit(f"error: the stub only binds loopback addresses, not {host!r}")


class StubServer(ThreadedApp):
    """Run the stub in a background thread (tests): `with StubServer(StubConfig(delay=0.01)) as s: s.url`."""

    thread_name = "stub-openai-server"

    def __init__(self, config: StubConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        _check_loopback(host)
        super().__init__(host, port)
        self.config = config or StubConfig()
        self.stub = StubApp(self.config)

    @property
    def stats(self) -> Counter[str]:
        return self.stub.stats

    @property
    def requests(self) -> list[dict]:
        return self.stub.requests

    def configure(self, **changes: Any) -> None:
        self.config.update(changes)

    def make_app(self) -> web.Application:
        return self.stub.app


_CHECKOUT = Path(__file__).resolve().parents[2]


def spawn(args: list[str], python: str | None = None, timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start the stub as its own process (benchmarks, kill tests); return (process, base URL)."""
    proc = subprocess.Popen(
        [python or sys.executable, "-m", "tests.helpers.stub_openai_server", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=_CHECKOUT,  # `-m tests.helpers...` resolves from the checkout, whatever the caller's directory
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("STUB_URL="):
            return proc, line.strip().split("=", 1)[1]
    proc.kill()
    raise RuntimeError("the stub server did not start")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.helpers.stub_openai_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    p.add_argument("--jitter", type=float, default=0.0, help="extra uniform random delay up to this")
    p.add_argument("--tokens", type=int, default=16, help="completion length in filler words")
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--error-status", default="503", help="comma-separated statuses, e.g. 429,500,503")
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds sent with 429")
    p.add_argument("--reset-rate", type=float, default=0.0)
    p.add_argument("--stall-rate", type=float, default=0.0)
    p.add_argument("--stall-seconds", type=float, default=3600.0)
    p.add_argument("--malformed-rate", type=float, default=0.0)
    p.add_argument("--length-rate", type=float, default=0.0)
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--fail-kind", default="503", choices=FAIL_KINDS)
    p.add_argument("--fail-match", help="requests whose last user turn contains this always fail")
    p.add_argument("--down", action="store_true")
    p.add_argument("--down-mode", default="503", choices=("503", "reset"))
    p.add_argument("--reasoning", default="never", choices=("never", "always", "when_thinking"))
    p.add_argument("--replies-json", default="{}", help='canned answers, e.g. {"capital": "Paris"}')
    p.add_argument("--model-name", default="stub-model")
    p.add_argument("--record", action="store_true", help="keep request bodies for GET /stub/requests")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    _check_loopback(a.host)
    replies = json.loads(a.replies_json)
    if not isinstance(replies, dict):
        raise SystemExit("error: --replies-json must be a JSON object of {substring: answer}")
    config = StubConfig(
        delay=a.delay,
        jitter=a.jitter,
        tokens=a.tokens,
        error_rate=a.error_rate,
        error_status=tuple(int(s) for s in a.error_status.split(",") if s),
        retry_after=a.retry_after,
        reset_rate=a.reset_rate,
        stall_rate=a.stall_rate,
        stall_seconds=a.stall_seconds,
        malformed_rate=a.malformed_rate,
        length_rate=a.length_rate,
        fail_first=a.fail_first,
        fail_kind=a.fail_kind,
        fail_match=a.fail_match,
        down=a.down,
        down_mode=a.down_mode,
        reasoning=a.reasoning,
        replies={str(k): str(v) for k, v in replies.items()},
        model_name=a.model_name,
        record=a.record,
        seed=a.seed,
    )
    stub = StubApp(config)

    async def serve() -> None:
        runner = web.AppRunner(stub.app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, a.host, a.port, reuse_address=True, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(f"STUB_URL=http://{a.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
