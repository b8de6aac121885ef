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
from services.router.gateway_backlogs import GatewayBacklogs
from services.router.inflight import InflightTracker, RoutedRequest
from services.router.placement import Placement, place
from services.router.placement_metrics import PlacementMetrics
from shared.registry.pairing import pair_problem
from services.router.policy import DecodeChoice, PrefillChoice, choose_colocated, choose_decode, choose_prefill
from shared.registry.keys import RegistryKeys
from shared.registry.kv_events import cached_prefix_pages
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import WorkerInfo
from shared.telemetry.metrics import DuetMetrics
from shared.telemetry.propagation import extract_grpc_context

log = logging.getLogger(__name__)

PROBE_S = 0.25  # while the registry is down, how often a route tries the prefix lookup anyway


def worker_ref(info: WorkerInfo) -> duet_pb2.WorkerRef:
    return duet_pb2.WorkerRef(worker_id=info.worker_id, address=info.address, instance_nonce=info.instance_nonce)


def eligible(info: WorkerInfo, model: str, request: duet_pb2.RouteRequest) -> bool:
    """Whether a live worker may serve this request: its model, the request's LoRA adapter
    (workers publish the adapters they serve), never an instance the request lost (a migrating
    stream), and, when the request names one, the checkpoint it began on. An instance the stream
    was handed over from (`exclude_decode_instances`) may serve it only as a prefill worker: it
    holds the stream's pages, which its prefill then moves to the new decode worker."""
    return ((not model or info.model == model) and info.instance_nonce not in request.exclude_instances
            and (info.role == "prefill" or info.instance_nonce not in request.exclude_decode_instances)
            and (not request.lora_adapter or request.lora_adapter in info.adapters.served)
            and (not request.checkpoint or info.checkpoint == request.checkpoint))


