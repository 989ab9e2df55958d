"""The gateway's own backpressure: a bound on requests served at once. Pure logic, no I/O.

Past `limit` requests in flight, a new one is refused at once (503 with Retry-After) before its
body is parsed or tokenized: under overload the cheapest answer is the one that does the least
work. Retry-After is how long the requests in flight take to clear at the recent completion rate,
so clients that honour it come back when there is room.
"""

from __future__ import annotations

import math


class InflightLimit:
    def __init__(self, limit: int, rate_alpha: float = 0.2, min_retry_s: float = 1.0, max_retry_s: float = 30.0):
        if limit < 1:
            raise ValueError("the in-flight limit must be at least 1")
        self.limit = limit
        self.inflight = 0
        self.refused = 0
        self.rate_alpha, self.min_retry_s, self.max_retry_s = rate_alpha, min_retry_s, max_retry_s
        self._rate = 0.0  # completions per second (EWMA over one-second periods)
        self._period_start: float | None = None
        self._period_done = 0

    def try_acquire(self) -> bool:
        if self.inflight >= self.limit:
            self.refused += 1
            return False
        self.inflight += 1
        return True

    def release(self, now: float) -> None:
        self.inflight -= 1
        self._period_done += 1
        self._roll(now)

    def _roll(self, now: float) -> None:
        if self._period_start is None:
            self._period_start = now
            return
        elapsed = now - self._period_start
        if elapsed >= 1.0:
            rate = self._period_done / elapsed
            self._rate = rate if self._rate == 0 else (1 - self.rate_alpha) * self._rate + self.rate_alpha * rate
            self._period_start, self._period_done = now, 0

    def retry_after(self) -> float:
        """Seconds until the requests in flight have most likely finished."""
        if self._rate <= 0:
            return self.min_retry_s
        return min(max(math.ceil(self.inflight / self._rate), self.min_retry_s), self.max_retry_s)
