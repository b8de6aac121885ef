"""Prefill side of a KV handoff, run on the engine-loop thread.

For each request: as chunks finish, whole pages are written into the decode worker's
reserved pages (so the transfer hides behind compute); when the first token is sampled,
the rest (the partial last page too) is written and the completion notice is queued
behind the writes. Pages the decode worker already holds (the reservation's held prefix,
checked by hash) are skipped; if its hashes do not match the prompt, nothing is written and
the notice says declined, so decode recomputes: a bad hint costs work, never a wrong token.
When every write has landed the request's pages are released into the prefix cache and the
RPC gets its answer. A failed write or a cancel releases the pages and tells decode (abort
notice) once nothing is in flight; so does the end of the write capability's lifetime while
pages are still to write (decode has quarantined the reservation by then), and the end of
the transfer's lease: renewed while the decode instance it writes to is in the registry or a
write landed since the last tick, it lapses `lease_s` after decode left and went silent (a
dead or partitioned decode worker), and the transfer is cancelled the same way (counted).
The pages are released only once no write is in flight (each lands, fails, or passes the write
timeout). Decode revokes a reservation whose own lease lapsed (services/decode/revoker.py): a
transfer into it is cancelled the same way; with none, the reservation is refused from then on
(`start` raises) and decode gets its abort at once, echoing the revoke's token. Every notice is
MACed with the capability's secret. Each handoff is in one state of the lifecycle in
outgoing_state.py; every change goes through `_move`, which refuses what the table forbids.

`lock` is held while a stream is touched (the loop's tick and hooks, start, cancel), not
during engine steps: stop_writing() from the RPC's thread then stops a request's writes at
once, and tells decode right away when none is in flight, instead of after a long step."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from services.prefill.outgoing_state import LEASED, OUTGOING, WRITING, OutgoingEvent, OutgoingState
from services.worker_runtime.phase_spans import PhaseTimes
from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.engine.outputs import StepOutput
from shared.engine.request import Req, ReqStatus
from shared.kv_transfer.agent import DONE, FAILED, TransferError
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.write_stream import PageWriteStream

log = logging.getLogger("duet.prefill")

REVOKED_KEPT = 4096  # revoked reservations a later start() is refused for


@dataclass
class HandoffTimes:
    """Where a handed-off prompt's time went here: its queue and compute (to the first token
    sampled) and its KV send, in monotonic seconds (the spans: services/prefill/service.py)."""

    phase: PhaseTimes
    send_started: float  # its first page posted (with none to write: its notice queued)
    send_ended: float  # every write landed and the notice went out
    pages: int  # pages written (held ones skipped)


class HandoffFailed(TransferError):
    """A handoff that ended without its done notice, with where its time went until then (the
    request's queue, compute and send spans: a failed request's trace shows them too)."""

    def __init__(self, message: str, times: HandoffTimes, kv_bytes: int):
        super().__init__(message)
        self.times, self.kv_bytes = times, kv_bytes


@dataclass
class PrefillResult:
    first: StepOutput
    firsts: list[StepOutput]  # every sequence's first token (n > 1), index order
    kv_bytes: int
    seconds: float
    computed_tokens: int
    cached_tokens: int
    times: HandoffTimes


@dataclass
class Outgoing:
    rid: str
    stream: PageWriteStream
    reservation_id: int
    generation: int
    num_prompt: int
    result: concurrent.futures.Future
    trail: list[tuple[OutgoingState, float]]  # every state entered, with its monotonic time; the last is now's
    held_pages: int = 0  # leading prompt pages decode holds: never written
    secret: bytes = b""  # the write capability's secret: every notice's MAC key
    deadline: float = float("inf")  # monotonic end of the capability's lifetime: no page is posted after it
    decode: tuple[str, str] = ("", "")  # the decode instance written to: (registry id, instance nonce)
    lease_until: float = float("inf")  # renewed while decode is live or writes land (OutgoingTransfers)
    bytes_seen: int = 0  # bytes landed at the last renewal
    write_nothing: bool = False  # the held prefix did not match the prompt: decode recomputes
    pages_sent: int = 0  # prompt pages written (or skipped as held), from the first
    first: StepOutput | None = None  # the first token (TAIL on)
    firsts: dict[int, StepOutput] = field(default_factory=dict)  # by sequence index
    error: str = ""  # why it failed, when the stream does not say
    req: Req | None = None  # the engine's request: when it was scheduled, its chunks
    first_post_at: float | None = None  # monotonic time its first page write was posted

    @property
    def state(self) -> OutgoingState:
        return self.trail[-1][0]

    def entered(self, state: OutgoingState) -> float | None:
        return next((t for s, t in reversed(self.trail) if s is state), None)


S, E = OutgoingState, OutgoingEvent


class OutgoingTransfers:
    """Owned by the engine-loop thread (every method runs there but stop_writing)."""

    def __init__(self, engine, metrics=None, followers=None, is_live: Callable[[str, str], bool] | None = None,
                 lease_s: float = 0.0, revocations=None, agent=None):
        """followers: FollowerStreams of a tensor-parallel worker (its streams are
        TpWriteStreams); one flush per tick sends the followers their share. is_live(worker
        id, nonce): the decode instance is in the registry; lease_s: how long a transfer goes on
        while it is not and no write lands (0, or no is_live: no lease). revocations: what gives
        decode's revoke notices (a NoticeInbox view); agent: where the answers go out from."""
        self.engine = engine
        self.is_live = is_live
        self.lease_s = lease_s
        self.revocations = revocations
        self.agent = agent
        # (decode id, instance nonce, reservation id, generation) of revoked reservations
        self.revoked: OrderedDict[tuple[str, str, int, int], None] = OrderedDict()
        self.metrics = metrics
        self.followers = followers
        self.page_size = engine.layout.page_size
        self.active: dict[str, Outgoing] = {}
        self.lock = threading.RLock()

    def start(self, rid: str, prompt_ids, params, stream: PageWriteStream,
              reservation_id: int, generation: int, held_pages: int = 0,
              write_nothing: bool = False, scope: CacheScope = DEFAULT_SCOPE, secret: bytes = b"",
              deadline: float = float("inf"), request_group: str = "",
              output_prefix: list[int] = (), decode: tuple[str, str] = ("", "")) -> concurrent.futures.Future:
        """held_pages: the reservation's leading pages decode already holds; the stream's
        pages are the ones after them. write_nothing: their hashes did not match. scope: the
        prefix-cache namespace and tenant of the request on this worker. secret, deadline: the
        reservation's write capability (notice MAC key; end of its lifetime on this process's
        monotonic clock). request_group: the client request it came from (the engine's fair
        turns). output_prefix: a migrated stream's completion tokens so far: their KV is written
        after the prompt's. decode: the (worker id, instance nonce) written to, whose liveness
        renews the transfer's lease."""
        if (*decode, reservation_id, generation) in self.revoked:
            raise TransferError(f"decode worker {decode[0]} revoked reservation {reservation_id}/{generation} "
                                "(its lease lapsed)")
        kv_tokens = len(prompt_ids) + len(output_prefix)
        if (held_pages + len(stream.dst_page_ids)) * self.page_size < kv_tokens:
            raise ValueError(f"reservation has {held_pages} held + {len(stream.dst_page_ids)} pages; the "
                             f"prompt needs {-(-kv_tokens // self.page_size)}")
        self.engine.add_request(prompt_ids, params, rid=rid, prefill_only=True, scope=scope,
                                output_prefix=list(output_prefix) or None, request_group=request_group)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        now = time.monotonic()
        self.active[rid] = Outgoing(rid, stream, reservation_id, generation, kv_tokens, fut,
                                    trail=[(S.PREFILLING, now)], held_pages=held_pages,
                                    write_nothing=write_nothing, pages_sent=held_pages, secret=secret,
                                    deadline=deadline, decode=decode, lease_until=now + self.lease_s,
                                    req=self.engine.get(rid))
        return fut

    def cancel(self, rid: str) -> None:
        with self.lock:
            out = self.active.get(rid)
            if out is None:
                return
            self._move(out, E.CANCEL)
            self.engine.abort(rid)  # stops prefill at the next step (or releases held pages)
            out.stream.abort(self._notice(out, "abort"))

    def stop_writing(self, rid: str) -> None:
        """Any thread: write nothing more for rid, and send decode its abort notice now if no
        write is in flight (else the loop sends it once they land). cancel() must follow, on
        the loop, to stop the computation. A TP stream's followers are the loop's: left to it."""
        with self.lock:
            out = self.active.get(rid)
            if out is None or out.state is S.CANCELLING or self.followers is not None:
                return
            self._move(out, E.CANCEL)
            out.stream.abort(self._notice(out, "abort"))

    def on_step(self, outs: list[StepOutput]) -> None:
        with self.lock:
            self._on_step(outs)

    def _on_step(self, outs: list[StepOutput]) -> None:
        for o in outs:
            out = self.active.get(o.rid)
            if out is not None and o.prefill_done and out.state in WRITING:
                out.firsts[o.index] = o  # all n arrive from the same step
                if o.index == 0 and out.state is S.PREFILLING:
                    out.first = o
                    self._move(out, E.FIRST_TOKEN)

    def _notice(self, out: Outgoing, kind: str) -> TransferNotice:
        token = out.first.token_ids[0] if out.first else -1
        return TransferNotice(reservation_id=out.reservation_id, generation=out.generation, rank=0,
                              request_id=out.rid, kind=kind, first_token_id=token, num_tokens=out.num_prompt,
                              key=out.secret)

    def tick(self) -> bool:
        with self.lock:
            return self._tick()

    def _tick(self) -> bool:
        self.engine.poll_kv_ready()
        if self.revocations is not None:
            for notice in self.revocations.get_notices():
                self._on_revoke(notice)
        for rid in list(self.active):
            self._advance(self.active[rid])
        if self.followers is not None and self.followers.flush():
            for rid in list(self.active):  # the followers' states just moved on
                self._settle(self.active[rid])
        return bool(self.active)

    def _advance(self, out: Outgoing) -> None:
        req = self.engine.get(out.rid)
        if req is None and out.state is S.PREFILLING:
            out.error = "the request ended before its first token"
            self._move(out, E.ENDED)
            out.stream.abort(self._notice(out, "abort"))
        if out.state in LEASED and self._lease_lapsed(out):
            if self.metrics is not None:
                self.metrics.lease_expiries.labels(kind="transfer").inc()
            self._give_up(out, E.LEASE_LAPSED, f"decode worker {out.decode[0]} left the registry and took no "
                                               f"write for {self.lease_s:g}s: the transfer's lease lapsed")
        if out.state in WRITING and time.monotonic() >= out.deadline:
            self._give_up(out, E.EXPIRE, "the reservation's write capability expired before its pages were written")
        if out.state in WRITING and out.stream.state not in (DONE, FAILED) and req is not None:
            held = req.status is ReqStatus.HELD
            # only pages the device has finished (a launched chunk may still be running), and
            # cached ones once their load back from the host tier has landed
            cached = req.num_cached_tokens if self.engine.kv.copy_landed(req.kv_load_ticket) else 0
            done = max(req.num_kv_ready, cached)
            ready = -(-out.num_prompt // self.page_size) if held else done // self.page_size
            ready = min(ready, len(req.page_ids))
            if ready > out.pages_sent and not out.write_nothing:
                try:
                    if out.first_post_at is None:
                        out.first_post_at = time.monotonic()
                    out.stream.write(out.pages_sent - out.held_pages, req.page_ids[out.pages_sent:ready])
                    out.pages_sent = ready
                except TransferError as exc:
                    out.error = str(exc)
            if held and out.state is S.TAIL and out.stream.state not in (DONE, FAILED):
                if out.write_nothing:  # decode recomputes; our answer stands
                    self._move(out, E.DECLINE)
                    out.stream.finish(self._notice(out, "declined"))
                elif out.pages_sent * self.page_size >= out.num_prompt:
                    self._move(out, E.FINISH)
                    out.stream.finish(self._notice(out, "done"))
        self._settle(out)

    def _on_revoke(self, notice: TransferNotice) -> None:
        """Decode's revoke (its reservation was cancelled while a write might land, or its
        lease lapsed): cancel a transfer into it; with none, refuse it from now on and answer
        with an abort echoing the revoke's token."""
        key = (notice.reply_to, notice.reply_nonce, notice.reservation_id, notice.generation)
        out = next((o for o in self.active.values() if (*o.decode, o.reservation_id, o.generation) == key), None)
        if out is not None:
            if not notice.signed_by(out.secret):
                log.warning("ignored a revoke of reservation %d/%d without its capability's MAC",
                            notice.reservation_id, notice.generation)
            elif out.state in LEASED:
                self._give_up(out, E.LEASE_LAPSED,
                              f"decode worker {notice.reply_to} revoked the reservation (cancelled, or its "
                              "lease lapsed)")
            return
        self.revoked[key] = None
        while len(self.revoked) > REVOKED_KEPT:
            self.revoked.popitem(last=False)
        peer = self.agent.peer(notice.reply_to) if self.agent is not None else None
        if peer is None:
            log.info("revoke of reservation %d/%d from %s: no transfer, and no peer to answer", notice.reservation_id,
                     notice.generation, notice.reply_to)
            return
        answer = TransferNotice(reservation_id=notice.reservation_id, generation=notice.generation, rank=0,
                                request_id=notice.request_id, kind="abort", num_ranks=1, ack=notice.ack)
        try:
            self.agent.send_notif(peer, answer.encode())
        except TransferError as exc:
            log.info("could not answer decode %s's revoke: %s", notice.reply_to, exc)

    def _give_up(self, out: Outgoing, event: OutgoingEvent, why: str) -> None:
        """Stop computing and posting pages; the abort notice follows the writes in flight."""
        out.error = why
        if event is E.LEASE_LAPSED:
            log.warning("request %s: %s; cancelling the transfer", out.rid, why)
        self._move(out, event)
        self.engine.abort(out.rid)
        out.stream.abort(self._notice(out, "abort"))

    def _lease_lapsed(self, out: Outgoing) -> bool:
        """Renew out's lease while its decode instance is live or a write landed since the
        last look; True once it lapsed."""
        if self.is_live is None or self.lease_s <= 0:
            return False
        now, landed = time.monotonic(), out.stream.bytes_sent
        if landed > out.bytes_seen or self.is_live(*out.decode):
            out.lease_until, out.bytes_seen = now + self.lease_s, landed
            return False
        return now >= out.lease_until

    def _settle(self, out: Outgoing) -> None:
        state = out.stream.poll()
        if state in (DONE, FAILED):
            self._complete(out, E.STREAM_DONE if state == DONE else E.STREAM_FAILED)

    def _move(self, out: Outgoing, event: OutgoingEvent) -> None:
        """Every state change goes through here (under `lock`)."""
        new = OUTGOING.next(out.state, event, f"handoff of request {out.rid}")
        if new is not out.state:
            out.trail.append((new, time.monotonic()))

    def _complete(self, out: Outgoing, event: OutgoingEvent) -> None:
        self._move(out, event)
        self.active.pop(out.rid, None)
        if self.engine.get(out.rid) is not None:
            if out.state is S.DONE:
                self.engine.release_held(out.rid)
            else:
                self.engine.abort(out.rid)
        now = time.monotonic()
        seconds = now - out.trail[0][1]
        sent = out.stream.bytes_sent
        if self.metrics is not None and sent:
            self.metrics.observe_kv_transfer("sent", sent, seconds)
            if out.state is S.DONE:  # from the first token to the notice: what the handoff adds to TTFT
                self.metrics.kv_handoff_tail_seconds.observe(now - out.entered(S.TAIL))
        if out.result.done():
            return
        if out.state is S.DONE:  # FINISHING or DECLINING: the first token is in hand
            req_cached = out.first.num_cached_tokens
            firsts = [out.firsts[i] for i in sorted(out.firsts)]
            out.result.set_result(PrefillResult(out.first, firsts, sent, seconds,
                                                computed_tokens=out.num_prompt - req_cached,
                                                cached_tokens=req_cached, times=self._times(out, now)))
        else:
            reason = out.error or out.stream.error or ("cancelled" if out.state is S.CANCELLED else "write failed")
            out.result.set_exception(HandoffFailed(f"KV transfer to the decode worker failed: {reason}",
                                                   self._failed_times(out), sent))

    def _failed_times(self, out: Outgoing) -> HandoffTimes:
        """A failed or cancelled handoff's times: compute to its first token, or to its cancel (the
        engine stopped it then), or to its end (the state it ended in); the send from its first
        page posted (none posted: empty) to its end."""
        now = out.trail[-1][1]
        computed = out.entered(S.TAIL) or out.entered(S.CANCELLING) or now
        phase = PhaseTimes.of(out.req, computed) if out.req is not None else PhaseTimes(out.trail[0][1], None, computed)
        return HandoffTimes(phase, send_started=out.first_post_at if out.first_post_at is not None else now,
                            send_ended=now, pages=max(0, out.pages_sent - out.held_pages))

    def _times(self, out: Outgoing, now: float) -> HandoffTimes:
        """A finished handoff's times (its notice queued after the first token: FINISHING or DECLINING)."""
        queued = out.entered(S.FINISHING) or out.entered(S.DECLINING) or now
        first = out.entered(S.TAIL)
        phase = PhaseTimes.of(out.req, first) if out.req is not None else PhaseTimes(out.trail[0][1], None, first)
        return HandoffTimes(phase, send_started=out.first_post_at if out.first_post_at is not None else queued,
                            send_ended=out.entered(S.DONE) or now, pages=out.pages_sent - out.held_pages)