class RouterService(duet_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, watcher: WorkerWatcher, metrics: DuetMetrics,
                 tracer: trace.Tracer | None = None):
        self.config = config
        self.watcher = watcher
        self.metrics = metrics
        self.tracer = tracer or trace.get_tracer("duet.router")
        self.keys = RegistryKeys(config.registry.prefix)
        self.inflight = InflightTracker(config.inflight_ttl_s,
                                        config.registry.heartbeat_interval_s + config.registry.scan_interval_s)
        self._rotation = itertools.count()
        self.placement_metrics = PlacementMetrics(metrics.registry)
        self._lookup_probe_at = 0.0  # monotonic: while the registry is down, the next prefix lookup tried
        self.gateway_backlogs = GatewayBacklogs()  # what waits in every gateway's admission

    async def Route(self, request: duet_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> duet_pb2.RouteReply:
        parent = extract_grpc_context(context.invocation_metadata())
        with self.tracer.start_as_current_span("route", context=parent) as span:
            request_id = request.request_id or uuid.uuid4().hex
            model = request.model or self.config.model
            span.set_attribute("duet.request_id", request_id)
            span.set_attribute("duet.model", model)
            if request.exclude_instances or request.exclude_decode_instances or request.checkpoint:  # a moving stream
                span.set_attribute("duet.excluded_instances", len(request.exclude_instances))
                span.set_attribute("duet.excluded_decode_instances", len(request.exclude_decode_instances))
                span.set_attribute("duet.checkpoint", request.checkpoint)
            if request.prompt_tokens <= 0:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens must be positive")
            reply, placement = await self._route(request, request_id, model)
            if reply is None and request.lora_adapter:
                # an adapter loaded at run time: the gateway saw the workers' entries say so,
                # our periodic scan may not have yet
                await self.watcher.refresh()
                reply, placement = await self._route(request, request_id, model)
            trust = self.watcher.trust
            if (reply is None or isinstance(reply, str)) and trust is not None and trust.pending:
                # workers that just joined are being asked who they are: wait for that, not 503
                await trust.settle(trust.probe_timeout_s)
                reply, placement = await self._route(request, request_id, model)
            if isinstance(reply, str):
                self.metrics.route_decisions.labels(kind="unavailable", reason="unpaired", model=model).inc()
                span.set_attribute("duet.route", "unpaired")
                log.warning("route %s: %s", request_id, reply)
                await context.abort(grpc.StatusCode.UNAVAILABLE, reply)
            if reply is None:
                self.metrics.route_decisions.labels(kind="unavailable", reason="no_worker", model=model).inc()
                span.set_attribute("duet.route", "unavailable")
                detail = (f"no live worker can serve model {model!r}" if model else "no live worker")
                if request.lora_adapter:
                    detail += f" with LoRA adapter {request.lora_adapter!r}"
                if not self.watcher.redis_ok:
                    detail += " (registry unreachable; using the last known worker set)"
                await self._refuse(context, grpc.StatusCode.UNAVAILABLE, detail)
            kind = "local_prefill" if reply.local_prefill else "colocated" if reply.colocated else "split"
            code = placement.code if placement is not None else "only_colocated"
            self.metrics.route_decisions.labels(kind=kind, reason=code, model=model).inc()
            log.debug("route %s: %s (%s)", request_id, reply.reason, code)
            span.set_attribute("duet.route", kind)
            span.set_attribute("duet.route_reason", reply.reason)
            span.set_attribute("duet.placement_reason", code)
            if placement is not None:
                self._record_placement(span, placement)
            span.set_attribute("duet.decode_worker", reply.decode.worker_id)
            if not reply.colocated:
                span.set_attribute("duet.prefill_worker", reply.prefill.worker_id)
            span.set_attribute("duet.cached_tokens", reply.cached_tokens)
            span.set_attribute("duet.decode_cached_tokens", reply.decode_cached_tokens)
            self.metrics.request_finished("Route", grpc.StatusCode.OK)
            return reply

    def _record_placement(self, span, placement: Placement) -> None:
        """The predicted figures of every option weighed, on the span and in metrics."""
        self.placement_metrics.observe(placement)
        if placement.target_s:
            span.set_attribute("duet.itl_target_ms", placement.target_s * 1000)
        for option in placement.options:
            span.set_attribute(f"duet.predicted_ttft_{option.kind}_ms", option.ttft_s * 1000)
        if placement.chosen is not None:
            span.set_attribute("duet.predicted_ttft_ms", placement.chosen.ttft_s * 1000)
            span.set_attribute("duet.predicted_step_ms", placement.chosen.step_s * 1000)
            span.set_attribute("duet.predicted_itl_impact_ms", placement.chosen.itl_impact_s * 1000)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str) -> None:
        self.metrics.request_finished("Route", code)
        await context.abort(code, detail)

    async def Release(self, request: duet_pb2.ReleaseRequest, context) -> duet_pb2.ReleaseReply:
        prefill_only = request.stage == duet_pb2.RELEASE_STAGE_PREFILL_DONE
        return duet_pb2.ReleaseReply(found=self.inflight.release(request.request_id, prefill_only))

    # --- the decision ---------------------------------------------------------

    async def _route(self, request: duet_pb2.RouteRequest, request_id: str, model: str,
                     settled: bool = False) -> tuple[duet_pb2.RouteReply | str | None, Placement | None]:
        """The decision and how it was placed; a string says why live workers could not be
        paired, None: none live. settled: the trust probes under way were waited for already."""
        adapter = request.lora_adapter
        live = [w for w in self.watcher.workers() if eligible(w, model, request)]
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
        boths = by_role["both"]
        now = time.monotonic()

        if decodes:
            # `both` workers are a third option beside split and local prefill (predicted placement only)
            extra = boths if weights.placement == "predicted" else []
            candidates = {w.worker_id: w for d in decodes for w in [d, *pairable[d.worker_id]]}
            candidates.update((w.worker_id, w) for w in extra)
            cached = await self._cached_pages(list(candidates.values()), list(request.page_hashes))
            decode = choose_decode(decodes, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                   inflight=loads, weights=weights, rotation=rotation, cached_pages=cached, n=n,
                                   adapter=adapter)
            prefill = choose_prefill(pairable[decode.worker.worker_id], prompt_tokens=prompt_tokens,
                                     cached_pages=cached, inflight=loads, weights=weights, rotation=rotation,
                                     adapter=adapter)
            both = choose_colocated(extra, prompt_tokens=prompt_tokens, max_tokens=max_tokens, cached_pages=cached,
                                    inflight=loads, weights=weights, rotation=rotation, n=n,
                                    adapter=adapter) if extra else None
            placement = place(decode, prefill, prompt_tokens, inflight=loads, weights=weights,
                              target_s=self.config.slo.itl_ms / 1000, colocated=both[0] if both else None,
                              backlog_tokens=self.gateway_backlogs.total(request.gateway_id,
                                                                         request.admission_waiting_tokens,
                                                                         model))
            if placement.kind == "local_prefill":  # it holds most of the prompt: no prefill worker, no transfer
                return self._local_prefill_reply(request_id, decode, prompt_tokens, placement.detail, now), placement
            if placement.kind == "colocated":
                return self._colocated_reply(request_id, *both, placement.detail), placement
            self.inflight.add(RoutedRequest(request_id, prefill.worker.worker_id, prefill.uncached_tokens,
                                            decode.worker.worker_id, decode.pages, now))
            return duet_pb2.RouteReply(request_id=request_id, prefill=worker_ref(prefill.worker),
                                       decode=worker_ref(decode.worker), colocated=False,
                                       cached_tokens=prefill.cached_tokens, decode_cached_tokens=decode.cached_tokens,
                                       reason=placement.detail, checkpoint=decode.worker.checkpoint), placement

        if not boths:
            if by_role["decode"] and not by_role["prefill"]:
                trust = self.watcher.trust
                if not settled and trust is not None and trust.pending:
                    # a worker that just joined (a stack's prefill worker coming up) is being asked
                    # who it is: wait for that rather than have the decode worker prefill alone
                    await trust.settle(trust.probe_timeout_s)
                    return await self._route(request, request_id, model, settled=True)
                return await self._decode_alone(request, request_id, by_role["decode"], loads, rotation), None
            if by_role["prefill"] and by_role["decode"]:  # workers there, but none can pair: say why
                p, d = by_role["prefill"][0], by_role["decode"][0]
                return (f"no prefill worker can hand its KV to a decode worker; e.g. {p.worker_id} -> "
                        f"{d.worker_id}: {pair_problem(p, d)}"), None
            return None, None
        cached = await self._cached_pages(boths, list(request.page_hashes))
        prefill, decode = choose_colocated(boths, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                           cached_pages=cached, inflight=loads, weights=weights,
                                           rotation=rotation, n=n, adapter=adapter)
        reason = f"colocated: {prefill.worker.worker_id} holds {prefill.cached_tokens} of {prompt_tokens} prompt tokens"
        return self._colocated_reply(request_id, prefill, decode, reason), None

    async def _decode_alone(self, request, request_id: str, decodes: list[WorkerInfo], loads,
                            rotation: int) -> duet_pb2.RouteReply | None:
        """No prefill worker is live (all restarting, as after a same-host decode worker died:
        services/worker_runtime/peer_memory_exit.py; or scaled to zero): a decode worker
        prefills the whole prompt itself, as it does the rest of a cached one, rather than the
        request failing."""
        prompt_tokens = request.prompt_tokens
        cached = await self._cached_pages(decodes, list(request.page_hashes))
        decode = choose_decode(decodes, prompt_tokens=prompt_tokens, max_tokens=max(0, request.max_tokens),
                               inflight=loads, weights=self.config.weights, rotation=rotation, cached_pages=cached,
                               n=max(1, request.n), adapter=request.lora_adapter)
        if decode is None:
            return None
        return self._local_prefill_reply(
            request_id, decode, prompt_tokens, f"no prefill worker live: {decode.worker.worker_id} prefills all "
            f"{prompt_tokens - decode.cached_tokens} uncached prompt tokens itself", time.monotonic())

    def _local_prefill_reply(self, request_id: str, decode: DecodeChoice, prompt_tokens: int, reason: str,
                             now: float) -> duet_pb2.RouteReply:
        """The decode worker prefills what it does not hold itself: no prefill worker, no transfer."""
        self.inflight.add(RoutedRequest(request_id, decode.worker.worker_id, prompt_tokens - decode.cached_tokens,
                                        decode.worker.worker_id, decode.pages, now))
        return duet_pb2.RouteReply(request_id=request_id, decode=worker_ref(decode.worker), colocated=True,
                                   local_prefill=True, cached_tokens=decode.cached_tokens,
                                   decode_cached_tokens=decode.cached_tokens, reason=reason,
                                   checkpoint=decode.worker.checkpoint)

    def _colocated_reply(self, request_id: str, prefill: PrefillChoice, decode: DecodeChoice,
                         reason: str) -> duet_pb2.RouteReply:
        worker = prefill.worker
        self.inflight.add(RoutedRequest(request_id, worker.worker_id, prefill.uncached_tokens,
                                        worker.worker_id, decode.pages, time.monotonic()))
        return duet_pb2.RouteReply(request_id=request_id, decode=worker_ref(worker), colocated=True,
                                   cached_tokens=prefill.cached_tokens, decode_cached_tokens=prefill.cached_tokens,
                                   reason=reason, checkpoint=worker.checkpoint)

    async def _cached_pages(self, workers: list[WorkerInfo], page_hashes: list[int]) -> dict[str, int]:
        """Leading prompt pages each worker holds; {} when unknown (no hashes, Redis slow or down).

        While the watcher says Redis is down, a lookup is still tried every PROBE_S: a Redis
        restarted (empty) answers, and holds the page sets the workers published again, up to a
        scan interval before the watcher's next scan says so; routing on load alone meanwhile
        would scatter conversations."""
        if not page_hashes:
            return {}
        now = time.monotonic()
        if not self.watcher.redis_ok and now < self._lookup_probe_at:
            return {}
        keys = {w.worker_id: self.keys.pages(w.worker_id) for w in workers}
        try:
            found = await asyncio.wait_for(cached_prefix_pages(self.watcher.client, keys, page_hashes),
                                           timeout=self.config.prefix_lookup_timeout_s)
        except Exception as exc:  # routing without prefix information beats not routing
            if self.watcher.redis_ok:
                log.warning("prefix lookup failed, routing on load only: %s", exc)
            self._lookup_probe_at = now + PROBE_S
            return {}
        if not self.watcher.redis_ok:
            self.watcher.rescan_soon()  # it answers again: the live set too
        return found
