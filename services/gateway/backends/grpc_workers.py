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
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.gateway.backends.capacity import WorkerCapacity
from services.gateway.backends.interface import (
    BackendBadRequest,
    BackendBusy,
    BackendError,
    BackendUnavailable,
    GenerationRequest,
    TokenEvent,
)
from services.gateway.backends.token_events import token_event
from shared.registry.pairing import pair_problem
from shared.registry.connection import RedisConnection
from shared.security.grpc_tls import GrpcTlsConfig
from shared.security.identity import server_name
from shared.wire.cache_scope import cache_scope_fields
from shared.wire.contract_overflow import ContractOverflow
from shared.wire.outputs import chunk_from_proto, first_tokens_to_proto, prefill_reply_from_proto
from shared.wire.sampling import sampling_to_proto

log = logging.getLogger("duet.gateway.grpc")

_BUSY_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED}
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND}
_BAD_REQUEST_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
# Reserve's own refusals: decode made no reservation
_REFUSED_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                  grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class GrpcBackendConfig:
    router_address: str
    model: str = ""                 # served model name, sent to the router
    max_context_len: int = 0
    redis_url: str | None = None    # optional: page size for prefix hashes, readiness by live workers
    registry_prefix: str = "duet"
    reserve_timeout_ms: int = 0     # decode admission wait; 0 = decode's default
    rpc_timeout_s: float = 600.0    # bound on Reserve / Prefill
    route_timeout_s: float = 15.0   # bound on Route: the router answers at once or is down
    cleanup_timeout_s: float = 5.0  # bound on Cancel / Release
    tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)  # to router and workers
    redis: RedisConnection = field(default_factory=RedisConnection)  # registry password, TLS


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
    channels: dict[tuple[str, str], tuple[str, str, grpc.aio.Channel]] = field(default_factory=dict)

    def get(self, ref: duet_pb2.WorkerRef, service: str) -> grpc.aio.Channel:
        known = self.channels.get((ref.worker_id, service))
        if known is not None and known[:2] == (ref.address, ref.instance_nonce):
            return known[2]
        if known is not None:
            old = known[2]
            # Calls still running on it finish or fail on their own; close it shortly.
            asyncio.get_running_loop().call_later(30, lambda: asyncio.ensure_future(old.close()))
        channel = self.tls.aio_channel(ref.address, server_name(service, ref.worker_id))
        self.channels[(ref.worker_id, service)] = (ref.address, ref.instance_nonce, channel)
        return channel

    async def close(self) -> None:
        for _, _, channel in self.channels.values():
            await channel.close()
        self.channels.clear()


