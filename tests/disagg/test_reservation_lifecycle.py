"""The decode reservation's lifecycle (services/decode/reservation_state.py) through the real
ReservationBook: a real engine's KV pages, completion notices sent by a real NIXL agent, the
registry's view of the writer as a set of live ids, and the book's clock as a value the test
moves (deadlines without waiting).

Every move of the table is taken from a reservation brought into its source state the way
the service brings it there; it lands where the table says, and the pages are held while the
reservation is open and given back exactly once at its end. Moves the table lacks are refused."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from services.decode.reservation_state import RESERVATION, ReservationEvent, ReservationState
from services.decode.reservations import ReservationBook
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.kv_transfer.agent import KvTransferAgent
from shared.kv_transfer.notice import TransferNotice
from shared.state_table import IllegalMove
from shared.telemetry.metrics import DuetMetrics
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts

S, E = ReservationState, ReservationEvent
WRITER = "prefill-0"
QUARANTINE_S, CLAIM_TIMEOUT_S, TTL_S, LEASE_S = 60.0, 30.0, 120.0, 5.0
PROMPT = random_prompts(1, [10], seed=5)[0]  # three pages of 4
FIRST = 77  # the first token "prefill sampled"

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("res") / "m", "qwen3_headdim32", seed=3)
    return Engine(model_dir=str(d), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=16,
                  kv_cache_memory=2 << 20)


@pytest.fixture(scope="module")
def agents(engine):
    decode = KvTransferAgent("lifecycle-decode-r0", engine.pool.buffer, write_timeout_s=10)
    prefill = KvTransferAgent("lifecycle-prefill-r0", torch.zeros(4, 16), write_timeout_s=10)
    peer = prefill.add_peer("decode-0", "nonce-1", decode.metadata(), decode.pool_info)
    yield decode, prefill, peer
    prefill.close()
    decode.close()


class World:
    """A book over the real engine and agents, and what the test controls: the clock, which
    writers the registry holds, and the notices the writer sends."""

    def __init__(self, engine, agents, num_ranks: int = 1, lease_s: float = 0.0):
        self.engine = engine
        self.decode, self.prefill, self.peer = agents
        self.decode.get_notices()  # nothing left from an earlier test
        self.clock = Clock()
        self.live = {WRITER}
        self.metrics = DuetMetrics("decode", process_metrics=False)
        self.revoked = []  # reservations the book asked their writer to stop writing
        self.book = ReservationBook(engine, self.decode, self.live.__contains__, quarantine_s=QUARANTINE_S,
                                    claim_timeout_s=CLAIM_TIMEOUT_S, num_ranks=num_ranks, clock=self.clock,
                                    ttl_s=TTL_S, metrics=self.metrics, lease_s=lease_s, revoke=self.revoked.append)
        self.wakes = 0
        self.free_before = engine.kv.allocator.num_free

    def reserve(self, request_id: str = "req"):
        res = self.book.try_reserve(request_id, len(PROMPT), 4, WRITER, max_running=8)
        assert res is not None and res.state is S.RESERVED and len(res.page_ids) == 3
        return res

    def wake(self):
        self.wakes += 1

    def send(self, res, kind: str, rank: int = 0, num_ranks: int = 0, first: int = FIRST,
             key: bytes | None = None, ack: str = "") -> None:
        """A notice from the writer, MACed with the capability's secret (or with `key`)."""
        notice = TransferNotice(reservation_id=res.reservation_id, generation=res.generation, rank=rank,
                                request_id=res.request_id, kind=kind, first_token_id=first,
                                num_tokens=len(PROMPT), kv_bytes=100, num_ranks=num_ranks, ack=ack,
                                key=res.secret if key is None else key)
        self.prefill.send_notif(self.peer, notice.encode())

    def tick_until(self, what, timeout_s: float = 10.0) -> None:
        """The engine loop's tick until what() (a notice travels through NIXL: not instant)."""
        end = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < end, "the notice never arrived"
            self.book.tick()
            time.sleep(0.002)

    def notice(self, res, kind: str) -> None:
        before = res.state
        self.send(res, kind)
        self.tick_until(lambda: res.state is not before)

    def drive(self, res, event: ReservationEvent) -> None:
        """Make `event` happen to res the way the service or the world makes it happen."""
        book, key = self.book, (res.reservation_id, res.generation)
        if event is E.CLAIM:
            assert book.claim(*key, self.wake) is res
        elif event is E.NOTICE_DONE:
            self.notice(res, "done")
        elif event is E.NOTICE_DECLINED:
            self.notice(res, "declined")
        elif event is E.NOTICE_ABORT:
            self.notice(res, "abort")
        elif event is E.WRITER_GONE:
            self.live.discard(WRITER)
            book.tick()
        elif event is E.WRITER_BACK:
            self.live.add(WRITER)
            book.tick()
        elif event is E.CANCEL:
            assert book.cancel(*key)
        elif event is E.CANCEL_UNSENT:
            assert book.cancel(*key, unsent=True)
        elif event is E.DEADLINE:
            assert res.deadline is not None
            self.clock.now = res.deadline
            book.tick()
        elif event is E.LEASE_LAPSED:  # its holder stopped renewing; the book ticks on meanwhile
            assert res.lease_until is not None
            self.ticks_until(res.lease_until)
        elif event is E.CONSUME:
            book.consume(res)
            self.engine.add_prefilled(res.key, PROMPT, FIRST, SamplingParams(max_tokens=3, temperature=0), seed=None)
        else:
            raise AssertionError(event)

    def ticks_until(self, until: float) -> None:
        """The book's ticks, a tenth of a lease apart, until the clock reads `until`."""
        while self.clock.now < until:
            self.clock.now = min(until, self.clock.now + self.book.lease_s / 10)
            self.book.tick()

    def held(self, res) -> bool:
        """res's pages are still set aside (or, CONSUMED, a running request's)."""
        return self.engine.kv.allocator.num_free == self.free_before - len(res.page_ids)

    def finish(self) -> None:
        while self.engine.has_work:
            self.engine.step()


