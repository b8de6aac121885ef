"""The Prefill gRPC service: compute a prompt, write its KV into a decode reservation,
return the first token.

Nothing is written, and no notice sent, unless the reservation's write capability verifies
(shared/kv_transfer/capability.py): signed by the decode worker instance it names (the key in
its registry entry), for this prefill worker, not taken before. Otherwise the call is refused
with PERMISSION_DENIED and the reason; the pages it names are never touched."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.prefill.capability_uses import CapabilityUses
from services.prefill.handoff_spans import handoff_spans
from services.prefill.outgoing import HandoffFailed, PrefillResult
from services.worker_runtime.context import WorkerContext
from services.worker_runtime.grammar_check import compile_ahead
from shared.kv_transfer.agent import TransferError
from shared.kv_transfer.capability import refusal
from shared.kv_transfer.head_plan import PairingError, plan_head_copies
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.tp_write_stream import TpWriteStream
from shared.kv_transfer.write_stream import rank_stream
from shared.registry.peers import PeerNotFound
from shared.registry.prefix_hashes import chained_page_hashes
from shared.wire.cache_scope import cache_scope_from_proto
from shared.wire.fault import FAULT_KEY
from shared.wire.outputs import PrefillAnswer, prefill_reply_to_proto
from shared.wire.reservation import KvReservation, reservation_from_proto
from shared.wire.resume import resumed_from_proto
from shared.wire.sampling import sampling_from_proto

log = logging.getLogger("duet.prefill")

# on a failure that lies with the decode worker (it left the registry, its writes failed): the
# gateway migrates the request away from that decode worker, not from this prefill worker
DECODE_FAULT = ((FAULT_KEY, "decode"),)


class PrefillService(duet_pb2_grpc.PrefillServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._notices: set[asyncio.Task] = set()  # abort notices on their way
        self._uses = CapabilityUses()

    async def Prefill(self, request: duet_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        handoff = _Handoff(request.request_id or uuid.uuid4().hex, arrived=time.monotonic())
        res = reservation_from_proto(request.reservation)
        answered = False
        try:
            reply = await self._prefill(request, res, context, handoff)
            answered = True
            return reply
        finally:
            if not answered:  # refused, failed or cancelled (the caller left) at any point
                self._abandon(res, handoff)

    async def _prefill(self, request: duet_pb2.PrefillRequest, res: KvReservation, context, handoff: "_Handoff"):
        ctx = self.ctx
        rid = handoff.rid
        with ctx.span("prefill", context, request_id=rid, prompt_tokens=len(request.prompt_token_ids)) as span:
            await self._authorize(res, context, handoff)
            if res.compat_hash != ctx.compat_hash or res.page_size != ctx.page_size:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"reservation layout {res.compat_hash}/{res.page_size} does not match "
                                    f"this prefill worker's {ctx.compat_hash}/{ctx.page_size}")
            if not res.ranks:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reservation has no destination pages")
            try:
                params = sampling_from_proto(request.sampling)
                resumed = resumed_from_proto(request)  # a migrated stream: the tokens it streamed
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            await compile_ahead(ctx, params, context)
            ranks = sorted(r.rank for r in res.ranks)
            if ranks != list(range(len(ranks))):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reservation names ranks {ranks}")
            pages = {r.rank: list(r.page_ids) for r in res.ranks}
            if any(pages[r] != pages[0] for r in ranks):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "a tensor-parallel reservation must name the same pages on every rank")
            try:
                peer = await ctx.peers.get(res.decode_worker_id, res.decode_instance_nonce, res.compat_hash)
                specs = ctx.peers.rank_specs(peer, len(ranks))
            except PeerNotFound as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=DECODE_FAULT)
            try:  # which of our ranks writes which heads into which decode rank (cached per layout pair)
                plan = plan_head_copies([a.pool for a in ctx.rank_agents], [s.pool for s in specs])
            except PairingError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill worker {ctx.worker_id} (tp {ctx.config.engine.tp_size}) cannot write into decode "
                                    f"worker {res.decode_worker_id} (tp {len(ranks)}): {exc}")
            mine = {c.dst_rank for c in plan if c.src_rank == 0} | {0}
            decode_peers = {j: ctx.peers.add(specs[j]) for j in sorted(mine)}
            prompt = resumed.kv_tokens
            scope = cache_scope_from_proto(request)  # its namespace: prefill's own prefix cache, the held hashes' seed
            held = res.held_pages
            if held < 0 or held * ctx.page_size > len(prompt):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"reservation holds {held} pages of a {len(prompt)}-token prompt")
            # never trust a hint for correctness: skip the held pages only if they are this prompt's
            mismatch = held > 0 and chained_page_hashes(prompt[:held * ctx.page_size], ctx.page_size,
                                                        seed=scope.cache_key) != res.held_page_hashes
            if mismatch:
                log.warning("request %s: decode %s holds %d pages that are not this prompt's; it will recompute",
                            rid, res.decode_worker_id, held)

            def start():  # on the engine loop: a TP stream queues its followers' share there
                with ctx.outgoing.lock:
                    if handoff.gone:  # the caller left while this waited for the loop
                        return None
                    stream = rank_stream(ctx.agent, 0, decode_peers, plan, pages[0])
                    if ctx.config.engine.tp_size > 1:
                        stream = TpWriteStream(stream, ctx.outgoing.followers, specs, pages[0], plan)
                    fut = ctx.outgoing.start(rid, resumed.prompt, params, stream, res.reservation_id,
                                             res.generation, held_pages=held, write_nothing=mismatch, scope=scope,
                                             secret=res.capability.secret, deadline=handoff.deadline,
                                             request_group=request.request_group, output_prefix=resumed.streamed,
                                             decode=(res.decode_worker_id, res.decode_instance_nonce))
                    handoff.started = True  # from here OutgoingTransfers tells decode how it ended
                    return fut
            try:
                fut = await ctx.loop.acall(start)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except TransferError as exc:  # decode revoked the reservation: another decode worker may serve it
                ctx.metrics.request_finished("Prefill", grpc.StatusCode.UNAVAILABLE)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=DECODE_FAULT)
            try:
                result = await asyncio.wrap_future(fut)  # cancelled (the caller left): _abandon stops it
            except TransferError as exc:
                if isinstance(exc, HandoffFailed):  # its queue, compute and send so far, the send failed
                    handoff_spans(ctx.tracer, span, exc.times, {"duet.request_id": rid}, exc.kv_bytes, error=str(exc))
                ctx.metrics.request_finished("Prefill", grpc.StatusCode.UNAVAILABLE)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=DECODE_FAULT)
            ctx.metrics.request_finished("Prefill", grpc.StatusCode.OK)
            self._observe(handoff.arrived, result, span, rid)
            return prefill_reply_to_proto(PrefillAnswer(result.firsts, result.cached_tokens, result.computed_tokens,
                                                        result.kv_bytes), prompt)

    def _observe(self, arrived: float, result: PrefillResult, span, rid: str) -> None:
        """A handed-off prompt's latencies (first token sampled; the answer, the handoff
        included) and its queue, compute and kv_send spans under the request's span."""
        ctx, times = self.ctx, result.times
        series = ctx.metrics.latency("prefill")
        series.ttft.observe(times.phase.computed - arrived)
        series.e2e.observe(time.monotonic() - arrived)
        attributes = {"duet.request_id": rid, "duet.prompt_tokens": result.computed_tokens + result.cached_tokens,
                      "duet.cached_tokens": result.cached_tokens, "duet.computed_tokens": result.computed_tokens}
        handoff_spans(ctx.tracer, span, times, attributes, result.kv_bytes)

    async def _authorize(self, res: KvReservation, context, handoff: "_Handoff") -> None:
        """Refuse (PERMISSION_DENIED, nothing written, no notice) unless res's write capability
        verifies with its decode instance's key, names this worker and was not taken before.
        Its lifetime counts from now (later than decode's count: decode's deadline comes first)."""
        ctx = self.ctx
        if ctx.peers is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {ctx.config.role} worker writes no KV")
        try:
            key = await ctx.peers.capability_key(res.decode_worker_id, res.decode_instance_nonce)
        except PeerNotFound as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        reason, why = refusal(res, ctx.worker_id, key)
        if not reason and not self._uses.take(res.decode_worker_id, res.decode_instance_nonce,
                                              res.reservation_id, res.generation):
            reason, why = "reused", "this reservation's write capability was used already"
        if reason:
            log.warning("refused a Prefill for reservation %s/%s of %s: %s", res.reservation_id, res.generation,
                        res.decode_worker_id, why)
            ctx.metrics.kv_writes_refused.labels(reason=reason).inc()
            ctx.metrics.request_finished("Prefill", grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        handoff.secret = res.capability.secret
        handoff.deadline = time.monotonic() + res.capability.lifetime_ms / 1000.0

    # -- a request that ends unanswered ----------------------------------------------------------
    def _abandon(self, res: KvReservation, handoff: "_Handoff") -> None:
        """Decode holds res's pages until it learns no write can land. A started request stops
        writing now (its abort notice goes out at once when no write is in flight, else when
        they land) and stops computing at the next step; one never started (and, with `gone`
        set, never to be) gets an abort notice now: no write of ours was ever issued."""
        ctx, rid = self.ctx, handoff.rid
        with ctx.outgoing.lock:
            handoff.gone = True
            started = handoff.started
        if started:
            ctx.outgoing.stop_writing(rid)
            ctx.loop.call(lambda: ctx.outgoing.cancel(rid))  # a no-op once it ended
        elif handoff.secret:  # only the capability's holder speaks for the reservation
            task = asyncio.ensure_future(self._send_abort_notice(res, rid, handoff.secret))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    async def _send_abort_notice(self, res: KvReservation, rid: str, secret: bytes) -> None:
        ctx = self.ctx
        notice = TransferNotice(reservation_id=res.reservation_id, generation=res.generation, rank=0,
                                request_id=rid, kind="abort", num_ranks=1, key=secret)
        try:
            peer = await ctx.peers.get(res.decode_worker_id, res.decode_instance_nonce, res.compat_hash)
            ctx.agent.send_notif(peer, notice.encode())
        except Exception as exc:  # decode then frees the pages by its own rules (cancel, registry)
            log.info("request %s: could not tell decode worker %s that reservation %d will not be "
                     "written: %s", rid, res.decode_worker_id, res.reservation_id, exc)


@dataclass
class _Handoff:
    """Whether OutgoingTransfers took a request over, and whether its RPC gave up; both set
    under ctx.outgoing.lock, so a start() still queued on the loop and a caller that left
    agree on who tells decode (and only once its capability verified: `secret`)."""

    rid: str
    arrived: float  # monotonic time the call came in
    started: bool = False
    gone: bool = False
    secret: bytes = b""  # set once the write capability verified: its notices' MAC key
    deadline: float = float("inf")  # monotonic end of the capability's lifetime here
