"""An outgoing KV handoff's lifecycle (services/prefill/outgoing_state.py) through the real
OutgoingTransfers: a real prefill engine computing the prompt in chunks, its pages written by
a real NIXL agent into another agent's pool, driven in the engine loop's order (step, step
hooks, tick).

Every move of the table is taken: the happy path, a held prefix that is not the prompt's, a
cancel in each state, a failed write or notice in each state, a request the engine ends early.
Each ends with the engine's pages all free (or cached) and the decode side told once. To act
between posting a notice and its landing, a stream can be held: its poll reports "in flight"
until the test lets it go (as a slow transport would)."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from services.prefill.handoff_spans import handoff_spans
from services.prefill.outgoing import HandoffFailed, OutgoingTransfers
from services.prefill.outgoing_state import OUTGOING, OutgoingEvent, OutgoingState
from shared.engine.engine import Engine
from shared.engine.request import ReqStatus
from shared.engine.sampling_params import SamplingParams
from shared.kv_transfer.agent import PENDING, KvTransferAgent, TransferError
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.write_stream import PageWriteStream
from shared.state_table import IllegalMove
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts

S, E = OutgoingState, OutgoingEvent
PAGE = 4
PROMPT = random_prompts(1, [30], seed=9)[0]  # 8 pages, the last one partial; 4 chunks of 8
DST_PAGES = list(range(20, 28))
SECRET = bytes(range(16))  # the reservation's capability secret: every notice is MACed with it

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_model_dir(tmp_path_factory.mktemp("out") / "m", "qwen3_headdim32", seed=4)
    return Engine(model_dir=str(d), dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=8,
                  kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def agents(engine):
    prefill = KvTransferAgent("outgoing-prefill-r0", engine.pool.buffer, write_timeout_s=10)
    decode = KvTransferAgent("outgoing-decode-r0", torch.zeros_like(engine.pool.buffer), write_timeout_s=10)
    yield prefill, decode
    prefill.close()
    decode.close()


class HeldStream(PageWriteStream):
    """A real stream whose progress the test can hold: while `held`, poll() reports PENDING."""

    held = False

    def poll(self) -> str:
        return PENDING if self.held else super().poll()


class Handoff:
    """One request through OutgoingTransfers, and the decode agent's view of it."""

    def __init__(self, engine, agents, rid: str, write_nothing: bool = False, peer_id: str = "decode-0",
                 transfers: OutgoingTransfers | None = None):
        self.engine = engine
        self.prefill, self.decode = agents
        self.decode.get_notices()
        self.decode.pool.zero_()
        self.peer = self.prefill.add_peer(peer_id, "nonce-1", self.decode.metadata(), self.decode.pool_info)
        self.stream = HeldStream(self.prefill, self.peer, DST_PAGES)
        self.transfers = transfers or OutgoingTransfers(engine)
        self.rid = rid
        self.fut = self.transfers.start(rid, PROMPT, SamplingParams(max_tokens=4, temperature=0), self.stream,
                                        reservation_id=5, generation=2, write_nothing=write_nothing, secret=SECRET,
                                        decode=(peer_id, "nonce-1"))
        self.out = self.transfers.active[rid]
        self.pages: list[int] = []  # the request's pages, seen before they are released

    @property
    def state(self) -> OutgoingState:
        return self.out.state

    def run(self, until, timeout_s: float = 30.0) -> None:
        """The engine loop's order until until() holds between any two of its parts."""
        end = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < end, f"stuck in {self.state.name}"
            if self.engine.has_work:
                self.transfers.on_step(self.engine.step())
                req = self.engine.get(self.rid)
                if req is not None:
                    self.pages = list(req.page_ids)
                if until():
                    return
            self.transfers.tick()
            time.sleep(0.001)

    def run_to(self, state: OutgoingState) -> None:
        self.run(lambda: self.state is state)

    def run_to_end(self) -> None:
        self.run(self.fut.done)
        assert self.rid not in self.transfers.active

    def notices(self, timeout_s: float = 5.0) -> list[TransferNotice]:
        got: list[TransferNotice] = []
        end = time.monotonic() + timeout_s
        while not got and time.monotonic() < end:
            got.extend(self.decode.get_notices())
            time.sleep(0.002)
        time.sleep(0.05)
        return got + self.decode.get_notices()

    def trail(self) -> list[OutgoingState]:
        return [s for s, _ in self.out.trail]


