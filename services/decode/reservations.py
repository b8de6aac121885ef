"""Decode side of the handoff: reserved pages, completion notices, and the rule that
reserved pages are never reused while a write into them may still land.

Runs on the engine-loop thread. A reservation is freed when it is consumed by a decode,
or, once cancelled, when its notice (done or abort) arrives, or when its writer has left
the registry, or `quarantine_s` after the cancel (longer than prefill's own write timeout;
the writer's RPC is cancelled with it). Prefill sends an abort notice for every request it
gives up on (cancelled or refused at any point), so the quarantine is the last resort. A
cancel that says the reservation never reached a prefill worker frees it at once (nobody
can write into pages nobody was told about), as does a cancel by request id for a Reserve
whose answer never reached its caller (and a later Reserve for that request is refused).
One nobody cancels or claims (its gateway died) is freed once no write can land: at once
after an abort notice, `claim_timeout_s` after a done notice or after its writer left the
registry. Each rule and the test that proves it: docs/ARCHITECTURE.md,
"Failure rules"."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.kv_transfer.notice import TransferNotice

log = logging.getLogger("duet.decode")

DROPPED_REQUESTS_KEPT = 4096  # request ids cancel_request() refuses later Reserves for


@dataclass(eq=False)
class Reservation:
    reservation_id: int
    generation: int
    request_id: str
    page_ids: list[int]
    writer_id: str
    prompt_tokens: int
    held_pages: int = 0  # leading prompt pages this worker already held (the writer skips them)
    created: float = field(default_factory=time.monotonic)
    notice: TransferNotice | None = None  # set once every rank reported (see ReservationBook.tick)
    notice_at: float | None = None
    rank_notices: dict[int, TransferNotice] = field(default_factory=dict)
    cancelled: bool = False
    cancelled_at: float | None = None
    unsent: bool = False  # its caller never gave it to a prefill worker: no write can land
    settled_at: float | None = None  # unclaimed, and no write can land any more, since then
    waiter: Callable[[], None] | None = None  # wakes the Generate handler (set: it is claimed)
    ready_event: object = None  # CUDA event: launched GPU work that may touch the pages has run

    @property
    def key(self) -> str:
        return f"res-{self.reservation_id}"


class ReservationBook:
    def __init__(self, engine, agent, is_live: Callable[[str], bool], quarantine_s: float = 60.0,
                 metrics=None, claim_timeout_s: float = 30.0, num_ranks: int = 1):
        """num_ranks: notices a reservation waits for when a notice does not say (its
        num_ranks): every rank of the prefill worker writes its heads and sends its own
        notice here, and a reservation is written (or aborted) only when all of them have."""
        self.engine = engine
        self.agent = agent
        self.is_live = is_live
        self.quarantine_s = quarantine_s
        self.claim_timeout_s = claim_timeout_s
        self.metrics = metrics
        self.num_ranks = num_ranks
        self.open: dict[int, Reservation] = {}
        self.dropped_requests: OrderedDict[str, None] = OrderedDict()  # cancel_request() ids (bounded)
        self._ids = itertools.count(1)
        self.generation = 1  # ids are never reused in one instance; the nonce covers restarts
        self.num_passed_over = 0  # reservations made ahead of a tenant over its live share

    # -- admission --------------------------------------------------------------------------
    def try_reserve(self, request_id: str, prompt_tokens: int, max_tokens: int, writer_id: str,
                    max_running: int, n: int = 1, prompt_ids: list[int] | None = None,
                    scope: CacheScope = DEFAULT_SCOPE) -> Reservation | None:
        """n > 1: the request forks into n sequences sharing the prompt's pages. prompt_ids:
        the leading pages of it this worker holds (under scope's namespace) are reused
        (page_ids then lists only the pages the writer fills, from `held_pages` on)."""
        if request_id in self.dropped_requests:
            return None  # its caller gave up before an answer (cancel_request): never again
        eng = self.engine
        running = len(eng.scheduler.running) + len(self.open)
        if running + n - 1 >= max_running:
            return None
        need = eng.kv.pages_for(prompt_tokens)  # at most: held pages need none
        # leave one page per running request for its next decode step, plus this one's
        # first (one per sequence: each copies the prompt's last page and grows on its own)
        headroom = sum(1 for r in eng.scheduler.running if r.is_decoding) + n
        if eng.kv.available - need < headroom:
            return None
        rid = next(self._ids)
        res = Reservation(rid, self.generation, request_id, [], writer_id, prompt_tokens)
        kv = eng.reserve(res.key, prompt_tokens, prompt_ids, scope)
        if kv is None:
            return None
        res.page_ids, res.held_pages = kv.fresh_pages, len(kv.held_pages)
        # a step launched before these pages were freed may still write them (overlap
        # scheduling): the reservation is handed out once that work has run
        res.ready_event = eng.launched_work_event()
        self.open[rid] = res
        return res

    def get(self, reservation_id: int, generation: int) -> Reservation | None:
        res = self.open.get(reservation_id)
        return res if res is not None and res.generation == generation else None

    # -- lifecycle ----------------------------------------------------------------------------
    def consume(self, res: Reservation) -> None:
        """The reservation's pages now belong to a running request (engine.add_prefilled)."""
        self.open.pop(res.reservation_id, None)

    def cancel(self, reservation_id: int, generation: int, unsent: bool = False) -> bool:
        """unsent: the caller never gave the reservation to a prefill worker."""
        res = self.get(reservation_id, generation)
        if res is None:
            return False
        res.cancelled, res.waiter = True, None
        res.unsent = res.unsent or unsent
        if res.cancelled_at is None:
            res.cancelled_at = time.monotonic()
        self._maybe_free(res)
        return True

    def cancel_request(self, request_id: str) -> bool:
        """The caller's Reserve for request_id got no answer: free whatever it made (the
        caller never learnt its pages, so it sent them to no writer) and refuse a later one."""
        self.dropped_requests[request_id] = None
        while len(self.dropped_requests) > DROPPED_REQUESTS_KEPT:
            self.dropped_requests.popitem(last=False)
        found = [r for r in self.open.values() if r.request_id == request_id and r.waiter is None]
        for res in found:
            self.cancel(res.reservation_id, res.generation, unsent=True)
        return bool(found)

    def writes_may_land(self, res: Reservation) -> bool:
        if res.notice is not None or res.unsent:
            return False
        if not self.is_live(res.writer_id):
            return False
        # A live writer may still be computing (and writing) a long prompt: only a cancel,
        # which also cancels its RPC, starts the clock on its last in-flight write.
        return res.cancelled_at is None or time.monotonic() - res.cancelled_at < self.quarantine_s

    def _abandoned(self, res: Reservation, now: float) -> bool:
        """Nobody cancelled it, no Generate claims it, and no write can land any more: the
        gateway that made it is gone (crashed, or lost its Cancel)."""
        if res.cancelled or res.waiter is not None or self.writes_may_land(res):
            res.settled_at = None
            return False
        if res.settled_at is None:
            res.settled_at = now
        if res.notice is not None and res.notice.kind == "abort":
            return True  # the writer gave up: no gateway will ask to decode it
        return now - res.settled_at >= self.claim_timeout_s

    def _maybe_free(self, res: Reservation) -> None:
        if res.cancelled and not self.writes_may_land(res):
            self.open.pop(res.reservation_id, None)
            self.engine.cancel_reservation(res.key)

    def tick(self) -> bool:
        for notice in self.agent.get_notices():
            res = self.get(notice.reservation_id, notice.generation)
            if res is None:
                log.debug("late notice for reservation %s/%s ignored", notice.reservation_id, notice.generation)
                continue
            res.rank_notices[notice.rank] = notice
            if len(res.rank_notices) < (notice.num_ranks or self.num_ranks):
                continue  # other ranks may still be writing
            res.notice, res.notice_at = combined_notice(res.rank_notices), time.monotonic()
            if self.metrics is not None and res.notice.kind == "done":
                self.metrics.observe_kv_transfer("received", res.notice.kv_bytes, res.notice_at - res.created)
            if res.waiter is not None:
                res.waiter()
            self._maybe_free(res)
        now = time.monotonic()
        for res in list(self.open.values()):
            if not res.cancelled and self._abandoned(res, now):
                log.warning("reservation %d (request %s) was never claimed; freeing its %d pages",
                            res.reservation_id, res.request_id, len(res.page_ids))
                res.cancelled, res.cancelled_at = True, now
            if res.cancelled:
                self._maybe_free(res)
        return bool(self.open)


def waiter_for(aloop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    return lambda: aloop.call_soon_threadsafe(event.set)


def combined_notice(by_rank: dict[int, TransferNotice]) -> TransferNotice:
    """One notice for the reservation: rank 0's (its first token), an abort if any rank
    aborted, and the bytes of every rank."""
    first = by_rank[min(by_rank)]
    kind = "abort" if any(n.kind == "abort" for n in by_rank.values()) else "done"
    return TransferNotice(**{**first.__dict__, "kind": kind, "kv_bytes": sum(n.kv_bytes for n in by_rank.values())})
