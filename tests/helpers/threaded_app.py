"""An aiohttp application served on loopback from a background thread of the calling process.

The plumbing the fault-injection stubs share (`stub_openai_server.StubServer`, `fault_proxy.FaultProxy`):
its own event loop in a daemon thread, start that waits until the port is bound (and re-raises a bind
error in the caller), stop that cleans the app up inside its loop, and `with` support. A subclass gives
the application (`make_app`) and may add work to `on_start` / `on_stop` inside the loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from aiohttp import web

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class ThreadedApp:
    """Serves `make_app()` on host:port (0: a free port, read back after start) until `stop()`."""

    thread_name = "threaded-app"

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def make_app(self) -> web.Application:
        raise NotImplementedError

    async def on_start(self) -> None:
        """Inside the loop, before the app is served."""

    async def on_stop(self) -> None:
        """Inside the loop, after the app was cleaned up."""

    async def _serve(self) -> None:
        await self.on_start()
        app = self.make_app()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.on_stop()

    def start(self) -> Self:
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:
                error.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.thread_name, daemon=True)
        self._thread.start()
        ready.wait(30)
        if error:
            raise error[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop = None

    def call_in_loop(self, callback) -> None:
        """Run `callback()` in the server's loop (thread-safe); nothing when it is not running."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(callback)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
