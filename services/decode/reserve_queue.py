"""Reserve calls waiting for KV room on a decode worker, granted on the engine loop.

Every tick grants every waiting call that fits: a small reservation is not held up by a
bigger one that does not fit yet (no head-of-line blocking), and a burst that fits is
granted in one tick, not one call per engine step. The calls take turns by request group
(the client request they came from: a prompt list's prompts are one group), round robin,
oldest first within a group, so another client's one Reserve is granted with the next
pages freed, not after every Reserve a prompt list queued ahead of it. So that a big call is
not starved by a stream of small ones, aging stops the passing: once a call that does not
fit has waited `aging_s`, nobody after it in that order is granted, and its group, served
least recently, comes first from then on: the pages freed accumulate for it. And the last
sixteenth of the pool goes only to groups holding less than their share of it counting one
group more: prompt lists that fill the pool between them (their requests hold their pages
until they finish, minutes on a slow machine) leave another client the pages to start.
Tenant quotas (shared/engine/tenant_quota.py) come first: while a call of a tenant within its
live share waits, the calls of tenants whose live work holds their share are passed over
(neither granted nor holding anyone up by their age; counted in `book.num_passed_over`,
exported as duet_kv_tenant_passed_over_total{stage="reserve"}); alone, they take their turns.

Runs on the engine-loop thread (add, withdraw, tick); a grant wakes its RPC through the
callback the call gave (thread-safe). The RPC's own deadline is its business: it withdraws
its wait, and a grant it will never take is freed at once (no writer was told of it)."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.decode.reservations import Reservation, ReservationBook
from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.engine.lora.adapter_files import LoraAdapterError

NEWCOMER_ROOM = 16  # 1/16 of the pool is kept for groups holding little of it


@dataclass(eq=False)
class ReserveWait:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    writer_id: str
    n: int
    prompt_ids: list[int] | None
    on_grant: Callable[[Reservation | None], None]  # on the loop thread (hand off thread-safely); None: never
    group: str = ""  # the client request it came from: calls take turns by group
    scope: CacheScope = DEFAULT_SCOPE  # its prefix-cache namespace and tenant (the tenant's live share)
    since: float = 0.0  # when it started waiting (the queue's clock)
    refusal: str = ""  # why it was refused outright (its LoRA adapter could not be loaded)
    granted: Reservation | None = field(default=None, repr=False)


class ReserveQueue:
    def __init__(self, book: ReservationBook, max_running: int, aging_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.book = book
        self.max_running = max_running
        self.aging_s = aging_s
        self.clock = clock
        self.waiting: list[ReserveWait] = []  # arrival order
        self._served: dict[str, int] = {}  # group -> when a call of it was last granted
        self._turns = itertools.count()

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
        if not book.fits(room, 1, 1):
            return False  # not even the smallest call fits: no need to order them
        held = book.pages_by_group()
        share = book.engine.kv.capacity / (len(set(held) | {w.group for w in self.waiting}) + 1)
        order = self._turn_order()
        passed = self._passed_over(order)
        first_passed = next((i for i, w in enumerate(order) if w in passed), len(order))
        for i, wait in enumerate(order):
            if wait in passed:
                continue
            if room.slots <= 0:
                break  # nothing fits without a batch slot
            need = book.engine.kv.pages_for(wait.prompt_tokens) + wait.n
            fits = book.fits(room, wait.prompt_tokens, wait.n)
            if fits and self._room_left(room, need, held.get(wait.group, 0), share):
                try:  # a LoRA adapter is loaded into a device slot here, before the answer
                    res = book.try_reserve(wait.request_id, wait.prompt_tokens, wait.max_tokens, wait.writer_id,
                                           self.max_running, wait.n, wait.prompt_ids, wait.scope, wait.group)
                except (LoraAdapterError, OSError) as exc:  # unloaded meanwhile, or its folder no longer reads
                    self.waiting.remove(wait)
                    wait.refusal = str(exc)
                    wait.on_grant(None)
                    continue
                if res is not None:
                    if i > first_passed:
                        book.num_passed_over += 1  # granted ahead of a tenant over its live share
                    self.waiting.remove(wait)
                    wait.granted = res
                    self._served[wait.group] = next(self._turns)
                    held[wait.group] = held.get(wait.group, 0) + need
                    wait.on_grant(res)
                    room = book.room(self.max_running)
                    continue
            if not fits and now - wait.since >= self.aging_s:
                break  # it has waited long enough: the room freed from now on is its (a group over
                # its share kept out of the newcomers' room waits without holding up anyone)
        if len(self._served) > 4 * (len(self.waiting) + 1024):  # forget groups long gone
            waiting = {w.group for w in self.waiting}
            self._served = {g: t for g, t in self._served.items() if g in waiting}
        return False

    def _room_left(self, room, need: int, held: int, share: float) -> bool:
        """Whether a call of a group holding `held` pages may take `need` more: into the pool's
        last sixteenth only while the group holds less than its share."""
        return held + need <= share or room.spare_pages - need >= self.book.engine.kv.capacity // NEWCOMER_ROOM

    def _passed_over(self, order: list[ReserveWait]) -> set[ReserveWait]:
        """The calls of tenants whose live work holds their share of the pool, while another
        tenant's call within its share waits (empty when none does: the order decides)."""
        over = self.book.engine.kv.over_live_share() if len(order) > 1 else None
        if over is None:
            return set()
        passed = {w for w in order if over(w.scope.tenant)}
        return passed if len(passed) < len(order) else set()

    def _turn_order(self) -> list[ReserveWait]:
        """Round robin over the groups: each group's first call, the group granted least
        recently first (never: first of all), then each group's second, and so on."""
        position: dict[str, int] = {}
        keyed = []
        for wait in self.waiting:  # arrival order
            k = position[wait.group] = position.get(wait.group, -1) + 1
            keyed.append(((k, self._served.get(wait.group, -1), wait.since), wait))
        return [wait for _, wait in sorted(keyed, key=lambda kw: kw[0])]