def assert_legal(trail: list[OutgoingState]) -> None:
    for a, b in zip(trail, trail[1:]):
        assert any(m.src is a and m.dst is b for m in OUTGOING.moves.values()), (a, b)


def test_a_handoff_writes_every_page_then_its_done_notice(engine, agents):
    h = Handoff(engine, agents, "happy")
    h.run_to(S.TAIL)
    assert 0 < h.out.pages_sent < len(DST_PAGES)  # pages went out while the prompt was computed
    h.run_to_end()
    assert h.trail() == [S.PREFILLING, S.TAIL, S.FINISHING, S.DONE]
    result = h.fut.result()
    assert result.first.token_ids == h.out.first.token_ids and result.kv_bytes == h.stream.bytes_sent > 0
    [notice] = h.notices()
    assert (notice.kind, notice.reservation_id, notice.generation, notice.first_token_id) == \
        ("done", 5, 2, result.first.token_ids[0])
    assert notice.signed_by(SECRET)
    src, dst = engine.pool.buffer, h.decode.pool
    assert torch.equal(dst[DST_PAGES], src[h.pages[:len(DST_PAGES)]])  # every page landed
    assert_all_pages_free(engine)
    # what the request's queue, compute and kv_send spans are made of: the send began while the
    # prompt was computed (4 chunks of 8) and ended after its first token
    t = result.times
    assert t.phase.arrived <= t.phase.scheduled <= t.send_started < t.phase.computed <= t.send_ended
    assert t.phase.computed == h.out.entered(S.TAIL) and t.send_ended == h.out.entered(S.DONE)
    assert (t.phase.chunks, t.pages) == (4, len(DST_PAGES))


def test_a_held_prefix_that_is_not_the_prompts_writes_nothing_and_declines(engine, agents):
    h = Handoff(engine, agents, "declined", write_nothing=True)
    h.run_to_end()
    assert h.trail() == [S.PREFILLING, S.TAIL, S.DECLINING, S.DONE]
    assert h.fut.result().first.token_ids  # the answer stands
    assert h.stream.bytes_sent == 0 and int(torch.count_nonzero(h.decode.pool)) == 0
    assert [n.kind for n in h.notices()] == ["declined"]
    times = h.fut.result().times  # no page sent: the kv_send span is the notice's way
    assert times.pages == 0 and times.send_started == h.out.entered(S.DECLINING) <= times.send_ended
    assert_all_pages_free(engine)


def _hold_in(h: Handoff, state: OutgoingState) -> None:
    """Bring h into `state` (for FINISHING and DECLINING with its notice held in flight)."""
    if state is S.PREFILLING:
        h.run(lambda: h.out.pages_sent > 0)
    elif state in (S.FINISHING, S.DECLINING):
        h.run_to(S.TAIL)
        h.stream.held = True
        h.run_to(state)
    elif state is S.CANCELLING:
        h.run(lambda: h.out.pages_sent > 0)
        # its writes held in flight: on a loaded machine the first one may have landed already,
        # and the abort notice would then go out at once, before the test's next move
        h.stream.held = True
        h.transfers.stop_writing(h.rid)  # the RPC's thread; cancel() follows on the loop
    else:
        h.run_to(state)
    assert h.state is state


@pytest.mark.parametrize("state", [S.PREFILLING, S.TAIL, S.FINISHING, S.DECLINING, S.CANCELLING],
                         ids=lambda s: s.name)
