"""The disaggregated path behind the GenerationBackend interface: the router picks a
(prefill, decode) pair, decode reserves KV pages for the request, prefill computes the
prompt's KV into them and returns the first token, decode streams the rest.

    Router.Route -> Decode.Reserve -> Prefill.Prefill (first token: sent to the client at
    once) -> Decode.Generate (the rest) -> Router.Release

or, when the router answers `colocated`, one Decode.Generate on a `both` worker
(docs/ARCHITECTURE.md, "One request, end to end").

Cleanup is owed on every exit: a reservation not handed to Decode.Generate is
cancelled, an open RPC is cancelled (grpc.aio cancels the call when the awaiting task
is cancelled, and we cancel the stream explicitly), and the router is told the request
is done. Cleanup RPCs run in tasks of their own so that a cancelled request (client gone)
still completes them. A reservation's Cancel says whether we ever sent it to prefill (if
not, decode frees its pages at once: no write can land); a Reserve that got no answer
(cancelled in flight) is cancelled by request id, since decode may have made it anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from prometheus_client import CollectorRegistry

from protos import duet_pb2, duet_pb2_grpc
from services.gateway.backends.capacity import WorkerCapacity
from services.gateway.backends.generate_mux import GenerateMux
from services.gateway.backends.grpc_adapters import RuntimeAdapters
from services.gateway.backends.interface import (
    BackendBadRequest,
    BackendBusy,
    BackendError,
    BackendUnavailable,
    GenerationRequest,
    TokenEvent,
)
from services.gateway.backends.lease_keeper import LeaseKeeper
from services.gateway.backends.migration import Attempt, MigrationConfig, RebuiltTokens, SequenceStreams, WorkerLost
from services.gateway.backends.migration_metrics import MigrationMetrics
from services.gateway.backends.stream_merge import merged
from services.gateway.backends.token_events import token_event
from shared.transport.keepalive import keepalive_options
from shared.registry.pairing import pair_problem
from shared.registry.connection import RedisConnection
from shared.security.grpc_tls import GrpcTlsConfig
from shared.security.identity import server_name
from shared.wire.cache_scope import cache_scope_fields
from shared.telemetry.propagation import extract_http_context, inject_grpc_metadata
from shared.wire.contract_overflow import ContractOverflow
from shared.wire.fault import fault_of
from shared.wire.outputs import chunk_from_proto, first_tokens_to_proto, prefill_reply_from_proto
from shared.wire.sampling import sampling_to_proto

log = logging.getLogger("duet.gateway.grpc")

_BUSY_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED}
_ROUTER_RETRY_S = 0.2
# what gRPC says when a connection went away under a call (the peer's process died), not a server's answer
_TRANSPORT_LOSS = ("Stream removed", "Socket closed", "Connection reset", "connection reset")


def _connection_lost(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() is grpc.StatusCode.UNAVAILABLE and any(t in (exc.details() or "") for t in _TRANSPORT_LOSS)


_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND}
_BAD_REQUEST_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
# a worker went away or dropped the call: another worker can make it good (migration.py); a
# restarted decode worker knows no reservation of its old instance (NOT_FOUND)
_LOST_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN}
_ADAPTER_RECORD_CHECK_S = 2.0  # how often the run-time LoRA record is checked for a Redis that lost it
_NO_WORKER_RETRY_S = 0.5  # a moved attempt finding no live worker asks the router again after this
# A router restarted (duet up's supervisor, a k8s pod) is dialled again within about a second, not
# after gRPC's default backoff (1 s growing to 120 s); Route waits for it (wait_for_ready).
_ROUTER_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                           ("grpc.max_reconnect_backoff_ms", 1000))
# Reserve's own refusals: decode made no reservation
_REFUSED_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                  grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class GrpcBackendConfig:
    router_address: str
    model: str = ""                 # served model name, sent to the router (the default model)
    extra_models: list[str] = field(default_factory=list)  # the other base models served (names)
    max_context_len: int = 0
    redis_url: str | None = None    # optional: page size for prefix hashes, readiness by live workers
    registry_prefix: str = "duet"
    reserve_timeout_ms: int = 0     # decode admission wait; 0 = decode's default
    rpc_timeout_s: float = 600.0    # bound on Reserve / Prefill
    route_timeout_s: float = 15.0   # bound on Route: the router answers at once or is down
    cleanup_timeout_s: float = 5.0  # bound on Cancel / Release
    keepalive_s: float = 10.0       # pings on worker connections with calls in flight (0 = none)
    keepalive_timeout_s: float = 5.0  # an unanswered ping past this ends the connection's calls
    tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)  # to router and workers
    redis: RedisConnection = field(default_factory=RedisConnection)  # registry password, TLS
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # failover (migration.py)


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> BackendError:
    """A failed RPC as the BackendError the HTTP layer maps to a status."""
    code, detail = exc.code(), exc.details() or exc.code().name
    message = f"{what}: {detail}"
    if code in _BUSY_CODES:
        return BackendBusy(message, retry_after_s=1.0)
    if code in _UNAVAILABLE_CODES:
        return BackendUnavailable(message)
    if code in _BAD_REQUEST_CODES:
        return BackendBadRequest(detail)
    return BackendError(message)


@dataclass
class _Channels:
    """One channel per worker and service, replaced when the worker's address or instance nonce
    changes (a restart: never reuse a channel, or anything cached, across instances). Under TLS
    the worker's certificate must name it serving that service (shared/security/identity.py):
    an address from a forged registry entry fails the handshake and gets no request."""

    tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)
    options: tuple = ()  # every channel's (keepalive_options)
    channels: dict[tuple[str, str], tuple[str, str, grpc.aio.Channel]] = field(default_factory=dict)
    muxes: dict[str, tuple[grpc.aio.Channel, GenerateMux]] = field(default_factory=dict)  # by decode worker id

    def get(self, ref: duet_pb2.WorkerRef, service: str) -> grpc.aio.Channel:
        known = self.channels.get((ref.worker_id, service))
        if known is not None and known[:2] == (ref.address, ref.instance_nonce):
            return known[2]
        if known is not None:
            old = known[2]
            # Calls still running on it finish or fail on their own; close it shortly.
            asyncio.get_running_loop().call_later(30, lambda: asyncio.ensure_future(old.close()))
        channel = self.tls.aio_channel(ref.address, server_name(service, ref.worker_id), self.options)
        self.channels[(ref.worker_id, service)] = (ref.address, ref.instance_nonce, channel)
        return channel

    def streams(self, ref: duet_pb2.WorkerRef) -> GenerateMux:
        """The Generate streams to a decode worker: one call for all of them on its channel."""
        channel = self.get(ref, "decode")
        known = self.muxes.get(ref.worker_id)
        if known is None or known[0] is not channel:  # a new instance: its old call ends with its channel
            known = self.muxes[ref.worker_id] = (channel, GenerateMux(channel))
        return known[1]

    async def close(self) -> None:
        for _, mux in self.muxes.values():
            await mux.close()
        self.muxes.clear()
        for _, _, channel in self.channels.values():
            await channel.close()
        self.channels.clear()


class GrpcBackend:
    def __init__(self, config: GrpcBackendConfig, migration_metrics: MigrationMetrics | None = None,
                 tracer: trace.Tracer | None = None):
        """migration_metrics: in the gateway's registry (a registry of its own without)."""
        self.config = config
        self.migration_metrics = migration_metrics or MigrationMetrics(CollectorRegistry())
        self._tracer = tracer or trace.get_tracer("duet-gateway")
        self._router_channel: grpc.aio.Channel | None = None
        self._router: duet_pb2_grpc.RouterStub | None = None
        self._workers = _Channels(config.tls, keepalive_options(config.keepalive_s, config.keepalive_timeout_s))
        self._watcher = None
        self._cleanups: set[asyncio.Task] = set()
        self.runtime_adapters = RuntimeAdapters()  # loaded at run time: kept in the registry (grpc_adapters.py)
        self._record_task: asyncio.Task | None = None
        self.leases = LeaseKeeper(config.cleanup_timeout_s)  # our reservations live on decode while renewed
        # prompt tokens waiting in this gateway's admission (the app sets it): sent with each route
        self.admission_backlog: Callable[[str], int] = lambda model: 0  # of a model's requests
        self.gateway_id = uuid.uuid4().hex  # with it the router sums every gateway's backlog

    # --- lifecycle --------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def models(self) -> list[str]:
        """Every base model this gateway serves, the default first."""
        return [self.config.model, *self.config.extra_models]

    @property
    def max_context_len(self) -> int:
        return self.config.max_context_len

    async def start(self) -> None:
        self._router_channel = self.config.tls.aio_channel(self.config.router_address, server_name("router"),
                                                           options=_ROUTER_CHANNEL_OPTIONS)
        self._router = duet_pb2_grpc.RouterStub(self._router_channel)
        if self.config.redis_url:
            from shared.registry.config import RegistryConfig
            from shared.registry.watcher import WorkerWatcher

            registry = RegistryConfig(redis_url=self.config.redis_url, prefix=self.config.registry_prefix,
                                      connection=self.config.redis)
            # one model: only its entries; several: all, each read by the model it serves
            one = self.config.model if not self.config.extra_models else None
            self._watcher = WorkerWatcher(registry, model=one or None)
            await self._watcher.start()
            self._record_task = asyncio.create_task(self._keep_adapter_record(), name="lora-record")

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=self.config.cleanup_timeout_s)
        if self._record_task is not None:
            self._record_task.cancel()
            await asyncio.gather(self._record_task, return_exceptions=True)
        await self.leases.close()
        if self._watcher is not None:
            await self._watcher.stop()
        await self._workers.close()
        if self._router_channel is not None:
            await self._router_channel.close()

    def ready(self) -> bool:
        """The router is reachable and, when we watch the registry, a usable set for each
        of our models is live: a `both` worker, a prefill and a decode worker that can pair
        (same KV layout, heads coverable at their TP sizes), or decode workers with no prefill
        worker live (each prefills its requests itself, as the router places them then)."""
        if self._router_channel is None:
            return False
        state = self._router_channel.get_state(try_to_connect=True)
        if state != grpc.ChannelConnectivity.READY:
            return False
        return self._watcher is None or not self.models_without_workers()

    def models_without_workers(self) -> list[str]:
        """Our models with no usable set of live workers (all of them without the registry)."""
        if self._watcher is None:
            return self.models
        missing = []
        for model in self.models:
            if self._workers_of(model, "both"):
                continue
            decodes, prefills = self._workers_of(model, "decode"), self._workers_of(model, "prefill")
            if decodes and not prefills:
                continue
            if not any(not pair_problem(p, d) for p in prefills for d in decodes):
                missing.append(model)
        return missing

    def _workers_of(self, model: str | None = None, role: str | None = None):
        """Live workers of `model` (of any of ours when None), of `role` when given."""
        if self._watcher is None:
            return []
        workers = self._watcher.workers(role)
        if not self.config.extra_models:
            return workers  # the watcher keeps our one model's entries only
        names = set(self.models) if model is None else {model}
        return [w for w in workers if w.model in names]

    def live_capacity(self, model: str | None = None) -> list[WorkerCapacity]:
        """From the registry (each worker publishes its pool and batch cap), the workers of
        `model` when given; [] without it."""
        return [WorkerCapacity(w.role, w.load.total_pages, w.page_size, w.max_running_requests, w.max_batched_tokens)
                for w in self._workers_of(model)]

    # --- LoRA adapters (grpc_adapters.py) --------------------------------------------------

    def adapters(self) -> list[str]:
        return sorted(self.adapter_parents())

    def adapter_parents(self) -> dict[str, str]:
        """Each adapter some live worker serves -> the base model those workers serve."""
        from services.gateway.backends.grpc_adapters import served_adapters
        parents: dict[str, str] = {}
        for model in self.models:
            parents.update((name, model) for name in served_adapters(self._workers_of(model)))
        return parents

    async def load_adapter(self, name: str, path: str, model: str | None = None) -> None:
        from services.gateway.backends.grpc_adapters import load_everywhere
        # a Redis restarted empty since the last pass: what it lost goes back before this load
        # marks the record as standing
        view = self._registry_view(model)
        await self.runtime_adapters.restore(view)
        await load_everywhere(view, self._workers, name, path, self.config.rpc_timeout_s)
        self.runtime_adapters.remember(name, path, model or self.config.model)

    async def unload_adapter(self, name: str) -> None:
        from services.gateway.backends.grpc_adapters import served_adapters, unload_everywhere
        self.runtime_adapters.forget(name)
        # every model's workers serving it (a name given at start to two pools is both models');
        # none, or one model: the default view, which says so when nobody serves it
        models = [m for m in self.models if name in served_adapters(self._workers_of(m))] \
            if self.config.extra_models else []
        for model in models or [None]:
            await unload_everywhere(self._registry_view(model), self._workers, name, self.config.rpc_timeout_s)

    async def _keep_adapter_record(self) -> None:
        """Write back what a Redis restarted empty lost of the run-time adapter record."""
        while True:
            await asyncio.sleep(_ADAPTER_RECORD_CHECK_S)
            await self.runtime_adapters.restore(self._watcher)

    def _registry_view(self, model: str | None = None):
        """The workers a run-time adapter goes to: `model`'s (an adapter fits one model's shapes
        only; None: the default model's)."""
        if self._watcher is None:
            raise BackendUnavailable("LoRA adapters at run time need the registry (--redis-url)")
        if not self.config.extra_models:
            return self._watcher  # it keeps our one model's entries only
        return _OneModel(self._watcher, model or self.config.model)

    def _page_size(self, model: str) -> int:
        """The page size of `model`'s live workers (each model's pool has its own)."""
        sizes = {w.page_size for w in self._workers_of(model or None) if w.page_size > 0}
        return sizes.pop() if len(sizes) == 1 else 0  # mixed sizes: the hashes would not match

    # --- the request -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self._router is None:
            raise BackendUnavailable("the gateway backend is not started")
        try:
            sampling_to_proto(request.sampling)  # what the contract cannot carry: a 400 before anything
        except ContractOverflow as exc:
            raise BackendBadRequest(str(exc), exc.field) from None
        metadata = tuple((k.lower(), v) for k, v in request.trace_context.items())
        async with aclosing(self._serve(request, Attempt.first(request), metadata)) as events:
            async for event in events:
                yield event

    async def _serve(self, request: GenerationRequest, attempt: Attempt, metadata,
                     record: "_AttemptRecord | None" = None) -> AsyncIterator[TokenEvent]:
        """One attempt's events; when a worker of it is lost, its open sequences go on
        elsewhere from the tokens the client has (migration.py)."""
        record = record or _AttemptRecord()
        streams = SequenceStreams()
        try:
            async with aclosing(self._attempt(request, attempt, metadata, record)) as events:
                async for event in events:
                    streams.add(event.index, event.token_ids, event.finish_reason is not None)
                    yield event
            return
        except WorkerLost as exc:
            lost = exc
        limit = self.config.migration.limit
        if not attempt.may_move(lost, limit):
            self.migration_metrics.given_up.labels(reason="limit").inc()
            if limit:
                log.warning("request %s: %s; moved %d times already, giving up", request.request_id, lost,
                            attempt.moves)
            raise lost
        nexts = attempt.next_attempts(request, streams, lost, record.checkpoint)
        # a stream handed over is planned (a role switch spreading the batch), not a failure
        log.log(logging.INFO if lost.cause == "handed_over" else logging.WARNING,
                "request %s: %s; continuing %s elsewhere", request.request_id, lost,
                ", ".join(f"sequence {a.indices[0] if len(a.indices) == 1 else 'all'} after "
                          f"{len(a.prompt.streamed)} tokens" for a in nexts))
        failed_at = time.monotonic()
        lanes = [self._continue(request, nxt, lost, failed_at) for nxt in nexts]
        async with aclosing(lanes[0] if len(lanes) == 1 else merged(lanes)) as events:
            async for event in events:
                yield event

    async def _continue(self, request: GenerationRequest, attempt: Attempt, lost: WorkerLost,
                        failed_at: float) -> AsyncIterator[TokenEvent]:
        """A moved attempt under a `migrate` span of the request's trace: its first token
        within the deadline counted from the failure, then the rest."""
        self.migration_metrics.migrations.labels(cause=lost.cause).inc()
        parent = extract_http_context(request.trace_context)
        span = self._tracer.start_span("migrate", context=parent, attributes={
            "duet.request_id": request.request_id, "duet.attempt_id": attempt.request_id,
            "duet.migration.cause": lost.cause, "duet.migration.lost_worker": lost.worker_id,
            "duet.migration.move": attempt.moves, "duet.migration.streamed_tokens": len(attempt.prompt.streamed),
            "duet.migration.sequences": list(attempt.indices)})
        span.add_event("worker_lost", {"duet.worker_id": lost.worker_id, "duet.error": str(lost)})
        metadata = tuple(inject_grpc_metadata(trace.set_span_in_context(span)))
        record = _AttemptRecord(span=span)
        deadline = self.config.migration.deadline_s
        async with aclosing(self._serve(request, attempt, metadata, record)) as events:
            try:
                first = await asyncio.wait_for(anext(events), max(0.0, failed_at + deadline - time.monotonic()))
            except StopAsyncIteration:
                span.end()
                return
            except asyncio.TimeoutError:
                self.migration_metrics.given_up.labels(reason="deadline").inc()
                span.set_attribute("duet.migration.outcome", "deadline")
                span.end()
                raise BackendUnavailable(f"{lost}; no worker took the stream over within {deadline:g} s") from None
            except BaseException as exc:  # failed for good, or the client left
                span.set_attribute("duet.migration.outcome", type(exc).__name__)
                span.end()
                raise
            span.set_attribute("duet.migration.outcome", "resumed")
            span.set_attribute("duet.decode_worker", record.decode_worker)
            span.end()
            yield first
            async for event in events:
                yield event

    async def _attempt(self, request: GenerationRequest, attempt: Attempt, metadata,
                       record: "_AttemptRecord") -> AsyncIterator[TokenEvent]:
        """One pass through router and workers: Route, then Reserve + Prefill + Generate
        (split) or one Generate (colocated). Events carry the request's sequence indices. A
        failure another worker can make good is a WorkerLost."""
        sampling = sampling_to_proto(attempt.sampling)
        want_logprobs = attempt.sampling.logprobs is not None
        state = _RequestState(attempt.request_id)
        prompt = attempt.prompt
        first_events = not attempt.prompt.streamed  # usage's cached tokens come from the first attempt
        decode = None
        try:
            route = await self._route_attempt(request, attempt, metadata)
            state.routed = True
            if request.on_routed is not None:
                request.on_routed(route.cached_tokens, route.local_prefill)  # the worker that prefills holds these
            record.checkpoint, record.decode_worker = route.checkpoint, route.decode.worker_id
            decode = duet_pb2_grpc.DecodeStub(self._workers.get(route.decode, "decode"))
            scope = cache_scope_fields(request.cache_scope)
            generate = duet_pb2.GenerateRequest(request_id=attempt.request_id, request_group=request.group,
                                                sampling=sampling, **prompt.fields(),
                                                **scope)
            if not route.colocated:
                reply = await self._reserve_and_prefill(request, attempt, route, decode, sampling, metadata, state)
                answer = prefill_reply_from_proto(reply, attempt.request_id, want_logprobs)
                if any(out.finish_reason == "abort" for out in answer.firsts):
                    raise WorkerLost("the prefill worker aborted the request", "prefill", route.prefill.worker_id,
                                     route.prefill.instance_nonce)
                if attempt.resumed:
                    res = state.reservation
                    self._rebuilt(record, RebuiltTokens.of_split(len(prompt.kv_tokens), res.held_pages * res.page_size,
                                                                 answer.computed_tokens))
                # TTFT is prefill time: the first tokens go out before decode starts. When they
                # already end the request (EOS, stop token, max_tokens=1) decode never runs
                # and the `finally` below cancels the reservation.
                open_seqs = {out.index for out in answer.firsts if not out.finished}
                for out in answer.firsts:
                    event = token_event(out, request.prompt_token_ids, want_logprobs,
                                        cached_tokens=answer.cached_tokens if first_events else None,
                                        computed_tokens=answer.computed_tokens if first_events else None)
                    event.index = attempt.indices[out.index]
                    yield event
                if not open_seqs:
                    return
                generate.reservation.CopyFrom(state.reservation)  # relayed as decode sent it
                generate.prefill_worker_id = route.prefill.worker_id
                first_tokens_to_proto(generate, answer.firsts)
            else:
                open_seqs = set(range(attempt.sampling.n))
            # Split: prefill's cached count is the one that matters (decode computed no prompt).
            async for event in self._decode_stream(route, generate, metadata, want_logprobs, state,
                                                   attempt, record, open_seqs=open_seqs,
                                                   report_cached=route.colocated and first_events):
                yield event
        finally:
            # Runs on success, failure, early close (stop string) and cancellation (client left).
            state.drop_lease(self.leases)
            if state.reservation is not None and not state.completed:
                self._cleanup(self._cancel_reservation(decode, state))  # idempotent on decode
            elif state.reserve_unanswered:
                self._cleanup(self._cancel_unanswered_reserve(decode, state))
            if state.stream is not None and not state.stream_done:
                state.stream.cancel()  # decode drops the request and frees its pages
            if state.routed:
                self._cleanup(self._release(attempt.request_id, duet_pb2.RELEASE_STAGE_DONE))

    def _rebuilt(self, record: "_AttemptRecord", tokens: RebuiltTokens) -> None:
        """Where a moved attempt's KV came from: the metric, and its migrate span."""
        self.migration_metrics.rebuilt(tokens)
        if record.span is not None and record.span.is_recording():
            for source, count in tokens.by_source().items():
                record.span.set_attribute(f"duet.migration.rebuilt_{source}_tokens", count)

    async def _route_attempt(self, request: GenerationRequest, attempt: Attempt, metadata) -> duet_pb2.RouteReply:
        """Route; a moved attempt waits for a worker (its deadline bounds it) while none is live."""
        while True:
            try:
                return await self._route(request, attempt, metadata)
            except BackendUnavailable:
                if not attempt.resumed:
                    raise
            await asyncio.sleep(_NO_WORKER_RETRY_S)

    async def _route(self, request: GenerationRequest, attempt: Attempt, metadata) -> duet_pb2.RouteReply:
        from shared.registry.prefix_hashes import chained_page_hashes

        page_size = self._page_size(request.model)
        prompt = attempt.prompt.kv_tokens
        # seeded with the namespace: the workers publish their pages' hashes the same way
        hashes = (chained_page_hashes(prompt, page_size, seed=request.cache_scope.cache_key) if page_size else [])
        route = duet_pb2.RouteRequest(
            request_id=attempt.request_id, model=request.model, prompt_tokens=len(prompt),
            max_tokens=attempt.remaining_tokens, page_hashes=hashes, n=attempt.sampling.n,
            exclude_instances=attempt.exclude, exclude_decode_instances=attempt.exclude_decode,
            checkpoint=attempt.checkpoint,
            lora_adapter=request.cache_scope.adapter, admission_waiting_tokens=self.admission_backlog(request.model),
            gateway_id=self.gateway_id)
        deadline = time.monotonic() + self.config.route_timeout_s
        while True:
            try:  # a router being restarted is waited for (within the route timeout), not a 503
                return await self._router.Route(route, metadata=metadata, wait_for_ready=True,
                                                timeout=max(0.1, deadline - time.monotonic()))
            except grpc.aio.AioRpcError as exc:
                # the router died with the call on its connection (no answer came back): ask the
                # restarted one; the router's own UNAVAILABLE ("no worker") is an answer, not retried
                if not (_connection_lost(exc) and time.monotonic() < deadline - _ROUTER_RETRY_S):
                    raise rpc_error(exc, "router") from None
            await asyncio.sleep(_ROUTER_RETRY_S)

    async def _reserve_and_prefill(self, request, attempt: Attempt, route, decode, sampling, metadata,
                                   state) -> duet_pb2.PrefillReply:
        state.reserve_unanswered = True  # until an answer: decode may have made one we never hear of
        scope = cache_scope_fields(request.cache_scope)
        prompt = attempt.prompt.kv_tokens
        try:
            state.reservation = await decode.Reserve(duet_pb2.ReserveRequest(
                request_id=attempt.request_id, prompt_tokens=len(prompt),
                max_tokens=attempt.remaining_tokens, prefill_worker_id=route.prefill.worker_id,
                timeout_ms=self.config.reserve_timeout_ms, n=attempt.sampling.n, request_group=request.group,
                prompt_token_ids=prompt,  # decode reuses what it holds of it
                **scope),
                metadata=metadata, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED_CODES:  # decode answered: it holds nothing for us
                state.reserve_unanswered = False
            what = f"decode worker {route.decode.worker_id} (reserve)"
            if exc.code() in _LOST_CODES:
                raise _lost(exc, what, "decode_reserve", route.decode) from None
            raise rpc_error(exc, what) from None
        state.reserve_unanswered = False
        state.lease_on = route.decode
        self.leases.hold(decode, route.decode, state.reservation)  # until decode has our Generate
        prefill = duet_pb2_grpc.PrefillStub(self._workers.get(route.prefill, "prefill"))
        state.prefill_sent = True  # from here prefill may write: decode waits for its notice
        try:
            reply = await prefill.Prefill(duet_pb2.PrefillRequest(
                request_id=attempt.request_id, sampling=sampling, reservation=state.reservation,
                request_group=request.group, **attempt.prompt.fields(), **scope),
                metadata=metadata, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            what = f"prefill worker {route.prefill.worker_id}"
            if exc.code() in _LOST_CODES:
                if fault_of(exc.trailing_metadata()) == "decode":  # its writes into decode failed
                    raise _lost(exc, what, "kv_handoff", route.decode) from None
                raise _lost(exc, what, "prefill", route.prefill) from None
            raise rpc_error(exc, what) from None
        self._cleanup(self._release(attempt.request_id, duet_pb2.RELEASE_STAGE_PREFILL_DONE))
        return reply

    async def _decode_stream(self, route, generate, metadata, want_logprobs, state, attempt: Attempt,
                             record: "_AttemptRecord", report_cached: bool,
                             open_seqs: set[int]) -> AsyncIterator[TokenEvent]:
        state.stream = self._workers.streams(route.decode).open(generate, metadata)  # one call per decode worker
        lost = lambda message: WorkerLost(message, "decode_stream", route.decode.worker_id,  # noqa: E731
                                          route.decode.instance_nonce)
        try:
            async for chunk in state.stream:
                state.drop_lease(self.leases)  # decode claimed the reservation: the stream keeps it
                out, usage = chunk_from_proto(chunk, generate.request_id, want_logprobs)
                if out.finish_reason == "abort":
                    state.stream_done = True
                    raise lost("the decode worker aborted the request")
                if out.finish_reason == "moved":  # handed over after a role switch (SetRole)
                    state.stream_done = True
                    raise WorkerLost("the decode worker handed the stream over", "handed_over",
                                     route.decode.worker_id, route.decode.instance_nonce)
                if out.finished:
                    open_seqs.discard(out.index)
                done = not open_seqs or out.request_finished  # usage comes with the last chunk
                if done:
                    state.stream_done = state.completed = True
                    if attempt.resumed and route.colocated and usage is not None:
                        self._rebuilt(record, RebuiltTokens.of_local(len(generate.prompt_token_ids),
                                                                     usage.cached_tokens))
                if out.token_ids or out.finished or out.prompt_logprobs is not None:
                    cached = usage.cached_tokens if report_cached and usage is not None else None
                    # the prompt (copied out of the message) only for prompt logprobs: a copy per
                    # token cost ~0.1 ms at a 4k prompt
                    prompt = request_prompt(generate) if out.prompt_logprobs is not None else []
                    event = token_event(out, prompt, want_logprobs, cached_tokens=cached)
                    event.index = attempt.indices[out.index]
                    yield event
                if done:
                    return
        except grpc.aio.AioRpcError as exc:
            state.stream_done = True
            if exc.code() in _LOST_CODES:
                raise _lost(exc, "decode worker (generate)", "decode_stream", route.decode) from None
            raise rpc_error(exc, "decode worker (generate)") from None
        state.stream_done = True
        raise lost("the decode stream ended without a finish reason")

    # --- cleanup ------------------------------------------------------------------------

    def _cleanup(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _cancel_reservation(self, decode, state: "_RequestState") -> None:
        reservation = state.reservation
        try:
            await decode.Cancel(duet_pb2.CancelRequest(reservation_id=reservation.reservation_id,
                                                       generation=reservation.generation,
                                                       prefill_not_sent=not state.prefill_sent),
                                timeout=self.config.cleanup_timeout_s)
        except Exception as exc:  # best effort: decode also frees it when the writer goes away
            log.warning("request %s: cancelling reservation %d failed: %s", state.request_id,
                        reservation.reservation_id, exc)

    async def _cancel_unanswered_reserve(self, decode, state: "_RequestState") -> None:
        try:
            await decode.Cancel(duet_pb2.CancelRequest(request_id=state.request_id),
                                timeout=self.config.cleanup_timeout_s)
        except Exception as exc:  # best effort
            log.warning("request %s: cancelling an unanswered reservation failed: %s", state.request_id, exc)

    async def _release(self, request_id: str, stage: int) -> None:
        try:
            await self._router.Release(duet_pb2.ReleaseRequest(request_id=request_id, stage=stage),
                                       timeout=self.config.cleanup_timeout_s)
        except Exception as exc:  # best effort: the router forgets unreleased requests by TTL
            log.debug("request %s: router release failed: %s", request_id, exc)


@dataclass
class _OneModel:
    """A registry watcher seen through one model's entries (grpc_adapters.py reads `workers`,
    `model`, `client` and `keys`)."""
    watcher: object
    model: str

    def workers(self, role: str | None = None) -> list:
        return [w for w in self.watcher.workers(role) if w.model == self.model]

    @property
    def client(self):
        return self.watcher.client

    @property
    def keys(self):
        return self.watcher.keys


@dataclass
class _AttemptRecord:
    """What an attempt learnt on the way, for the one that may follow it."""
    checkpoint: str = ""     # the router's choice's checkpoint fingerprint: a move stays on it
    decode_worker: str = ""
    span: object = None      # a moved attempt's `migrate` span


def _lost(exc: grpc.aio.AioRpcError, what: str, cause: str, worker: duet_pb2.WorkerRef) -> WorkerLost:
    return WorkerLost(f"{what}: {exc.details() or exc.code().name}", cause, worker.worker_id, worker.instance_nonce)


def request_prompt(generate: duet_pb2.GenerateRequest) -> list[int]:
    """The prompt of a Generate request, without a moved stream's tokens (prompt logprobs index it)."""
    ids = generate.prompt_token_ids
    return list(ids[:len(ids) - generate.resumed_output_tokens])


@dataclass
class _RequestState:
    request_id: str
    routed: bool = False
    reservation: duet_pb2.Reservation | None = None
    reserve_unanswered: bool = False  # Reserve was sent and neither answered nor refused
    prefill_sent: bool = False    # the reservation went to a prefill worker (writes may land)
    stream: object | None = None  # the Decode.Generate call
    stream_done: bool = False     # the call ended (finish, error): nothing to cancel
    completed: bool = False       # decode finished the request: its reservation is used up
    lease_on: duet_pb2.WorkerRef | None = None  # the decode worker we renew the reservation's lease on

    def drop_lease(self, leases: LeaseKeeper) -> None:
        if self.lease_on is not None:
            leases.drop(self.lease_on, self.reservation)
            self.lease_on = None
