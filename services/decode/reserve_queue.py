"""Reserve calls waiting for KV room on a decode worker, granted on the engine loop.

Every tick grants every waiting call that fits, in arrival order: a small reservation is
not held up by a bigger one at the head that does not fit yet (no head-of-line blocking),
and a burst that fits is granted in one tick, not one call per engine step. So that the big
one is not starved by a stream of small ones, aging stops the passing: once a call that
does not fit has waited `aging_s`, nobody behind it is granted until it is, and the pages
freed meanwhile accumulate for it.

Runs on the engine-loop thread (add, withdraw, tick); a grant wakes its RPC through the
callback the call gave (thread-safe). The RPC's own deadline is its business: it withdraws
its wait, and a grant it will never take is freed at once (no writer was told of it)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.decode.reservations import Reservation, ReservationBook


@dataclass(eq=False)
class ReserveWait:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    writer_id: str
    n: int
    prompt_ids: list[int] | None
    on_grant: Callable[[Reservation | None], None]  # on the loop thread (hand off thread-safely); None: never
    since: float = 0.0  # when it started waiting (the queue's clock)
    granted: Reservation | None = field(default=None, repr=False)


class ReserveQueue:
    def __init__(self, book: ReservationBook, max_running: int, aging_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.book = book
        self.max_running = max_running
        self.aging_s = aging_s
        self.clock = clock
        self.waiting: list[ReserveWait] = []  # arrival order

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, wait: ReserveWait) -> None:
        wait.since = self.clock()
        self.waiting.append(wait)
        self.tick()  # granted at once when it fits (and nobody aged waits ahead of it)

    def _refuse_dropped(self) -> None:
        """Its caller cancelled the request before the answer (cancel_request): never granted."""
        for wait in [w for w in self.waiting if w.request_id in self.book.dropped_requests]:
            self.waiting.remove(wait)
            wait.on_grant(None)

    def withdraw(self, wait: ReserveWait) -> None:
        """Its RPC gave up (deadline, or the caller left): drop the wait, or free the grant it
        never took (unsent: nobody was told of its pages)."""
        if wait in self.waiting:
            self.waiting.remove(wait)
        elif wait.granted is not None:
            self.book.cancel(wait.granted.reservation_id, wait.granted.generation, unsent=True)

    def tick(self) -> bool:
        """Grant what fits. Returns False: a waiting call needs room, which only the engine's
        progress (or a freed reservation) makes; the loop need not spin for it."""
        if not self.waiting:
            return False
        self._refuse_dropped()
        now, book = self.clock(), self.book
        room = book.room(self.max_running)
        for wait in list(self.waiting):
            if room.slots <= 0:
                break  # nothing fits without a batch slot
            if book.fits(room, wait.prompt_tokens, wait.n):
                res = book.try_reserve(wait.request_id, wait.prompt_tokens, wait.max_tokens, wait.writer_id,
                                       self.max_running, wait.n, wait.prompt_ids)
                if res is not None:
                    self.waiting.remove(wait)
                    wait.granted = res
                    wait.on_grant(res)
                    room = book.room(self.max_running)
                    continue
            if now - wait.since >= self.aging_s:
                break  # it has waited long enough: the room freed from now on is its
        return False