def test_a_cancel_in_any_state_sends_abort_once_nothing_is_in_flight(engine, agents, state):
    h = Handoff(engine, agents, f"cancel-{state.name}", write_nothing=state is S.DECLINING)
    _hold_in(h, state)
    h.transfers.cancel(h.rid)
    assert h.state is S.CANCELLING
    h.stream.held = False
    h.run_to_end()
    assert h.trail()[-2:] == [S.CANCELLING, S.CANCELLED]
    assert_legal(h.trail())
    with pytest.raises(TransferError, match="cancelled"):
        h.fut.result()
    assert [n.kind for n in h.notices()] == ["abort"]  # decode told once, after the writes settled
    assert_all_pages_free(engine)


@pytest.mark.parametrize("state", [S.PREFILLING, S.TAIL, S.FINISHING, S.DECLINING, S.CANCELLING],
                         ids=lambda s: s.name)
def test_a_failed_write_or_notice_fails_the_request_and_frees_its_pages(engine, agents, state):
    """The decode worker goes away (its peer is dropped: in-flight writes fail, new ones and
    the notice cannot be sent) while the handoff is in `state`."""
    prefill = agents[0]
    with KvTransferAgent(f"outgoing-gone-{state.name}", torch.zeros_like(engine.pool.buffer)) as gone:
        h = Handoff(engine, (prefill, gone), f"fail-{state.name}", write_nothing=state is S.DECLINING,
                    peer_id=f"decode-{state.name}")
        if state is S.PREFILLING:
            prefill.remove_peer(h.peer.worker_id)  # before the first write
        else:
            _hold_in(h, state)
            prefill.remove_peer(h.peer.worker_id)
            h.stream.held = False
        h.run_to_end()
        assert h.notices(timeout_s=0.2) == []
    end = S.CANCELLED if state is S.CANCELLING else S.FAILED
    assert h.trail()[-2:] == [state, end]
    assert_legal(h.trail())
    with pytest.raises(HandoffFailed, match="KV transfer to the decode worker failed") as failed:
        h.fut.result()
    assert_all_pages_free(engine)
    # where its time went until then, for the request's spans: compute to its first token (or to
    # its cancel, or its end, where it had none) and the send to its end, which is the failure
    t = failed.value.times
    assert t.phase.arrived <= t.send_started <= t.send_ended == h.out.entered(end)
    assert t.phase.computed == (h.out.entered(S.TAIL) or h.out.entered(S.CANCELLING) or h.out.entered(end))
    from tests.helpers.gateway_support import in_memory_spans
    provider, exporter = in_memory_spans()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("prefill") as parent:
        handoff_spans(tracer, parent, t, {"duet.request_id": h.rid}, failed.value.kv_bytes, error=str(failed.value))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"queue", "kv_send", "prefill"} <= set(spans) and spans["kv_send"].parent.span_id == \
        spans["prefill"].context.span_id
    assert spans["kv_send"].status.status_code.name == "ERROR" and "failed" in spans["kv_send"].status.description
    assert ("compute" in spans) == (t.phase.scheduled is not None)


def test_a_request_the_engine_ends_before_its_first_token_aborts(engine, agents):
    h = Handoff(engine, agents, "ended")
    h.run(lambda: h.out.pages_sent > 0)
    engine.abort(h.rid)  # ended by the engine, not by the RPC
    h.run_to_end()
    assert h.trail() == [S.PREFILLING, S.CANCELLING, S.CANCELLED]
    with pytest.raises(TransferError, match="ended before its first token"):
        h.fut.result()
    assert [n.kind for n in h.notices()] == ["abort"]
    assert_all_pages_free(engine)


