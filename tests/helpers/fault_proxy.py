"""A STUB fault-injection proxy on loopback, between a client and a real OpenAI-compatible server.

Not a model server and not a load balancer: it forwards every request to one upstream server (the real
one: `transformers serve` with the demo model, SGLang) byte for byte and its answer back, unless a fault
is switched on. It exists for the fault campaign (`tests.helpers.fault_campaign`), which needs the real
server's answers and, on demand, the failures a real deployment produces rarely and unpredictably:

  errors(rate, statuses)   a share `rate` of requests is answered with one of `statuses` (e.g. 500, 503,
                           429 with Retry-After, 400) without reaching the server
  hang()                   requests are held without an answer (a hung server, a stuck load balancer)
                           until `clear()`; then they are forwarded, unless the client gave up meanwhile
  clear()                  back to forwarding everything

An upstream that is down (connection refused, reset) is passed on as a connection closed without an
answer, as the client would have seen without the proxy. `stats` counts what happened.

    with FaultProxy("http://127.0.0.1:30000") as proxy:   # proxy.url is the endpoint to give the client
        proxy.errors(1.0, (503,)); ...; proxy.clear()

It binds loopback only.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from tests.helpers.threaded_app import LOOPBACK, ThreadedApp

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}
)


class FaultProxy(ThreadedApp):
    """The proxy in a background thread of the calling process; switch faults from any thread."""

    thread_name = "fault-proxy"

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, seed: int = 0):
        if host not in LOOPBACK:
            raise ValueError(f"the fault proxy binds loopback only, not {host!r}")
        super().__init__(host, port)
        self.upstream = upstream.rstrip("/")
        self.stats: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._error_rate = 0.0
        self._statuses: tuple[int, ...] = (503,)
        self._hanging = False
        self._released: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ switches (any thread)

    def errors(self, rate: float, statuses: Sequence[int] = (503,)) -> None:
        with self._lock:
            self._error_rate = max(0.0, min(1.0, rate))
            self._statuses = tuple(statuses) or (503,)

    def hang(self) -> None:
        with self._lock:
            self._hanging = True
        self.call_in_loop(self._reset_release)

    def clear(self) -> None:
        with self._lock:
            self._error_rate = 0.0
            self._hanging = False
        self.call_in_loop(self._release)

    def _reset_release(self) -> None:
        if self._released is not None and self._released.is_set():
            self._released = asyncio.Event()

    def _release(self) -> None:
        if self._released is not None:
            self._released.set()

    # ------------------------------------------------------------------ serving

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        body = await request.read()
        with self._lock:
            hanging = self._hanging
            inject = self._error_rate > 0 and self._rng.random() < self._error_rate
            status = self._rng.choice(self._statuses)
        if hanging:
            self.stats["held"] += 1
            assert self._released is not None
            await self._released.wait()  # cancelled when the client gives up: nothing is forwarded
        elif inject:
            self.stats[f"injected_{status}"] += 1
            headers = {"Retry-After": "0.2"} if status == 429 else {}
            return web.json_response(
                {"error": {"message": f"fault proxy (stub): injected HTTP {status}", "code": status}},
                status=status,
                headers=headers,
            )
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers
            ) as upstream:
                data = await upstream.read()
                self.stats["forwarded"] += 1
                out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
                return web.Response(body=data, status=upstream.status, headers=out)
        except (aiohttp.ClientError, OSError):
            # the server is down: the client sees what it would see without the proxy, a dead connection
            self.stats["upstream_down"] += 1
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise web.HTTPBadGateway() from None

    async def on_start(self) -> None:
        self._released = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def on_stop(self) -> None:
        self._release()
        if self._session is not None:
            await self._session.close()