class GrpcBackend:
    def __init__(self, config: GrpcBackendConfig):
        self.config = config
        self._router_channel: grpc.aio.Channel | None = None
        self._router: duet_pb2_grpc.RouterStub | None = None
        self._workers = _Channels(config.tls)
        self._watcher = None
        self._cleanups: set[asyncio.Task] = set()

    # --- lifecycle --------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def max_context_len(self) -> int:
        return self.config.max_context_len

    async def start(self) -> None:
        self._router_channel = self.config.tls.aio_channel(self.config.router_address, server_name("router"))
        self._router = duet_pb2_grpc.RouterStub(self._router_channel)
        if self.config.redis_url:
            from shared.registry.config import RegistryConfig
            from shared.registry.watcher import WorkerWatcher

            registry = RegistryConfig(redis_url=self.config.redis_url, prefix=self.config.registry_prefix,
                                      connection=self.config.redis)
            self._watcher = WorkerWatcher(registry, model=self.config.model or None)
            await self._watcher.start()

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=self.config.cleanup_timeout_s)
        if self._watcher is not None:
            await self._watcher.stop()
        await self._workers.close()
        if self._router_channel is not None:
            await self._router_channel.close()

    def ready(self) -> bool:
        """The router is reachable and, when we watch the registry, a usable set for our
        model is live: a `both` worker, or a prefill and a decode worker that can pair
        (same KV layout, heads coverable at their TP sizes; a decode worker alone cannot
        serve a split request)."""
        if self._router_channel is None:
            return False
        state = self._router_channel.get_state(try_to_connect=True)
        if state != grpc.ChannelConnectivity.READY:
            return False
        if self._watcher is not None:
            if self._watcher.workers("both"):
                return True
            decodes = self._watcher.workers("decode")
            return any(not pair_problem(p, d) for p in self._watcher.workers("prefill") for d in decodes)
        return True

    def live_capacity(self) -> list[WorkerCapacity]:
        """From the registry (each worker publishes its pool and batch cap); [] without it."""
        if self._watcher is None:
            return []
        return [WorkerCapacity(w.role, w.load.total_pages, w.page_size, w.max_running_requests, w.max_batched_tokens)
                for w in self._watcher.workers()]

    def _page_size(self) -> int:
        if self._watcher is None:
            return 0
        sizes = {w.page_size for w in self._watcher.workers() if w.page_size > 0}
        return sizes.pop() if len(sizes) == 1 else 0  # mixed sizes: the hashes would not match

    # --- the request -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self._router is None:
            raise BackendUnavailable("the gateway backend is not started")
        metadata = tuple((k.lower(), v) for k, v in request.trace_context.items())
        try:
            sampling = sampling_to_proto(request.sampling)
        except ContractOverflow as exc:
            raise BackendBadRequest(str(exc), exc.field) from None
        want_logprobs = request.sampling.logprobs is not None
        state = _RequestState(request.request_id)
        decode = None
        try:
            route = await self._route(request, metadata)
            state.routed = True
            decode = duet_pb2_grpc.DecodeStub(self._workers.get(route.decode, "decode"))
            scope = cache_scope_fields(request.cache_scope)
            generate = duet_pb2.GenerateRequest(request_id=request.request_id, request_group=request.group,
                                                prompt_token_ids=request.prompt_token_ids, sampling=sampling,
                                                **scope)
            if not route.colocated:
                reply = await self._reserve_and_prefill(request, route, decode, sampling, metadata, state)
                answer = prefill_reply_from_proto(reply, request.request_id, want_logprobs)
                if any(out.finish_reason == "abort" for out in answer.firsts):
                    raise BackendUnavailable("the prefill worker aborted the request")
                # TTFT is prefill time: the first tokens go out before decode starts. When they
                # already end the request (EOS, stop token, max_tokens=1) decode never runs
                # and the `finally` below cancels the reservation.
                open_seqs = {out.index for out in answer.firsts if not out.finished}
                for out in answer.firsts:
                    yield token_event(out, request.prompt_token_ids, want_logprobs,
                                      cached_tokens=answer.cached_tokens, computed_tokens=answer.computed_tokens)
                if not open_seqs:
                    return
                generate.reservation.CopyFrom(state.reservation)  # relayed as decode sent it
                generate.prefill_worker_id = route.prefill.worker_id
                first_tokens_to_proto(generate, answer.firsts)
            else:
                open_seqs = set(range(request.sampling.n))
            # Split: prefill's cached count is the one that matters (decode computed no prompt).
            async for event in self._decode_stream(decode, generate, metadata, want_logprobs, state,
                                                   report_cached=route.colocated, open_seqs=open_seqs):
                yield event
        finally:
            # Runs on success, failure, early close (stop string) and cancellation (client left).
            if state.reservation is not None and not state.completed:
                self._cleanup(self._cancel_reservation(decode, state))  # idempotent on decode
            elif state.reserve_unanswered:
                self._cleanup(self._cancel_unanswered_reserve(decode, state))
            if state.stream is not None and not state.stream_done:
                state.stream.cancel()  # decode drops the request and frees its pages
            if state.routed:
                self._cleanup(self._release(request.request_id, duet_pb2.RELEASE_STAGE_DONE))

    async def _route(self, request: GenerationRequest, metadata) -> duet_pb2.RouteReply:
        from shared.registry.prefix_hashes import chained_page_hashes

        page_size = self._page_size()
        # seeded with the namespace: the workers publish their pages' hashes the same way
        hashes = (chained_page_hashes(request.prompt_token_ids, page_size, seed=request.cache_scope.namespace)
                  if page_size else [])
        try:
            return await self._router.Route(duet_pb2.RouteRequest(
                request_id=request.request_id, model=request.model, prompt_tokens=len(request.prompt_token_ids),
                max_tokens=request.sampling.max_tokens, page_hashes=hashes, n=request.sampling.n),
                metadata=metadata, timeout=self.config.route_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "router") from None

    async def _reserve_and_prefill(self, request, route, decode, sampling, metadata, state) -> duet_pb2.PrefillReply:
        state.reserve_unanswered = True  # until an answer: decode may have made one we never hear of
        scope = cache_scope_fields(request.cache_scope)
        try:
            state.reservation = await decode.Reserve(duet_pb2.ReserveRequest(
                request_id=request.request_id, prompt_tokens=len(request.prompt_token_ids),
                max_tokens=request.sampling.max_tokens, prefill_worker_id=route.prefill.worker_id,
                timeout_ms=self.config.reserve_timeout_ms, n=request.sampling.n, request_group=request.group,
                prompt_token_ids=request.prompt_token_ids,  # decode reuses what it holds of it
                **scope),
                metadata=metadata, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED_CODES:  # decode answered: it holds nothing for us
                state.reserve_unanswered = False
            raise rpc_error(exc, f"decode worker {route.decode.worker_id} (reserve)") from None
        state.reserve_unanswered = False
        prefill = duet_pb2_grpc.PrefillStub(self._workers.get(route.prefill, "prefill"))
        state.prefill_sent = True  # from here prefill may write: decode waits for its notice
        try:
            reply = await prefill.Prefill(duet_pb2.PrefillRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, sampling=sampling,
                reservation=state.reservation, request_group=request.group, **scope),
                metadata=metadata, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, f"prefill worker {route.prefill.worker_id}") from None
        self._cleanup(self._release(request.request_id, duet_pb2.RELEASE_STAGE_PREFILL_DONE))
        return reply

    async def _decode_stream(self, decode, generate, metadata, want_logprobs, state,
                             report_cached: bool, open_seqs: set[int]) -> AsyncIterator[TokenEvent]:
        state.stream = decode.Generate(generate, metadata=metadata)
        try:
            async for chunk in state.stream:
                out, usage = chunk_from_proto(chunk, generate.request_id, want_logprobs)
                if out.finish_reason == "abort":
                    state.stream_done = True
                    raise BackendUnavailable("the decode worker aborted the request")
                if out.finished:
                    open_seqs.discard(out.index)
                done = not open_seqs or out.request_finished  # usage comes with the last chunk
                if done:
                    state.stream_done = state.completed = True
                if out.token_ids or out.finished or out.prompt_logprobs is not None:
                    cached = usage.cached_tokens if report_cached and usage is not None else None
                    yield token_event(out, generate.prompt_token_ids, want_logprobs, cached_tokens=cached)
                if done:
                    return
        except grpc.aio.AioRpcError as exc:
            state.stream_done = True
            raise rpc_error(exc, "decode worker (generate)") from None
        state.stream_done = True
        raise BackendUnavailable("the decode stream ended without a finish reason")

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
class _RequestState:
    request_id: str
    routed: bool = False
    reservation: duet_pb2.Reservation | None = None
    reserve_unanswered: bool = False  # Reserve was sent and neither answered nor refused
    prefill_sent: bool = False    # the reservation went to a prefill worker (writes may land)
    stream: object | None = None  # the Decode.Generate call
    stream_done: bool = False     # the call ended (finish, error): nothing to cancel
    completed: bool = False       # decode finished the request: its reservation is used up
