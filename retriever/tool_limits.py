"""Limits on calls to the search tool, shared by every client of one server (``retriever.tool_limits``).

- a cap on the queries in flight to the tool at once (``max_concurrent``; 0 = no cap);
- a rate limit as a token bucket (``rate_per_s`` tokens a second, at most ``burst`` stored; 0 = off).

A query is one call of the tool: a request of ``n`` queries takes ``n`` slots and ``n`` tokens (a request of more
queries than the cap takes every slot; one of more than ``burst`` waits for a full bucket and leaves it in debt, so
the rate holds on average). A call that hits a limit WAITS, first come first served, until a slot and its tokens
are free; it is never refused. A caller that goes away while waiting (``alive()`` false, checked every
``poll_s``) leaves the queue with :class:`ClientGone`.

``clock`` and ``sleep`` are injectable so tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Awaitable, Callable


class ClientGone(Exception):
    """The client disconnected (gave up) before its queries reached the backend; they were not searched."""


def _always_alive() -> bool:
    return True


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` stored; starts full."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
        if not rate_per_s > 0 or not burst >= 1:
            raise ValueError(f"a token bucket needs rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.clock = clock
        self.tokens = self.burst
        self._last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now

    def wait_time(self, n: int = 1) -> float:
        """Seconds until ``n`` tokens may be taken (0: now). More than ``burst`` waits for a full bucket."""
        self._refill()
        missing = min(float(n), self.burst) - self.tokens
        return 0.0 if missing <= 1e-9 else missing / self.rate

    def take(self, n: int = 1) -> None:
        """Take ``n`` tokens (the bucket may go negative: a debt the next calls wait out)."""
        self._refill()
        self.tokens -= n

    def try_take(self, n: int = 1) -> float:
        """Take ``n`` tokens if they are there and return 0; else take none and return the seconds to wait."""
        wait = self.wait_time(n)
        if wait == 0.0:
            self.tokens -= n
        return wait


def default_burst(rate_per_s: float) -> int:
    """The bucket size when none is given: one second's worth, at least 1."""
    return max(1, math.ceil(rate_per_s))


class ToolLimiter:
    """First-come-first-served admission of tool calls under a concurrency cap and a token bucket.

    ``waited, seconds = await limiter.acquire(n, alive)`` ... ``limiter.release(n)``; with neither limit set,
    ``acquire`` returns at once without yielding to the loop.
    """

    def __init__(
        self,
        max_concurrent: int = 0,
        rate_per_s: float = 0.0,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        poll_s: float = 0.25,
    ):
        if max_concurrent < 0 or rate_per_s < 0 or burst < 0:
            raise ValueError("tool limits must be >= 0")
        self.max_concurrent = max_concurrent
        self.bucket = (
            TokenBucket(rate_per_s, burst or default_burst(rate_per_s), clock) if rate_per_s > 0 else None
        )
        self.clock = clock
        self.sleep = sleep
        self.poll_s = poll_s
        self.slots_used = 0  # slots held (a request of more queries than the cap holds max_concurrent)
        self._queue: deque[object] = deque()
        self._changed: asyncio.Event | None = None

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.bucket is not None

    @property
    def waiting(self) -> int:
        """Requests queued at the limit."""
        return len(self._queue)

    def _slots(self, n: int) -> int:
        return min(n, self.max_concurrent) if self.max_concurrent else n

    def _fits(self, n: int) -> bool:
        return not self.max_concurrent or self.slots_used + self._slots(n) <= self.max_concurrent

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), self.poll_s)
        except asyncio.TimeoutError:
            pass

    async def acquire(
        self, n: int = 1, alive: Callable[[], bool] = _always_alive, on_wait: Callable[[], None] | None = None
    ) -> tuple[bool, float]:
        """Wait until ``n`` queries may call the tool; ``(waited, seconds waited)``. ``on_wait()`` is called once
        when the call has to wait (before waiting). Raises :class:`ClientGone` when ``alive()`` turns false while
        waiting."""
        n = max(1, n)
        if not self._queue and self._fits(n) and (self.bucket is None or self.bucket.try_take(n) == 0.0):
            self.slots_used += self._slots(n)
            return False, 0.0
        if on_wait is not None:
            on_wait()
        start = self.clock()
        ticket = object()
        self._queue.append(ticket)
        try:
            while True:
                if not alive():
                    raise ClientGone()
                if self._queue[0] is ticket and self._fits(n):
                    wait = self.bucket.try_take(n) if self.bucket is not None else 0.0
                    if wait == 0.0:
                        break
                    await self.sleep(min(wait, self.poll_s))  # the head of the queue waits for its tokens
                else:
                    await self._wait_change()  # for a slot, or for the requests ahead
        finally:
            if self._queue and self._queue[0] is ticket:
                self._queue.popleft()
            elif ticket in self._queue:
                self._queue.remove(ticket)
            self._notify()  # the next one may go now (or, if this one left, the one after it)
        self.slots_used += self._slots(n)
        return True, self.clock() - start

    def release(self, n: int = 1) -> None:
        self.slots_used -= self._slots(max(1, n))
        self._notify()
