"""Decode side of the handoff: reserved pages, completion notices, and the rule that
reserved pages are never reused while a write into them may still land.

Runs on the engine-loop thread. Each reservation is in one state of the lifecycle in
reservation_state.py; ReservationBook turns what happens (a Generate claims it, a notice
arrives, a cancel, its writer leaves or comes back to the registry, a deadline passes) into
that table's events, refuses what the table forbids, and frees the pages on the one move
into FREED. In short: a reservation is freed once no write can land and nobody will decode
it. A cancel quarantines it until its notice (done, declined or abort) arrives, its writer
has left the registry, or `quarantine_s` passed (longer than prefill's own write timeout;
the writer's RPC is cancelled with it). Prefill sends an abort notice for every request it
gives up on (cancelled or refused at any point); one whose call was cancelled before its
handler ran knows nothing to give up, so the cancel also revokes the reservation at its live
writer (as a lapsed lease does, below), and the quarantine is the last resort. A
cancel that says the reservation never reached a prefill worker frees it at once (nobody
can write into pages nobody was told about), as does a cancel by request id for a Reserve
whose answer never reached its caller (and a later Reserve for that request is refused).
One nobody cancels or claims (its gateway died) is freed once no write can land: at once
after an abort notice, `claim_timeout_s` after a done or declined notice or after its
writer left the registry. One nobody claims within its lifetime (`ttl_s`, whatever its
caller asked) is quarantined: its writer stops at the same lifetime and says so (abort
notice), else the quarantine deadline frees it. Until a Generate claims it, a reservation also
holds a short lease (`lease_s`) its holder renews (`renew`, the RenewLease RPC the gateway sends
every third of it): one whose lease lapses (its gateway died, stopped or lost the network) is
handled like an expired capability, sooner: quarantined while a write may land and revoked at
its writer (`revoke`, services/decode/revoker.py), whose abort notice (MACed, or echoing the
revoke's token when it never had the secret) ends the quarantine; else its writer's leave or
the end of its capability's lifetime and the quarantine (the writer, whose RPC may still be
live, stops posting then at the latest). Freed at once when no write can land (written,
declined, orphaned). Each lapse is counted. A notice counts only if it carries the MAC of
the reservation's capability secret (shared/kv_transfer/capability.py); others are ignored
and counted. Each rule and the test that proves it: docs/ARCHITECTURE.md, "Failure rules"."""
from __future__ import annotations

import asyncio
import itertools
import secrets
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from services.decode.reservation_state import (
    CLAIMED_STATES,
    LEASED,
    NOTICE_EVENTS,
    RESERVATION,
    WATCHED,
    WRITER_WATCH,
    ReservationEvent,
    ReservationState,
)
from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.kv_transfer.capability import new_secret
from shared.kv_transfer.notice import TransferNotice

log = logging.getLogger("duet.decode")

DROPPED_REQUESTS_KEPT = 4096  # request ids cancel_request() refuses later Reserves for
S, E = ReservationState, ReservationEvent


class ReservationGone(Exception):
    """Its caller cancelled the reservation while a Generate waited on it."""


