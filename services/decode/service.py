"""The Decode gRPC service: admission (Reserve/Cancel) and token streaming (Generate).

Generate with a reservation waits for prefill's completion notice, joins the request to
the running batch and streams from the second token on. If the notice does not come in
time (or the writer is gone, or it aborted) decode recomputes the prompt itself into fresh
pages, unless configured to fail. Without a reservation it serves the whole request
(colocated, a `both` worker)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.decode.generate_timing import GenerateTiming
from services.decode.reservation_state import ReservationState
from services.decode.reserve_queue import ReserveWait
from services.decode.reservations import ReservationGone, waiter_for
from services.decode.stream_mux import GenerateStreamsServicer
from services.worker_runtime.context import WorkerContext
from services.worker_runtime.grammar_check import compile_ahead
from shared.admission.context_rule import completion_budget
from shared.admission.kv_demand import check_fits, kv_demand
from shared.registry.prefix_hashes import chained_page_hashes
from shared.wire.cache_scope import cache_scope_from_proto
from shared.wire.lease import renew_reply_to_proto, renew_request_from_proto
from shared.wire.outputs import Usage, chunk_to_proto, first_token_ids_from_proto, tokens_to_proto
from shared.wire.reservation import KvReservation, RankPages, reservation_to_proto
from shared.wire.resume import ResumedPrompt, resumed_from_proto
from shared.wire.sampling import sampling_from_proto

log = logging.getLogger("duet.decode")


class DecodeService(GenerateStreamsServicer, duet_pb2_grpc.DecodeServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    # -- admission ------------------------------------------------------------------------
    async def Reserve(self, request: duet_pb2.ReserveRequest, context):
        ctx = self.ctx
        if ctx.book is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {ctx.config.role} worker takes no reservations")
        eng = ctx.engine
        n = max(request.n, 1)
        if request.prompt_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens must be positive")
        try:  # what can never fit here is the caller's mistake, not a reason to retry
            max_tokens = completion_budget(max(request.max_tokens, 1), None, request.prompt_tokens, eng.max_model_len)
            check_fits(kv_demand(request.prompt_tokens, max_tokens, n, ctx.page_size), eng.kv.capacity,
                       f"decode worker {ctx.worker_id}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prompt_ids = list(request.prompt_token_ids) or None
        scope = cache_scope_from_proto(request)
        if scope.adapter and (eng.lora is None or not eng.lora.knows(scope.adapter)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"decode worker {ctx.worker_id} does not serve LoRA adapter {scope.adapter!r}")
        if prompt_ids is not None and len(prompt_ids) != request.prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt_token_ids has {len(prompt_ids)} ids for prompt_tokens {request.prompt_tokens}")
        # the caller may ask for a shorter wait, never a longer one than this worker allows
        wait_s = ctx.config.reserve_timeout_s
        if request.timeout_ms:
            wait_s = min(wait_s, request.timeout_ms / 1000.0)
        queue = ctx.reserve_queue
        if len(queue) >= ctx.config.reserve_queue_max:
            ctx.metrics.request_finished("Reserve", grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker {ctx.worker_id} has {len(queue)} reservations waiting")
        with ctx.span("reserve", context, request_id=request.request_id) as span:
            res = await self._wait_for_room(ReserveWait(
                request.request_id, request.prompt_tokens, request.max_tokens, request.prefill_worker_id, n,
                prompt_ids, on_grant=None, group=request.request_group or request.request_id, scope=scope),
                wait_s, context)
            span.set_attribute("duet.held_tokens", res.held_pages * ctx.page_size)
            await self._until_ready(res)
        # the writer checks the held pages' hashes against its prompt before skipping them
        held_hashes = chained_page_hashes(prompt_ids[:res.held_pages * ctx.page_size], ctx.page_size,
                                          seed=scope.cache_key) if res.held_pages else []
        answer = KvReservation(
            reservation_id=res.reservation_id, generation=res.generation, decode_worker_id=ctx.worker_id,
            decode_instance_nonce=ctx.instance_nonce, page_size=ctx.page_size,
            num_layers=eng.layout.num_layers, kv_dtype=str(eng.kv_dtype).removeprefix("torch."),
            compat_hash=ctx.compat_hash, held_pages=res.held_pages, held_page_hashes=held_hashes,
            # TP ranks mirror rank 0's page table
            ranks=[RankPages(rank, agent.name, list(res.page_ids)) for rank, agent in enumerate(ctx.rank_agents)],
            lease_ttl_ms=int(ctx.book.lease_s * 1000))  # its holder renews it within this (RenewLease)
        # only the writer the caller named may write these pages, for the reservation's lifetime
        answer.capability = ctx.issuer.issue(answer, res.writer_id, int(ctx.book.ttl_s * 1000), res.secret)
        return reservation_to_proto(answer)

    async def _wait_for_room(self, wait: ReserveWait, wait_s: float, context):
        """Queue the call (ReserveQueue: granted on the engine loop as soon as it fits) until
        it is granted or wait_s passes (RESOURCE_EXHAUSTED). A grant it will not take (the
        caller left, or it came as the wait ended) is withdrawn: freed at once."""
        ctx = self.ctx
        aloop = asyncio.get_running_loop()
        granted: asyncio.Future = aloop.create_future()
        wait.on_grant = lambda res: aloop.call_soon_threadsafe(_settle_future, granted, res)
        await ctx.loop.acall_or_undo(lambda: ctx.reserve_queue.add(wait), lambda: ctx.reserve_queue.withdraw(wait))
        try:
            res = await asyncio.wait_for(asyncio.shield(granted), wait_s)
        except asyncio.TimeoutError:
            ctx.loop.call(lambda: ctx.reserve_queue.withdraw(wait))
            ctx.metrics.request_finished("Reserve", grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker {ctx.worker_id} has no room after {wait_s:.1f}s")
        except BaseException:  # the caller left
            ctx.loop.call(lambda: ctx.reserve_queue.withdraw(wait))
            raise
        if res is None and wait.refusal:  # its LoRA adapter was unloaded meanwhile, or its folder no longer reads
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, wait.refusal)
        if res is None:  # a refusal like no room: decode holds nothing for it
            ctx.metrics.request_finished("Reserve", grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {wait.request_id} was cancelled "
                                                                    "before its reservation was made")
        return res

    async def _until_ready(self, res) -> None:
        """Hand res out once launched GPU work that may touch its pages has run. Cancelled
        meanwhile (the caller left), it was never handed out: free it now."""
        try:
            while res.ready_event is not None and not res.ready_event.query():
                await asyncio.sleep(0.0005)  # at most one in-flight step
        except BaseException:
            self.ctx.loop.call(lambda: self.ctx.book.cancel(res.reservation_id, res.generation, unsent=True))
            raise

    async def Cancel(self, request: duet_pb2.CancelRequest, context):
        book = self.ctx.book
        if book is None:
            return duet_pb2.CancelReply(cancelled=False)
        if not request.reservation_id and request.request_id:  # a Reserve whose answer never arrived
            ok = await self.ctx.loop.acall(lambda: book.cancel_request(request.request_id))
        else:
            ok = await self.ctx.loop.acall(lambda: book.cancel(request.reservation_id, request.generation,
                                                               unsent=request.prefill_not_sent))
        return duet_pb2.CancelReply(cancelled=ok)

    async def RenewLease(self, request: duet_pb2.RenewLeaseRequest, context):
        """The caller keeps its unclaimed reservations here another lease; the reply names the
        ones it no longer holds."""
        book = self.ctx.book
        keys = renew_request_from_proto(request)
        if book is None:
            return renew_reply_to_proto(keys)
        return renew_reply_to_proto(await self.ctx.loop.acall(lambda: book.renew(keys)))

    # -- streaming ------------------------------------------------------------------------
    async def Generate(self, request: duet_pb2.GenerateRequest, context):
        ctx = self.ctx
        rid = request.request_id or uuid.uuid4().hex
        timing = GenerateTiming.start(ctx.metrics, split=request.HasField("reservation"))
        try:
            params = sampling_from_proto(request.sampling)
            resumed = resumed_from_proto(request)  # a migrated stream: the tokens it streamed
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await compile_ahead(ctx, params, context)
        prompt = resumed.kv_tokens
        scope = cache_scope_from_proto(request)  # colocated or recomputed: split requests keep their reservation's
        split = request.HasField("reservation")
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with ctx.span("decode", context, request_id=rid, split=split) as span:
            spec = None  # speculative decoding: the sequences' stats, summed onto the span
            if split:
                started = await self._join_split(request, rid, resumed, params, aloop, q, context, scope, timing)
            else:
                started = await self._start_colocated(rid, resumed, params, aloop, q, context, scope,
                                                      request.request_group, timing)
            emitted = 1 if split else 0
            finished = started is not None and started.finished
            try:
                if started is not None:  # the request already ended at its first token
                    yield self._last_chunk(started, [], prompt, emitted)
                    return
                pending = None
                while True:
                    out, pending = pending or await q.get(), None
                    if out.error:
                        finished = True  # the engine ended it (counted once, as an error, not also cancelled)
                        ctx.metrics.request_finished("Generate", grpc.StatusCode.INTERNAL)
                        await context.abort(grpc.StatusCode.INTERNAL, out.error)
                    sent_before = emitted
                    emitted += len(out.token_ids)
                    timing.output(out)
                    tokens = tokens_to_proto(out)
                    # later outputs of the same sequence already queued go in this message: a
                    # stream that fell a few steps behind catches up in one write
                    while not out.finished and out.prompt_logprobs is None and not q.empty():
                        nxt = q.get_nowait()
                        if nxt.error or nxt.index != out.index or nxt.prompt_logprobs is not None:
                            pending = nxt
                            break
                        emitted += len(nxt.token_ids)
                        timing.output(nxt)
                        tokens += tokens_to_proto(nxt)
                        out = nxt
                    if out.spec is not None:
                        spec = spec_totals(spec, out.spec)
                    timing.sent(emitted - sent_before)
                    if out.request_finished:
                        finished = True
                        ended = out.finish_reason in ("abort", "moved")  # moved: handed over (SetRole)
                        ctx.metrics.request_finished("Generate", grpc.StatusCode.CANCELLED if ended
                                                     else grpc.StatusCode.OK)
                        if not ended:
                            timing.finished()
                        yield self._last_chunk(out, tokens, prompt, emitted)
                        return
                    yield chunk_to_proto(out, prompt, tokens)
            finally:
                if not finished:  # client went away: drop the request, free its pages
                    ctx.loop.call(lambda: (ctx.loop.detach(rid), ctx.engine.abort(rid)))
                    ctx.metrics.request_finished("Generate", grpc.StatusCode.CANCELLED)
                if spec is not None:
                    for k, v in spec.span_attributes().items():
                        span.set_attribute(f"duet.{k}", v)
                timing.spans(ctx.tracer, span, rid)

    @staticmethod
    def _last_chunk(out, tokens, prompt, emitted) -> duet_pb2.TokenChunk:
        return chunk_to_proto(out, prompt, tokens, Usage(len(prompt), emitted, out.num_cached_tokens))

    async def _start_colocated(self, rid, resumed: ResumedPrompt, params, aloop, q, context, scope, group: str,
                               timing: GenerateTiming):
        ctx = self.ctx

        def start():
            ctx.engine.add_request(resumed.prompt, params, rid=rid, scope=scope, output_prefix=resumed.streamed or None,
                                   request_group=group)
            timing.req = ctx.engine.get(rid)
            ctx.loop.attach(rid, aloop, q)
        try:
            await ctx.loop.acall_or_undo(start, lambda: (ctx.loop.detach(rid), ctx.engine.abort(rid)))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return None

    async def _join_split(self, request, rid, resumed: ResumedPrompt, params, aloop, q, context, scope,
                          timing: GenerateTiming):
        """Wait for the KV (or decide to recompute) and join the running batch. Returns a
        finished StepOutput if the request ended right away, else None."""
        ctx = self.ctx
        book = ctx.book
        if book is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker takes no reservations")
        msg = request.reservation
        event = asyncio.Event()

        def arm():
            return book.claim(msg.reservation_id, msg.generation, waiter_for(aloop, event))
        res = await ctx.loop.acall_or_undo(arm, lambda: book.cancel(msg.reservation_id, msg.generation))
        if res is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"reservation {msg.reservation_id}/{msg.generation} "
                                                           "is unknown, was cancelled or is claimed already")
        deadline = time.monotonic() + ctx.config.notice_timeout_s
        with ctx.span("kv_transfer_wait", None, request_id=rid):  # inside `decode`, the current span
            try:  # until the notice (NOTICED), a cancel by its caller, the deadline or the writer's leave
                while res.state is ReservationState.CLAIMED and time.monotonic() < deadline \
                        and ctx.is_live(res.writer_id):
                    try:
                        await asyncio.wait_for(event.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
            except asyncio.CancelledError:  # the caller left while we waited: give the pages back
                ctx.loop.call(lambda: book.cancel(res.reservation_id, res.generation))
                raise
        firsts = first_token_ids_from_proto(request)
        first = firsts[0]

        def join():
            if not res.claimed:  # its caller cancelled it meanwhile (and left)
                raise ReservationGone(f"reservation {res.reservation_id}/{res.generation} was cancelled")
            notice = res.notice
            if notice is not None and notice.kind == "done" and notice.first_token_id == first:
                book.consume(res)
                ctx.engine.add_prefilled(res.key, resumed.prompt, firsts, params, seed=None, rid=rid,
                                         output_prefix=resumed.streamed or None, request_group=request.request_group)
                mode = "transfer"
            else:
                if not ctx.config.recompute_on_missing_kv:
                    book.cancel(res.reservation_id, res.generation)
                    raise TimeoutError("the prefill worker's KV never arrived")
                book.cancel(res.reservation_id, res.generation)  # freed once no write can land
                ctx.engine.add_request(resumed.prompt, params, rid=rid, output_prefix=resumed.streamed + firsts,
                                       scope=scope, request_group=request.request_group)
                mode = "recompute"
                log.warning("request %s: KV from %s did not arrive (%s); recomputing the prompt",
                            rid, res.writer_id, notice.kind if notice else "no notice")
            ctx.recomputes += mode == "recompute"
            timing.req, timing.recomputed = ctx.engine.get(rid), mode == "recompute"
            if not ctx.engine.is_live(rid):  # the first token(s) already ended it
                from shared.engine.outputs import StepOutput
                return StepOutput(rid, [], finished=True, finish_reason="stop")
            ctx.loop.attach(rid, aloop, q)
            return None
        try:
            # the caller left: end the request if join started it, else free the reservation
            return await ctx.loop.acall_or_undo(join, lambda: (ctx.loop.detach(rid), ctx.engine.abort(rid),
                                                               book.cancel(res.reservation_id, res.generation)))
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ReservationGone as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _settle_future(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def spec_totals(total, stats):
    """Sum a finished sequence's speculation stats into the request's (a fresh object)."""
    from shared.engine.speculative.stats import SpecStats
    if total is None:
        total = SpecStats(stats.method)
    total.add(stats)
    return total
