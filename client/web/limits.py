"""Limits that keep a public server up: a token bucket per client address, and bounded generation slots.

Both are small and synchronous in their decisions, with the clock injected, so their tests need no sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from client.web.errors import APIError


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Allows `burst` requests at once per address, refilled at `per_min` requests per minute."""

    def __init__(self, per_min: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = per_min / 60.0
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def check(self, address: str) -> None:
        """Take one request from `address`'s bucket, or raise a 429 APIError saying when to retry."""
        now = self.clock()
        bucket = self._buckets.get(address)
        if bucket is None:
            self._forget_full(now)
            bucket = self._buckets[address] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens < 1.0:
            wait_s = (1.0 - bucket.tokens) / self.rate_per_s
            raise APIError(
                429,
                f"rate limit reached for your address: retry in {wait_s:.1f} s",
                "rate_limit_error",
                code="rate_limit_exceeded",
            )
        bucket.tokens -= 1.0

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled completely: they are the same as no bucket, and must not pile up."""
        refill_s = self.burst / self.rate_per_s
        for address in [a for a, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[address]


class GenerationSlots:
    """At most `running` generations at once and `queued` waiting; one more waiting is a 429."""

    def __init__(self, running: int, queued: int) -> None:
        self.running_limit = running
        self.queued_limit = queued
        self._free = asyncio.Semaphore(running)
        self.running = 0
        self.waiting = 0

    async def acquire(self) -> None:
        """Wait for a slot; a 429 APIError at once if the queue is full. Pair with `release`."""
        if self._free.locked() and self.waiting >= self.queued_limit:
            raise APIError(
                429,
                f"the server is busy: {self.running} generations running and {self.waiting} waiting",
                "rate_limit_error",
                code="queue_full",
            )
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._free.release()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