@dataclass(eq=False)
class Reservation:
    reservation_id: int
    generation: int
    request_id: str
    page_ids: list[int]
    writer_id: str
    prompt_tokens: int
    trail: list[tuple[ReservationState, float]]  # every state entered, with its clock time; the last is now's
    held_pages: int = 0  # leading prompt pages this worker already held (the writer skips them)
    group: str = ""  # the client request it came from (fair turns: reserve_queue.py)
    secret: bytes = b""  # its capability's secret: the key of every notice's MAC
    expires: float | None = None  # the end of its capability's lifetime (RESERVED's deadline)
    deadline: float | None = None  # when the current state expires (a DEADLINE move); None: never
    lease_until: float | None = None  # unclaimed past this without a renewal: LEASE_LAPSED; None: no lease
    notice: TransferNotice | None = None  # every rank's notice, combined (WRITTEN, DECLINED, NOTICED)
    rank_notices: dict[int, TransferNotice] = field(default_factory=dict)
    revoke_token: str = ""  # sent with the revoke (cancelled or lease lapsed): the writer's abort echoes it
    waiter: Callable[[], None] | None = None  # wakes the Generate that claimed it (CLAIMED, NOTICED)
    ready_event: object = None  # CUDA event: launched GPU work that may touch the pages has run

    @property
    def key(self) -> str:
        return f"res-{self.reservation_id}"

    @property
    def state(self) -> ReservationState:
        return self.trail[-1][0]

    @property
    def created(self) -> float:
        return self.trail[0][1]

    @property
    def claimed(self) -> bool:
        return self.state in CLAIMED_STATES

    def entered(self, state: ReservationState) -> float | None:
        """When it last entered `state` (None: never)."""
        return next((t for s, t in reversed(self.trail) if s is state), None)


@dataclass(frozen=True)
class Room:
    """What a decode worker can still take on: batch slots and pages past the headroom kept
    for the running decodes."""
    slots: int
    spare_pages: int