@pytest.mark.parametrize("state", [S.PREFILLING, S.TAIL], ids=lambda s: s.name)
def test_a_handoff_past_its_capabilitys_lifetime_stops_writing_and_aborts(engine, agents, state):
    """The reservation's write capability runs out while pages are still to write: nothing
    more is posted, decode gets an abort notice (MACed with the capability's secret) once the
    writes in flight settled, the RPC fails saying why, and the pages are freed."""
    h = Handoff(engine, agents, f"expire-{state.name}")
    _hold_in(h, state)
    sent = h.out.pages_sent
    h.out.deadline = time.monotonic()  # the lifetime ends now
    h.transfers.tick()  # the loop's next tick, before any engine step: nothing more is posted
    assert h.state in (S.CANCELLING, S.CANCELLED)
    h.run_to_end()
    assert h.trail()[-3:] == [state, S.CANCELLING, S.CANCELLED]
    assert_legal(h.trail())
    assert h.out.pages_sent == sent  # no page posted after the deadline
    with pytest.raises(TransferError, match="write capability expired"):
        h.fut.result()
    [notice] = h.notices()
    assert notice.kind == "abort" and notice.signed_by(SECRET) and not notice.signed_by(bytes(16))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("state", [S.PREFILLING, S.TAIL, S.FINISHING, S.DECLINING], ids=lambda s: s.name)
def test_a_handoff_whose_decode_left_and_went_silent_is_cancelled_when_its_lease_lapses(engine, agents, state):
    """The transfer's lease holds while its decode instance is in the registry or a write
    lands. Decode leaves the registry (here: a set of live instances the test controls) with a
    write or the notice still in flight: the lease lapses `lease_s` later, nothing more is
    posted, the abort notice goes out once the writes in flight settle, the RPC fails saying
    why, the pages are freed, and the lapse is counted."""
    from shared.telemetry.metrics import DuetMetrics
    metrics = DuetMetrics("prefill", process_metrics=False)
    live = {("decode-0", "nonce-1")}
    lease_s = 0.2
    transfers = OutgoingTransfers(engine, metrics, is_live=lambda wid, nonce: (wid, nonce) in live, lease_s=lease_s)
    h = Handoff(engine, agents, f"lease-{state.name}", write_nothing=state is S.DECLINING, transfers=transfers)
    _hold_in(h, state)
    h.stream.held = True  # its writes (or notice) stay in flight: no progress renews the lease
    h.out.bytes_seen = h.stream.bytes_sent  # writes that landed before the hold renewed it already
    live.clear()  # decode left the registry
    left, renewed = time.monotonic(), h.out.lease_until - lease_s
    if state is S.TAIL:  # TAIL lasts one tick (its next posts the rest): the lease ran out before it
        h.out.lease_until = renewed = left - lease_s
    while h.state is state:  # the loop's ticks (no engine step: the state moves only by the lease)
        assert time.monotonic() - left < 10, "the lease never lapsed"
        h.transfers.tick()
        time.sleep(0.005)
    assert h.state is S.CANCELLING
    assert h.out.entered(S.CANCELLING) - renewed >= lease_s  # not before the lease ran out
    sent = h.out.pages_sent
    h.stream.held = False  # the writes in flight settle
    h.run_to_end()
    assert h.trail()[-3:] == [state, S.CANCELLING, S.CANCELLED]
    assert_legal(h.trail())
    assert h.out.pages_sent == sent
    with pytest.raises(TransferError, match="lease lapsed"):
        h.fut.result()
    [notice] = h.notices()
    assert notice.kind == "abort" and notice.signed_by(SECRET)
    assert metrics.lease_expiries.labels(kind="transfer")._value.get() == 1
    assert_all_pages_free(engine)


