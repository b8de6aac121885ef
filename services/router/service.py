"""The Router gRPC service: live workers from the registry watcher + own in-flight counts."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import defaultdict

import grpc
from opentelemetry import trace

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.inflight import InflightTracker, RoutedRequest
from shared.registry.pairing import pair_problem
from services.router.policy import choose_colocated, choose_decode, choose_prefill, local_prefill_reason
from shared.registry.keys import RegistryKeys
from shared.registry.kv_events import cached_prefix_pages
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import WorkerInfo
from shared.telemetry.metrics import DuetMetrics
from shared.telemetry.propagation import extract_grpc_context

log = logging.getLogger(__name__)


def worker_ref(info: WorkerInfo) -> duet_pb2.WorkerRef:
    return duet_pb2.WorkerRef(worker_id=info.worker_id, address=info.address, instance_nonce=info.instance_nonce)


class RouterService(duet_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, watcher: WorkerWatcher, metrics: DuetMetrics,
                 tracer: trace.Tracer | None = None):
        self.config = config
        self.watcher = watcher
        self.metrics = metrics
        self.tracer = tracer or trace.get_tracer("duet.router")
        self.keys = RegistryKeys(config.registry.prefix)
        self.inflight = InflightTracker(config.inflight_ttl_s)
        self._rotation = itertools.count()

    async def Route(self, request: duet_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> duet_pb2.RouteReply:
        parent = extract_grpc_context(context.invocation_metadata())
        with self.tracer.start_as_current_span("route", context=parent) as span:
            request_id = request.request_id or uuid.uuid4().hex
            model = request.model or self.config.model
            span.set_attribute("duet.request_id", request_id)
            if request.prompt_tokens <= 0:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens must be positive")
            reply = await self._route(request, request_id, model)
            trust = self.watcher.trust
            if (reply is None or isinstance(reply, str)) and trust is not None and trust.pending:
                # workers that just joined are being asked who they are: wait for that, not 503
                await trust.settle(trust.probe_timeout_s)
                reply = await self._route(request, request_id, model)
            if isinstance(reply, str):
                self.metrics.route_decisions.labels(kind="unavailable").inc()
                span.set_attribute("duet.route", "unpaired")
                log.warning("route %s: %s", request_id, reply)
                await context.abort(grpc.StatusCode.UNAVAILABLE, reply)
            if reply is None:
                self.metrics.route_decisions.labels(kind="unavailable").inc()
                span.set_attribute("duet.route", "unavailable")
                detail = (f"no live worker can serve model {model!r}" if model else "no live worker")
                if not self.watcher.redis_ok:
                    detail += " (registry unreachable; using the last known worker set)"
                await self._refuse(context, grpc.StatusCode.UNAVAILABLE, detail)
            kind = "local_prefill" if reply.local_prefill else "colocated" if reply.colocated else "split"
            self.metrics.route_decisions.labels(kind=kind).inc()
            span.set_attribute("duet.route", kind)
            span.set_attribute("duet.route_reason", reply.reason)
            span.set_attribute("duet.decode_worker", reply.decode.worker_id)
            if not reply.colocated:
                span.set_attribute("duet.prefill_worker", reply.prefill.worker_id)
            span.set_attribute("duet.cached_tokens", reply.cached_tokens)
            span.set_attribute("duet.decode_cached_tokens", reply.decode_cached_tokens)
            self.metrics.request_finished("Route", grpc.StatusCode.OK)
            return reply

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str) -> None:
        self.metrics.request_finished("Route", code)
        await context.abort(code, detail)

    async def Release(self, request: duet_pb2.ReleaseRequest, context) -> duet_pb2.ReleaseReply:
        prefill_only = request.stage == duet_pb2.RELEASE_STAGE_PREFILL_DONE
        return duet_pb2.ReleaseReply(found=self.inflight.release(request.request_id, prefill_only))

    # --- the decision ---------------------------------------------------------

    async def _route(self, request: duet_pb2.RouteRequest, request_id: str,
                     model: str) -> duet_pb2.RouteReply | str | None:
        """The decision; a string says why live workers could not be paired, None: none live."""
        live = [w for w in self.watcher.workers() if not model or w.model == model]
        self.inflight.expire({w.worker_id for w in self.watcher.workers()})
        by_role: dict[str, list[WorkerInfo]] = defaultdict(list)
        for worker in live:
            by_role[worker.role].append(worker)
        pairable = {d.worker_id: [p for p in by_role["prefill"] if not pair_problem(p, d)]
                    for d in by_role["decode"]}
        decodes = [d for d in by_role["decode"] if pairable[d.worker_id]]
        rotation = next(self._rotation)
        loads = self.inflight.per_worker()
        prompt_tokens, max_tokens, n = request.prompt_tokens, max(0, request.max_tokens), max(1, request.n)
        weights = self.config.weights

        if decodes:
            candidates = {w.worker_id: w for d in decodes for w in [d, *pairable[d.worker_id]]}
            cached = await self._cached_pages(list(candidates.values()), list(request.page_hashes))
            decode = choose_decode(decodes, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                   inflight=loads, weights=weights, rotation=rotation, cached_pages=cached, n=n)
            reason = local_prefill_reason(decode, prompt_tokens, weights)
            if reason:  # it holds most of the prompt: no prefill worker, no transfer
                self.inflight.add(RoutedRequest(request_id, decode.worker.worker_id,
                                                prompt_tokens - decode.cached_tokens, decode.worker.worker_id,
                                                decode.pages, time.monotonic()))
                return duet_pb2.RouteReply(request_id=request_id, decode=worker_ref(decode.worker), colocated=True,
                                           local_prefill=True, cached_tokens=decode.cached_tokens,
                                           decode_cached_tokens=decode.cached_tokens, reason=reason)
            prefill = choose_prefill(pairable[decode.worker.worker_id], prompt_tokens=prompt_tokens,
                                     cached_pages=cached, inflight=loads, weights=weights, rotation=rotation)
            self.inflight.add(RoutedRequest(request_id, prefill.worker.worker_id, prefill.uncached_tokens,
                                            decode.worker.worker_id, decode.pages, time.monotonic()))
            reason = (f"split: decode {decode.worker.worker_id} holds {decode.cached_tokens} of {prompt_tokens} "
                      f"prompt tokens, prefill {prefill.worker.worker_id} {prefill.cached_tokens}")
            return duet_pb2.RouteReply(request_id=request_id, prefill=worker_ref(prefill.worker),
                                       decode=worker_ref(decode.worker), colocated=False,
                                       cached_tokens=prefill.cached_tokens, decode_cached_tokens=decode.cached_tokens,
                                       reason=reason)

        boths = by_role["both"]
        if not boths:
            if by_role["prefill"] and by_role["decode"]:  # workers there, but none can pair: say why
                p, d = by_role["prefill"][0], by_role["decode"][0]
                return (f"no prefill worker can hand its KV to a decode worker; e.g. {p.worker_id} -> "
                        f"{d.worker_id}: {pair_problem(p, d)}")
            return None
        cached = await self._cached_pages(boths, list(request.page_hashes))
        prefill, decode = choose_colocated(boths, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                           cached_pages=cached, inflight=loads, weights=weights,
                                           rotation=rotation, n=n)
        worker = prefill.worker
        self.inflight.add(RoutedRequest(request_id, worker.worker_id, prefill.uncached_tokens,
                                        worker.worker_id, decode.pages, time.monotonic()))
        return duet_pb2.RouteReply(request_id=request_id, decode=worker_ref(worker), colocated=True,
                                   cached_tokens=prefill.cached_tokens, decode_cached_tokens=prefill.cached_tokens,
                                   reason=f"colocated: {worker.worker_id} holds {prefill.cached_tokens} of "
                                          f"{prompt_tokens} prompt tokens")

    async def _cached_pages(self, workers: list[WorkerInfo], page_hashes: list[int]) -> dict[str, int]:
        """Leading prompt pages each worker holds; {} when unknown (no hashes, Redis slow or down)."""
        if not page_hashes or not self.watcher.redis_ok:
            return {}
        keys = {w.worker_id: self.keys.pages(w.worker_id) for w in workers}
        try:
            return await asyncio.wait_for(cached_prefix_pages(self.watcher.client, keys, page_hashes),
                                          timeout=self.config.prefix_lookup_timeout_s)
        except Exception as exc:  # routing without prefix information beats not routing
            log.warning("prefix lookup failed, routing on load only: %s", exc)
            return {}

