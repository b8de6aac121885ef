"""Bounded admission: at most `max_concurrent` requests generate at once, at most
`max_queued` more wait for a slot (first come, first served), and a request that finds
the queue full, or waits past `queue_timeout_s`, is refused (the HTTP layer answers 429
with Retry-After). Nothing piles up without bound: under 10x overload the gateway holds
max_concurrent + max_queued requests and refuses the rest at once.

One AdmissionQueue per gateway, used from the event loop only (no locks needed). A
Ticket is one request's place: `await ticket.acquire()`, then `ticket.release()` exactly
when the request's work ends (idempotent; a ticket never granted releases nothing).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class AdmissionRefused(Exception):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class AdmissionStats:
    active: int
    queued: int
    refused: int


class AdmissionQueue:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float, retry_after_s: float = 1.0):
        if max_concurrent < 0 or max_queued < 0 or queue_timeout_s < 0:
            raise ValueError("admission limits must be >= 0")
        self.max_concurrent = max_concurrent  # 0 = unbounded (no queue either)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s  # 0 = wait without a deadline
        self.retry_after_s = retry_after_s
        self.active = 0
        self.refused = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.active, self.queued, self.refused)

    def ticket(self) -> "Ticket":
        return Ticket(self)

    async def _acquire(self) -> None:
        if self.max_concurrent == 0:
            self.active += 1
            return
        if self.active < self.max_concurrent and not self.queued:
            self.active += 1
            return
        if self.queued >= self.max_queued:
            raise self._refuse(f"{self.active} requests running and {self.queued} waiting")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s or None)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted just as we gave up: pass the slot on
            else:
                waiter.cancel()
                self._discard(waiter)
            raise
        # _release counted us in when it granted the slot

    def _refuse(self, why: str) -> AdmissionRefused:
        self.refused += 1
        return AdmissionRefused(f"the gateway is at capacity ({why})", self.retry_after_s)

    def _discard(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _release(self) -> None:
        self.active -= 1
        assert self.active >= 0, "admission slot released twice"
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.active += 1  # the slot goes straight to the first live waiter
                waiter.set_result(None)
                return


class Ticket:
    """One request's place in the AdmissionQueue."""

    def __init__(self, queue: AdmissionQueue):
        self._queue = queue
        self._held = False

    async def acquire(self) -> None:
        """Wait for a slot; raise AdmissionRefused when the queue is full or the wait times out."""
        try:
            await self._queue._acquire()
        except asyncio.TimeoutError:
            raise self._queue._refuse(f"no slot within {self._queue.queue_timeout_s:g}s") from None
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._queue._release()


def register_admission_metrics(registry, queue: AdmissionQueue) -> None:
    """Gauges read at scrape time: requests generating, waiting, and refused so far."""
    from prometheus_client import Gauge

    Gauge("duet_gateway_admitted_requests", "Requests holding an admission slot",
          registry=registry).set_function(lambda: queue.active)
    Gauge("duet_gateway_queued_requests", "Requests waiting for an admission slot",
          registry=registry).set_function(lambda: queue.queued)
    Gauge("duet_gateway_refused_requests", "Requests refused by admission (429) since start",
          registry=registry).set_function(lambda: queue.refused)