def test_a_revoke_from_decode_cancels_the_transfer_or_refuses_the_reservation(engine, agents, caplog):
    """Decode revokes a reservation whose lease lapsed (services/decode/revoker.py): a transfer
    into it is cancelled (abort notice once the writes in flight settled); one that comes with
    another secret's MAC changes nothing. For a reservation with no transfer here, the answer is
    an abort echoing the revoke's token at once, and a later start() for it is refused."""
    from shared.kv_transfer.notice import REVOCATIONS
    from shared.kv_transfer.notice_inbox import NoticeInbox
    prefill, decode = agents
    inbox = NoticeInbox(prefill)
    transfers = OutgoingTransfers(engine, revocations=inbox.view(REVOCATIONS), agent=prefill)
    h = Handoff(engine, agents, "revoked", transfers=transfers)
    to_prefill = decode.add_peer("prefill-0", "nonce-p", prefill.metadata(), prefill.pool_info)

    def revoke(reservation_id: int, generation: int, key: bytes, ack: str = "t0k") -> None:
        decode.send_notif(to_prefill, TransferNotice(
            reservation_id=reservation_id, generation=generation, rank=0, kind="revoke", num_ranks=1,
            reply_to="decode-0", reply_nonce="nonce-1", ack=ack, key=key).encode())

    h.run(lambda: h.out.pages_sent > 0)
    h.stream.held = True
    revoke(5, 2, key=bytes(16))  # not the capability's holder: ignored (and logged)
    revoke(5, 2, key=SECRET)
    with caplog.at_level(logging.WARNING, logger="duet.prefill"):
        while h.state is S.PREFILLING:  # the loop's ticks, no engine step
            h.transfers.tick()
            time.sleep(0.005)
    assert "ignored a revoke of reservation 5/2 without its capability's MAC" in caplog.text
    h.stream.held = False
    h.run_to_end()
    assert h.trail() == [S.PREFILLING, S.CANCELLING, S.CANCELLED]
    with pytest.raises(TransferError, match="revoked the reservation"):
        h.fut.result()
    assert [n.kind for n in h.notices()] == ["abort"]

    revoke(9, 1, key=b"", ack="echo-me")  # nothing here for reservation 9: refused, answered at once
    end = time.monotonic() + 5
    while ("decode-0", "nonce-1", 9, 1) not in transfers.revoked:
        assert time.monotonic() < end, "the revoke never arrived"
        transfers.tick()
        time.sleep(0.01)
    [answer] = h.notices()
    assert (answer.kind, answer.reservation_id, answer.generation, answer.ack, answer.num_ranks) == \
        ("abort", 9, 1, "echo-me", 1)
    stream = PageWriteStream(prefill, h.peer, DST_PAGES)
    with pytest.raises(TransferError, match="revoked"):
        transfers.start("late", PROMPT, SamplingParams(max_tokens=4, temperature=0), stream, reservation_id=9,
                        generation=1, secret=SECRET, decode=("decode-0", "nonce-1"))
    assert "late" not in transfers.active and engine.get("late") is None
    stream = PageWriteStream(prefill, h.peer, DST_PAGES)  # the same ids of a restarted decode instance
    fut = transfers.start("restarted", PROMPT, SamplingParams(max_tokens=4, temperature=0), stream,
                          reservation_id=9, generation=1, secret=SECRET, decode=("decode-0", "nonce-2"))
    transfers.cancel("restarted")
    while not fut.done():
        transfers.tick()
        time.sleep(0.005)
    assert_all_pages_free(engine)


def test_moves_the_table_lacks_are_refused(engine, agents):
    every = [(s, e) for s in OutgoingState for e in OutgoingEvent]
    refused = [(s, e) for s, e in every if not OUTGOING.allows(s, e)]
    assert len(refused) + len(OUTGOING.moves) == len(every)
    for s, e in refused:
        with pytest.raises(IllegalMove):
            OUTGOING.next(s, e, "handoff of request x")
    assert OUTGOING.terminal == {S.DONE, S.FAILED, S.CANCELLED}
    for s in set(OutgoingState) - OUTGOING.terminal:  # a cancel or a failed stream may come at any time
        assert OUTGOING.allows(s, E.CANCEL) and OUTGOING.allows(s, E.STREAM_FAILED), s
    # a first token that comes after the RPC gave up moves nothing (the engine stops at its next step)
    h = Handoff(engine, agents, "late-first")
    h.run(lambda: h.out.pages_sent > 0)
    h.transfers.stop_writing(h.rid)
    h.stream.held = True  # the abort notice waits: the engine computes on until cancel() reaches the loop
    h.run(lambda: engine.get(h.rid).status is ReqStatus.HELD)
    assert h.state is S.CANCELLING
    h.transfers.cancel(h.rid)
    h.stream.held = False
    h.run_to_end()
    assert h.trail() == [S.PREFILLING, S.CANCELLING, S.CANCELLED] and h.out.first is None
    assert_all_pages_free(engine)