# the events that bring a new reservation into each state, as the service does
PATHS = {
    S.RESERVED: [],
    S.CLAIMED: [E.CLAIM],
    S.WRITTEN: [E.NOTICE_DONE],
    S.DECLINED: [E.NOTICE_DECLINED],
    S.ORPHANED: [E.WRITER_GONE],
    S.NOTICED: [E.CLAIM, E.NOTICE_DONE],
    S.QUARANTINED: [E.CANCEL],
}


def test_paths_reach_their_states_and_every_open_state_has_one():
    open_states = {m.src for m in RESERVATION.moves.values()}
    assert set(PATHS) == open_states
    for state, path in PATHS.items():
        s = RESERVATION.initial
        for event in path:
            s = RESERVATION.next(s, event, "test")
        assert s is state


@pytest.mark.parametrize("move", list(RESERVATION.moves.values()),
                         ids=lambda m: f"{m.src.name}-{m.event.name}")
def test_every_move_leads_where_the_table_says(engine, agents, move):
    w = World(engine, agents, lease_s=LEASE_S if move.event is E.LEASE_LAPSED else 0.0)
    res = w.reserve(f"{move.src.name}-{move.event.name}")
    for event in PATHS[move.src]:
        w.drive(res, event)
    assert res.state is move.src
    assert w.held(res)
    w.drive(res, move.event)
    assert res.state is move.dst, [s.name for s, _ in res.trail]
    if move.dst is not move.src:
        assert [s for s, _ in res.trail[-2:]] == [move.src, move.dst]
    if move.dst is S.NOTICED and move.src is S.CLAIMED:
        assert w.wakes == 1  # the waiting Generate was woken, once
    if move.dst not in RESERVATION.terminal:
        assert w.held(res) and res.reservation_id in w.book.open
        w.drive(res, E.CANCEL_UNSENT)  # give it back
    assert res.state in (S.FREED, S.CONSUMED)
    assert res.reservation_id not in w.book.open
    ends = [s for s, _ in res.trail if s in RESERVATION.terminal]
    assert ends == [res.state]  # it ended once
    if res.state is S.CONSUMED:
        assert w.held(res)  # the running request's now
        w.finish()
    # whatever comes later changes nothing: the pages are not given back twice
    trail = list(res.trail)
    assert not w.book.cancel(res.reservation_id, res.generation)
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is None
    w.send(res, "done")
    time.sleep(0.05)
    w.book.tick()
    assert res.trail == trail
    assert not engine.cancel_reservation(res.key)
    assert_all_pages_free(engine)