class ReservationBook:
    def __init__(self, engine, agent, is_live: Callable[[str], bool], quarantine_s: float = 60.0,
                 metrics=None, claim_timeout_s: float = 30.0, num_ranks: int = 1,
                 clock: Callable[[], float] = time.monotonic, ttl_s: float = 120.0, lease_s: float = 0.0,
                 revoke: Callable[[Reservation], None] | None = None):
        """num_ranks: notices a reservation waits for when a notice does not say (its
        num_ranks): every rank of the prefill worker writes its heads and sends its own
        notice here, and a reservation is written (or aborted) only when all of them have.
        clock: this process's monotonic clock (deadlines never cross hosts). ttl_s: the
        lifetime of a reservation's write capability. lease_s: how long an unclaimed
        reservation lives without its holder's renewal (0: no lease). revoke(res): tells the
        writer of a reservation whose lease lapsed to stop (services/decode/revoker.py); it
        answers with an abort notice, which frees it.
        agent: what gives the completion notices (a KvTransferAgent, or a NoticeInbox view)."""
        self.engine = engine
        self.agent = agent
        self.is_live = is_live
        self.quarantine_s = quarantine_s
        self.claim_timeout_s = claim_timeout_s
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self.revoke = revoke
        self._last_tick: float | None = None
        self.metrics = metrics
        self.num_ranks = num_ranks
        self.clock = clock
        self.open: dict[int, Reservation] = {}  # every reservation not CONSUMED or FREED
        self.dropped_requests: OrderedDict[str, None] = OrderedDict()  # cancel_request() ids (bounded)
        self._ids = itertools.count(1)
        self.generation = 1  # ids are never reused in one instance; the nonce covers restarts
        self.num_passed_over = 0  # reservations made ahead of a tenant over its live share

    # -- admission --------------------------------------------------------------------------
    def try_reserve(self, request_id: str, prompt_tokens: int, max_tokens: int, writer_id: str,
                    max_running: int, n: int = 1, prompt_ids: list[int] | None = None,
                    scope: CacheScope = DEFAULT_SCOPE, group: str = "") -> Reservation | None:
        """n > 1: the request forks into n sequences sharing the prompt's pages. prompt_ids:
        the leading pages of it this worker holds (under scope's namespace) are reused
        (page_ids then lists only the pages the writer fills, from `held_pages` on)."""
        if request_id in self.dropped_requests:
            return None  # its caller gave up before an answer (cancel_request): never again
        eng = self.engine
        if not self.fits(self.room(max_running), prompt_tokens, n):
            return None
        rid, now = next(self._ids), self.clock()
        res = Reservation(rid, self.generation, request_id, [], writer_id, prompt_tokens,
                          trail=[(S.RESERVED, now)], group=group or request_id, secret=new_secret(),
                          expires=now + self.ttl_s)
        res.deadline = res.expires
        res.lease_until = now + self.lease_s if self.lease_s > 0 else None
        kv = eng.reserve(res.key, prompt_tokens, prompt_ids, scope)
        if kv is None:
            return None
        res.page_ids, res.held_pages = kv.fresh_pages, len(kv.held_pages)
        # a step launched before these pages were freed may still write them (overlap
        # scheduling): the reservation is handed out once that work has run
        res.ready_event = eng.launched_work_event()
        self.open[rid] = res
        return res

    def room(self, max_running: int) -> Room:
        eng = self.engine
        running = len(eng.scheduler.running) + len(self.open)
        # one page per running decode for its next step stays free
        decoding = sum(1 for r in eng.scheduler.running if r.is_decoding)
        return Room(max_running - running, eng.kv.available - decoding)

    def fits(self, room: Room, prompt_tokens: int, n: int) -> bool:
        """Whether a reservation of prompt_tokens for n sequences fits `room`: a batch slot
        per sequence, and pages for the prompt (at most: held pages need none) plus each
        sequence's first (each copies the prompt's last page and grows on its own)."""
        return n <= room.slots and self.engine.kv.pages_for(prompt_tokens) + n <= room.spare_pages

    def pages_by_group(self) -> dict[str, int]:
        """Pages each request group holds here: its running requests' and its reservations'."""
        held: dict[str, int] = {}
        for req in self.engine.scheduler.running:
            group = req.request_group or req.out_rid
            held[group] = held.get(group, 0) + len(req.page_ids)
        for res in self.open.values():
            held[res.group] = held.get(res.group, 0) + len(res.page_ids) + res.held_pages
        return held

    def get(self, reservation_id: int, generation: int) -> Reservation | None:
        res = self.open.get(reservation_id)
        return res if res is not None and res.generation == generation else None

    # -- what callers do ------------------------------------------------------------------------
    def claim(self, reservation_id: int, generation: int, waiter: Callable[[], None]) -> Reservation | None:
        """A Generate takes the reservation; waiter() wakes it when the notice arrives. None:
        unknown, cancelled, or claimed already (one Generate per reservation)."""
        res = self.get(reservation_id, generation)
        if res is None or not RESERVATION.allows(res.state, E.CLAIM):
            return None
        res.waiter = waiter
        self._move(res, E.CLAIM)
        return res

    def renew(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Its holder keeps these reservations another `lease_s`. Returns the ones it no
        longer holds a lease on (unknown, freed, claimed, quarantined): it stops renewing them."""
        now, lost = self.clock(), []
        for key in keys:
            res = self.get(*key)
            if res is None or res.lease_until is None or res.state not in LEASED:
                lost.append(key)
            else:
                res.lease_until = now + self.lease_s
        return lost

    def consume(self, res: Reservation) -> None:
        """The reservation's pages now belong to a running request (engine.add_prefilled);
        only a claimed one with its notice in hand (NOTICED)."""
        self._move(res, E.CONSUME)

    def cancel(self, reservation_id: int, generation: int, unsent: bool = False) -> bool:
        """unsent: the caller never gave the reservation to a prefill worker (nobody can
        write into pages nobody was told about: freed at once)."""
        res = self.get(reservation_id, generation)
        if res is None:
            return False
        self._move(res, E.CANCEL_UNSENT if unsent else E.CANCEL)
        if res.state is not S.FREED:
            self._settle(res, self.clock())  # no write can land already (its writer is gone): freed now
        if res.state is S.QUARANTINED:
            # a Prefill call cancelled before its handler ran sends no abort notice: without the
            # writer's word the pages would wait out the whole quarantine (2 x write timeout)
            self._ask_writer_to_stop(res)
        return True

    def cancel_request(self, request_id: str) -> bool:
        """The caller's Reserve for request_id got no answer: free whatever it made (the
        caller never learnt its pages, so it sent them to no writer) and refuse a later one."""
        self.dropped_requests[request_id] = None
        while len(self.dropped_requests) > DROPPED_REQUESTS_KEPT:
            self.dropped_requests.popitem(last=False)
        found = [r for r in self.open.values() if r.request_id == request_id and not r.claimed]
        for res in found:
            self.cancel(res.reservation_id, res.generation, unsent=True)
        return bool(found)

    # -- what the engine loop does ----------------------------------------------------------------
    def tick(self) -> bool:
        for notice in self.agent.get_notices():
            self._on_rank_notice(notice)
        now = self.clock()
        self._credit_pause(now)
        for res in list(self.open.values()):
            self._settle(res, now)
        return bool(self.open)

    def _credit_pause(self, now: float) -> None:
        """A gap between ticks longer than a third of the lease is this process's pause (a
        stopped process, a long step), not the holders' silence: renewals sent meanwhile are
        still on their way, so every lease is moved on by the gap."""
        last, self._last_tick = self._last_tick, now
        if self.lease_s <= 0 or last is None or now - last <= self.lease_s / 3:
            return
        for res in self.open.values():
            if res.lease_until is not None:
                res.lease_until += now - last

    def _on_rank_notice(self, notice: TransferNotice) -> None:
        res = self.get(notice.reservation_id, notice.generation)
        if res is None or not (notice.signed_by(res.secret) or _answers_revoke(res, notice)):
            # unknown (late, for a reservation gone) or not from its capability's holder
            reason = "stale" if res is None else "forged"
            log.log(logging.DEBUG if res is None else logging.WARNING, "%s notice for reservation %s/%s "
                    "(request %s) ignored", reason, notice.reservation_id, notice.generation, notice.request_id)
            if self.metrics is not None:
                self.metrics.kv_notices_refused.labels(reason=reason).inc()
            return
        if res.notice is not None:
            log.debug("late notice for reservation %s/%s ignored", notice.reservation_id, notice.generation)
            return
        res.rank_notices[notice.rank] = notice
        if len(res.rank_notices) < (notice.num_ranks or self.num_ranks):
            return  # other ranks may still be writing
        combined, now = combined_notice(res.rank_notices), self.clock()
        if self.metrics is not None and combined.kind == "done":
            self.metrics.observe_kv_transfer("received", combined.kv_bytes, now - res.created)
        if combined.kind == "abort" and not res.claimed and res.state is not S.QUARANTINED:
            log.info("reservation %d (request %s): its writer gave up before anyone claimed it; freeing its %d "
                     "pages", res.reservation_id, res.request_id, len(res.page_ids))
        res.notice = combined
        self._move(res, NOTICE_EVENTS[combined.kind], now)
        if res.state is S.NOTICED and res.waiter is not None:
            res.waiter()

    def _settle(self, res: Reservation, now: float) -> None:
        """The one place a reservation moves by itself: by its writer's liveness in the
        registry, or by the deadline of the state it is in."""
        event = WRITER_WATCH.get((res.state, self.is_live(res.writer_id))) if res.state in WATCHED else None
        if event is not None:
            self._move(res, event, now)
        if res.lease_until is not None and now >= res.lease_until and res.state in LEASED:
            self._lease_lapsed(res, now)
            return
        if res.deadline is not None and now >= res.deadline:
            if res.state is S.RESERVED:
                log.warning("reservation %d (request %s): its write capability expired unclaimed; its %d pages "
                            "are quarantined until no write can land", res.reservation_id, res.request_id,
                            len(res.page_ids))
            elif res.state is not S.QUARANTINED:
                log.warning("reservation %d (request %s) was never claimed; freeing its %d pages",
                            res.reservation_id, res.request_id, len(res.page_ids))
            self._move(res, E.DEADLINE, now)

    def _lease_lapsed(self, res: Reservation, now: float) -> None:
        held = "quarantined until no write can land" if res.state is S.RESERVED else "freed"
        log.warning("reservation %d (request %s): its holder stopped renewing its lease (%s, last renewed %.1fs "
                    "ago); its %d pages are %s", res.reservation_id, res.request_id, res.state.name,
                    now - res.lease_until + self.lease_s, len(res.page_ids), held)
        if self.metrics is not None:
            self.metrics.lease_expiries.labels(kind="reservation").inc()
        self._move(res, E.LEASE_LAPSED, now)
        if res.state is S.QUARANTINED and res.expires is not None:
            # its writer may not know (its RPC may be live): it stops posting only at its
            # capability's lifetime, so the quarantine outlasts that unless a notice or the
            # writer's leave says sooner that no write can land
            res.deadline = max(res.deadline, res.expires + self.quarantine_s)
            self._ask_writer_to_stop(res)

    def _ask_writer_to_stop(self, res: Reservation) -> None:
        """Revoke a quarantined reservation at its live writer (once): a writer that is writing
        cancels and sends its abort when its writes in flight settle, one that holds no
        transfer refuses the capability from now on and answers at once; either abort frees
        the pages (revoker.py)."""
        if self.revoke is not None and not res.revoke_token and self.is_live(res.writer_id):
            res.revoke_token = secrets.token_hex(8)
            self.revoke(res)

    def _move(self, res: Reservation, event: ReservationEvent, now: float | None = None) -> None:
        """Every state change goes through here; the one move into FREED frees the pages."""
        now = self.clock() if now is None else now
        old = res.state
        new = RESERVATION.next(old, event, f"reservation {res.reservation_id} (request {res.request_id})")
        if new is old:
            return  # a repeat (a second cancel): its clock keeps running
        res.deadline = self._deadline(res, new, now)
        res.trail.append((new, now))
        if new not in CLAIMED_STATES:
            res.waiter = None
        if new in (S.CONSUMED, S.FREED):
            self.open.pop(res.reservation_id, None)
        if new is S.FREED:
            self.engine.cancel_reservation(res.key)

    def _deadline(self, res: Reservation, new: ReservationState, now: float) -> float | None:
        """When `new` expires. RESERVED: its capability's lifetime (nobody claimed it in time:
        quarantined, its writer may still be writing). QUARANTINED: the writer's last in-flight
        write has had its time (longer than prefill's write timeout; its RPC was cancelled
        too, and a writer stops at its capability's lifetime). Unclaimed with no
        write to come: a gateway that died never claims it; the clock runs from when no
        write could land any more (a notice after its writer left keeps it)."""
        if new is S.QUARANTINED:
            return now + self.quarantine_s
        if new is S.RESERVED:  # its writer is back: the capability's lifetime still runs
            return res.expires
        if new in (S.WRITTEN, S.DECLINED, S.ORPHANED):
            return res.deadline if res.state is S.ORPHANED else now + self.claim_timeout_s
        return None


def _answers_revoke(res: Reservation, notice: TransferNotice) -> bool:
    """An abort from a writer that held no transfer for a revoked reservation (it may never have
    had the capability's secret): it echoes the revoke's token instead of a MAC."""
    return bool(res.revoke_token) and notice.kind == "abort" and notice.ack == res.revoke_token


def waiter_for(aloop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    return lambda: aloop.call_soon_threadsafe(event.set)


def combined_notice(by_rank: dict[int, TransferNotice]) -> TransferNotice:
    """One notice for the reservation: rank 0's (its first token), an abort if any rank
    aborted (else declined if any declined), and the bytes of every rank."""
    first = by_rank[min(by_rank)]
    kinds = {n.kind for n in by_rank.values()}
    kind = "abort" if "abort" in kinds else "declined" if "declined" in kinds else "done"
    return TransferNotice(**{**first.__dict__, "kind": kind, "kv_bytes": sum(n.kv_bytes for n in by_rank.values())})
