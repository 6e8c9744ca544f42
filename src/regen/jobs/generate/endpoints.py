"""The endpoint pool: per-endpoint concurrency, least-loaded choice, circuit breaker, 429 pauses."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from regen.jobs._common import (
    kv,
)

log = logging.getLogger("regen.jobs.generate")

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
        if not self._waiters and self.outage_since is None and ep.state == "closed":
            # nobody to wake, and a healthy endpoint ends no outage and starts none: nothing to dispatch
            return
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