def test_moves_the_table_lacks_are_refused_and_logged(engine, agents, caplog):
    every = [(s, e) for s in ReservationState for e in ReservationEvent]
    refused = [(s, e) for s, e in every if not RESERVATION.allows(s, e)]
    assert refused and len(refused) + len(RESERVATION.moves) == len(every)
    for s, e in refused:
        with pytest.raises(IllegalMove):
            RESERVATION.next(s, e, "reservation 0")
    for s in RESERVATION.terminal:  # nothing leaves an end
        assert not any(RESERVATION.allows(s, e) for e in ReservationEvent)
    for s in set(ReservationState) - RESERVATION.terminal:  # what the book relies on never to raise
        assert RESERVATION.allows(s, E.CANCEL) and RESERVATION.allows(s, E.CANCEL_UNSENT), s
        assert RESERVATION.allows(s, E.NOTICE_DONE) or s in (S.WRITTEN, S.DECLINED, S.NOTICED), s
    # through the book: the service may consume only a claimed reservation with its notice in hand
    w = World(engine, agents)
    res = w.reserve()
    with caplog.at_level(logging.ERROR, logger="duet.lifecycle"):
        with pytest.raises(IllegalMove, match="CONSUME is not a legal move from RESERVED"):
            w.book.consume(res)
    assert "illegal move" in caplog.text
    assert res.state is S.RESERVED and w.held(res)
    # what comes from outside is refused without a raise: a second claim, a claim of a cancelled one
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is res
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is None
    assert w.book.cancel(res.reservation_id, res.generation) and res.state is S.QUARANTINED
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is None
    assert res.waiter is None
    assert w.book.cancel(res.reservation_id, res.generation, unsent=True)
    assert_all_pages_free(engine)


def test_a_quarantine_keeps_the_pages_until_no_write_can_land(engine, agents):
    """Cancelled while its writer is live: the reservation is revoked at the writer once (a
    Prefill call cancelled before its handler ran sends no abort of its own), and the pages
    stay set aside until the writer's abort or the quarantine deadline, which later cancels
    do not move."""
    w = World(engine, agents)
    res = w.reserve()
    w.clock.now += 5
    assert w.book.cancel(res.reservation_id, res.generation)
    assert res.state is S.QUARANTINED and res.deadline == w.clock.now + QUARANTINE_S
    assert w.revoked == [res] and res.revoke_token
    w.clock.now += QUARANTINE_S - 1
    assert w.book.cancel(res.reservation_id, res.generation)  # a repeat changes nothing
    w.book.tick()
    assert res.state is S.QUARANTINED and w.held(res) and res.entered(S.QUARANTINED) == 1005.0
    assert w.revoked == [res]  # revoked once
    w.clock.now += 1
    w.book.tick()
    assert res.state is S.FREED
    assert_all_pages_free(engine)
    # the writer that holds no transfer answers the revoke at once (echoing its token): freed then
    answered = w.reserve("answered")
    assert w.book.cancel(answered.reservation_id, answered.generation) and w.revoked[-1] is answered
    w.send(answered, "abort", key=b"", ack=answered.revoke_token)
    w.tick_until(lambda: answered.state is not S.QUARANTINED)
    assert answered.state is S.FREED
    assert_all_pages_free(engine)
    # a writer gone from the registry is not asked: its leave frees the pages
    w.live.discard(WRITER)
    gone = w.reserve("writer-gone")
    assert w.book.cancel(gone.reservation_id, gone.generation)
    assert gone.state is S.FREED and w.revoked[-1] is answered


def test_a_notice_after_the_writer_left_keeps_the_claim_clock(engine, agents):
    """No write can land from the moment the writer left the registry: a done notice that
    comes after that does not restart the claim timeout; a writer back in it stops the clock."""
    w = World(engine, agents)
    res = w.reserve()
    w.drive(res, E.WRITER_GONE)
    assert res.state is S.ORPHANED and res.deadline == w.clock.now + CLAIM_TIMEOUT_S
    w.drive(res, E.WRITER_BACK)
    assert res.state is S.RESERVED and res.deadline == res.expires == 1000.0 + TTL_S  # the capability's lifetime
    w.drive(res, E.WRITER_GONE)
    gone_deadline = res.deadline
    w.clock.now += 10
    w.drive(res, E.NOTICE_DONE)
    assert res.state is S.WRITTEN and res.deadline == gone_deadline
    w.clock.now = gone_deadline
    w.book.tick()
    assert res.state is S.FREED
    assert [s for s, _ in res.trail] == [S.RESERVED, S.ORPHANED, S.RESERVED, S.ORPHANED, S.WRITTEN, S.FREED]
    assert_all_pages_free(engine)


