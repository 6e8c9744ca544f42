"""A job's rate and time left, from what it measured over the last minutes of its own work.

The rate over the whole run says little about the time left: a resumed run skips its finished records
in seconds, a start-up takes a while, and a server's speed changes when a second endpoint joins or one
goes down. `RateMeter` keeps (time, count) readings of the work finished and gives the rate over the
last `window` seconds; `eta_s` divides what is left by it. Until `min_span` seconds of work and
`min_count` finished units have been seen there is no estimate (None), rather than a wild one.
"""

from __future__ import annotations

import collections
import math


class RateMeter:
    def __init__(self, window: float = 120.0, min_span: float = 2.0, min_count: int = 5):
        if window <= 0 or min_span < 0 or min_count < 1:
            raise ValueError("RateMeter needs window > 0, min_span >= 0, min_count >= 1")
        self.window = window
        self.min_span = min_span
        self.min_count = min_count
        self._spacing = window / 256  # readings kept at least this far apart
        self._readings: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, now: float, finished: float) -> None:
        """A reading: `finished` units done (a running total) at time `now` (monotonic seconds)."""
        readings = self._readings
        if readings and now <= readings[-1][0]:
            readings[-1] = (readings[-1][0], finished)
        elif len(readings) >= 2 and now - readings[-2][0] < self._spacing:
            # the newest reading moves forward instead of adding one: a job that writes hundreds of
            # batches a second keeps a few hundred readings per window, not one per batch
            readings[-1] = (now, finished)
        else:
            readings.append((now, finished))
        # keep one reading at or before the window's start, so the span covers the whole window
        while len(readings) > 2 and readings[1][0] <= now - self.window:
            readings.popleft()

    def rate(self) -> float | None:
        """Units per second over the window; None while there is too little to go on."""
        if len(self._readings) < 2:
            return None
        (t0, n0), (t1, n1) = self._readings[0], self._readings[-1]
        span, count = t1 - t0, n1 - n0
        if span < self.min_span or span <= 0 or count < self.min_count:
            return None
        return count / span

    def eta_s(self, remaining: float | None) -> float | None:
        """Seconds until `remaining` more units are done at the measured rate (0 when none are left)."""
        if remaining is None:
            return None
        if remaining <= 0:
            return 0.0
        rate = self.rate()
        if not rate:
            return None
        eta = remaining / rate
        return eta if math.isfinite(eta) else None


def fmt_eta(seconds: float | None) -> str:
    """`45s`, `12m05s`, `3h20m`, `2d04h`: a time left as an operator reads it ("?" when unknown)."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