def test_a_reservation_waits_for_every_ranks_notice(engine, agents):
    """Two prefill ranks: one rank's done notice moves nothing; the second's does, with the
    bytes of both. One abort among the ranks' notices makes the whole an abort."""
    w = World(engine, agents, num_ranks=2)
    res = w.reserve("two-ranks")
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is res
    w.send(res, "done", rank=1)
    w.tick_until(lambda: len(res.rank_notices) == 1)
    assert res.state is S.CLAIMED and w.wakes == 0
    w.send(res, "done", rank=0)
    w.tick_until(lambda: res.state is not S.CLAIMED)
    assert res.state is S.NOTICED and w.wakes == 1
    assert (res.notice.kind, res.notice.kv_bytes, res.notice.first_token_id) == ("done", 200, FIRST)
    w.drive(res, E.CONSUME)
    w.finish()

    res = w.reserve("one-aborts")
    w.send(res, "declined", rank=0, num_ranks=2)
    w.send(res, "abort", rank=1, num_ranks=2)
    w.tick_until(lambda: res.state is not S.RESERVED)
    assert res.state is S.FREED and res.notice.kind == "abort"
    assert_all_pages_free(engine)


def test_a_reserve_cancelled_by_request_id_is_freed_and_never_made_again(engine, agents):
    w = World(engine, agents)
    unclaimed, claimed = w.reserve("dropped"), w.reserve("dropped")
    assert w.book.claim(claimed.reservation_id, claimed.generation, w.wake) is claimed
    assert w.book.cancel_request("dropped")
    assert unclaimed.state is S.FREED and claimed.state is S.CLAIMED  # a Generate holds that one
    assert w.book.try_reserve("dropped", len(PROMPT), 4, WRITER, max_running=8) is None
    w.drive(claimed, E.CANCEL_UNSENT)
    assert not w.book.cancel_request("dropped")
    assert_all_pages_free(engine)


def test_the_trail_records_each_state_once_per_entry(engine, agents):
    w = World(engine, agents)
    res = w.reserve("trail")
    for event in (E.CLAIM, E.CANCEL, E.CANCEL, E.NOTICE_ABORT):
        w.drive(res, event)
        w.clock.now += 1
    assert [(s, t - 1000.0) for s, t in res.trail] == [(S.RESERVED, 0.0), (S.CLAIMED, 0.0), (S.QUARANTINED, 1.0),
                                                       (S.FREED, 3.0)]
    assert_all_pages_free(engine)


def test_an_unclaimed_reservation_is_quarantined_at_its_capabilitys_deadline(engine, agents):
    """Nobody claims it and its writer stays live and silent: at the end of its capability's
    lifetime it is quarantined (its writer may still be writing: it stops at the same
    lifetime), then freed by the writer's abort notice or by the quarantine deadline."""
    w = World(engine, agents)
    res = w.reserve("expires")
    assert res.deadline == w.clock.now + TTL_S
    w.clock.now += TTL_S - 1
    w.book.tick()
    assert res.state is S.RESERVED and w.held(res)
    w.clock.now += 1
    w.book.tick()
    assert res.state is S.QUARANTINED and w.held(res) and res.deadline == w.clock.now + QUARANTINE_S
    assert w.book.claim(res.reservation_id, res.generation, w.wake) is None  # too late for a Generate
    w.notice(res, "abort")  # the writer stopped at the same lifetime
    assert res.state is S.FREED

    res = w.reserve("expires-silently")  # a writer that never heard of it: the quarantine frees it
    w.clock.now += TTL_S
    w.book.tick()
    w.clock.now += QUARANTINE_S
    w.book.tick()
    assert [s for s, _ in res.trail] == [S.RESERVED, S.QUARANTINED, S.FREED]
    assert_all_pages_free(engine)


def test_a_notice_without_the_capabilitys_mac_is_ignored_and_counted(engine, agents):
    """Only the holder of the reservation's capability speaks for it: a notice MACed with
    another secret, or with none, moves nothing (counted as forged); one for a reservation
    that is gone is counted as stale. The right one still works after them."""
    w = World(engine, agents)
    res = w.reserve("forged")
    other = w.reserve("other")
    for key in (b"", other.secret, bytes(16)):
        w.send(res, "abort", key=key)
    w.tick_until(lambda: w.metrics.kv_notices_refused.labels(reason="forged")._value.get() == 3)
    assert res.state is S.RESERVED and res.reservation_id in w.book.open and res.notice is None
    w.drive(other, E.CANCEL_UNSENT)
    w.send(other, "done")
    w.tick_until(lambda: w.metrics.kv_notices_refused.labels(reason="stale")._value.get() == 1)
    w.notice(res, "done")
    assert res.state is S.WRITTEN and res.notice.kind == "done"
    w.drive(res, E.CANCEL_UNSENT)
    assert_all_pages_free(engine)


def test_a_lapsed_lease_quarantines_or_frees_like_an_expired_capability(engine, agents):
    """An unclaimed reservation lives `lease_s` past its holder's last renewal. Renewed, it
    outlives many leases; unrenewed while a write may land it is quarantined (past its
    capability's lifetime) and revoked at its writer, whose abort echoing the revoke's token
    frees it (a wrong token is forged), and freed at once when no write can land (written,
    declined, orphaned). A
    claim ends the lease: the Generate's stream is the holder's liveness then. A pause of the
    book itself (no tick for longer than a third of the lease) is not held against the holder.
    Each lapse is counted."""
    w = World(engine, agents, lease_s=LEASE_S)
    lapsed = lambda: w.metrics.lease_expiries.labels(kind="reservation")._value.get()  # noqa: E731
    kept = w.reserve("renewed")
    key = (kept.reservation_id, kept.generation)
    for _ in range(10):  # ten leases long, renewed every third of one
        w.clock.now += LEASE_S / 3
        assert w.book.renew([key]) == []
        w.book.tick()
    assert kept.state is S.RESERVED and w.held(kept) and lapsed() == 0
    assert w.book.renew([(kept.reservation_id, kept.generation + 1), (999, 1)]) == \
        [(kept.reservation_id, kept.generation + 1), (999, 1)]  # not ours: the holder stops renewing them
    w.ticks_until(w.clock.now + LEASE_S - 0.1)
    assert kept.state is S.RESERVED
    w.ticks_until(w.clock.now + 0.1)
    assert kept.state is S.QUARANTINED and w.held(kept) and lapsed() == 1
    # its writer may not have heard (its RPC may be live): it stops posting at its capability's end
    assert kept.deadline == kept.expires + QUARANTINE_S
    w.ticks_until(kept.expires)
    assert kept.state is S.QUARANTINED and w.held(kept)
    assert w.book.renew([key]) == [key]  # too late: quarantined
    assert w.book.claim(*key, w.wake) is None
    assert w.revoked == [kept] and kept.revoke_token  # its writer is told to stop
    # a writer that never had the capability's secret answers with the revoke's token, not a MAC
    w.send(kept, "abort", key=b"", ack="not-the-token")
    w.tick_until(lambda: w.metrics.kv_notices_refused.labels(reason="forged")._value.get() == 1)
    assert kept.state is S.QUARANTINED
    w.send(kept, "abort", key=b"", ack=kept.revoke_token)
    w.tick_until(lambda: kept.state is not S.QUARANTINED)
    assert kept.state is S.FREED

    for path in ([E.NOTICE_DONE], [E.NOTICE_DECLINED], [E.WRITER_GONE]):
        res = w.reserve(f"lapses-{path[0].name}")
        w.drive(res, path[0])
        w.ticks_until(w.clock.now + LEASE_S)
        assert [s for s, _ in res.trail][-2:] == [res.trail[-2][0], S.FREED] and res.trail[-2][0] is not S.RESERVED
        w.live.add(WRITER)
    assert lapsed() == 4 and w.revoked == [kept]  # no write could land: nothing to revoke

    claimed = w.reserve("claimed")
    assert w.book.claim(claimed.reservation_id, claimed.generation, w.wake) is claimed
    w.ticks_until(w.clock.now + 3 * LEASE_S)
    assert claimed.state is S.CLAIMED and lapsed() == 4  # the claim ended its lease
    w.drive(claimed, E.CANCEL_UNSENT)

    paused = w.reserve("paused")
    w.clock.now += 2 * LEASE_S  # the book itself did not tick: its process was stopped
    w.book.tick()
    assert paused.state is S.RESERVED and lapsed() == 4
    w.ticks_until(w.clock.now + LEASE_S)  # ticking again, and its holder silent: a lease later it lapses
    assert paused.state is S.QUARANTINED and lapsed() == 5
    w.drive(paused, E.CANCEL_UNSENT)
    assert_all_pages_free(engine)
