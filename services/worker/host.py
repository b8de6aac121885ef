"""The worker process host: what every role runs in.

It owns the engine loop, the gRPC server with health, /metrics, the registry entry and its
heartbeat, signals and the drain. A role (services/worker/roles.py) installs itself into it:
its gRPC services, its engine-loop ticks, the services that run while serving, the in-flight
work a drain waits for, and what to close at the end.

SIGTERM drains: the worker leaves the registry first (no new work is routed to it), lets
in-flight requests finish within the grace period, then stops. The processes around it and
what each owns: docs/ARCHITECTURE.md, "Processes and what each owns"."""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import duet_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.kv_compat import compat_hash, model_kv_key
from services.worker.load_publisher import LoadPublisher, load_counters
from services.worker.role_switch import RoleSwitch, WorkerAdminService
from services.worker_runtime.adapters import AdaptersService, load_recorded_adapters
from services.worker_runtime.context import WorkerContext
from services.worker_runtime.engine_loop import EngineLoop
from services.worker_runtime.exit_watchdog import EXIT_AFTER_GRACE_S, ExitWatchdog
from services.worker_runtime.peer_memory_exit import ipc_domain
from services.worker_runtime.perf_tracker import PerfTracker, handoff_totals
from services.worker_runtime.step_watchdog import StepWatchdog
from shared.engine.grammar_guard import GrammarGuard
from shared.registry.kv_events import KvEventBuffer
from shared.registry.publisher import WorkerPublisher
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import RankKvPool, WorkerAdapters, WorkerInfo, WorkerLoad, default_worker_id
from shared.telemetry.metrics import DuetMetrics, start_metrics_server
from shared.telemetry.tracing import Tracing, setup_tracing
from shared.transport.keepalive import server_ping_policy

log = logging.getLogger("duet.worker")


@dataclass
class WorkerHost:
    config: WorkerConfig
    engine: object            # shared.engine.Engine
    ctx: WorkerContext        # what the role's gRPC services share (loop, metrics, agents, ...)
    server: grpc.aio.Server   # the role adds its servicers
    served_model: str
    kv_layout: str
    tracing: Tracing
    checkpoint: str = ""  # the weights' and tokenizer's fingerprint (checkpoint.py)
    kv_events: KvEventBuffer | None = None  # publish_kv_events(): the router sees this prefix cache
    services: list = field(default_factory=list)  # start() / async stop() while serving (peer warm-up)
    busy: list[Callable[[], bool]] = field(default_factory=list)  # in-flight work a drain waits for
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # after the engine loop stopped
    calibration: list = field(default_factory=list)  # timed start-up steps (perf_calibration.py)
    role_switch: RoleSwitch | None = None  # what it advertises; SetRole (role_switch.py), set by run()
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)  # SIGTERM, or request_drain()

    @classmethod
    def create(cls, config: WorkerConfig, engine, checkpoint: str,
               calibration: list | None = None) -> "WorkerHost":
        """checkpoint: the served weights' fingerprint (services/worker/checkpoint.py), computed once
        at start: the calibration file is keyed by it too."""
        served = config.served_model_name or engine.model_dir.name
        worker_id = config.worker_id or default_worker_id(config.role)
        kv_layout = model_kv_key(engine)
        # a switchable worker serves both services whatever it advertises: `both` (duet-worker)
        service = "both" if config.switchable else config.role
        tracing = setup_tracing(service)
        ctx = WorkerContext(config=config, engine=engine, loop=EngineLoop(engine), metrics=DuetMetrics(service),
                            worker_id=worker_id, instance_nonce=secrets.token_hex(8),
                            compat_hash=compat_hash(served, kv_layout, checkpoint), page_size=engine.layout.page_size,
                            tracer=tracing.tracer, watcher=WorkerWatcher(config.registry, model=served))
        ctx.grammar_guard = GrammarGuard.for_tokenizer_info(config.engine.grammar,
                                                            lambda: engine.grammars.info.serialize_json())
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), *server_ping_policy()],
                                 interceptors=config.tls.interceptors())  # mTLS: who may call what
        host = cls(config, engine, ctx, server, served, kv_layout, tracing, checkpoint,
                   calibration=list(calibration or []))
        duet_pb2_grpc.add_AdaptersServicer_to_server(AdaptersService(ctx), server)  # every role: LoRA at run time
        host.on_stop.append(ctx.grammar_guard.close)
        return host

    def publish_kv_events(self) -> None:
        """Publish this worker's prefix-cache changes with its heartbeat (the router's
        prefix-aware routing reads them)."""
        self.kv_events = KvEventBuffer()
        self.engine.kv.cache.events = self.kv_events

    def worker_info(self, address: str, metrics_address: str) -> WorkerInfo:
        ctx, capacity = self.ctx, self.engine.kv.capacity
        pools = [RankKvPool(rank=r, agent_name=a.name, **a.pool.as_dict()) for r, a in enumerate(ctx.rank_agents)]
        return WorkerInfo(worker_id=ctx.worker_id, role=self.config.role, address=address, model=self.served_model,
                          metrics_address=metrics_address, tp=self.config.engine.tp_size, page_size=ctx.page_size,
                          compat_hash=ctx.compat_hash, kv_layout=self.kv_layout, checkpoint=self.checkpoint,
                          instance_nonce=ctx.instance_nonce,
                          max_running_requests=self.config.engine.max_running_requests,
                          max_batched_tokens=self.engine.scheduler.max_batched_tokens, kv_pools=pools,
                          capability_key=ctx.issuer.public_key if ctx.issuer is not None else "",
                          load=WorkerLoad(total_pages=capacity, free_pages=capacity),
                          adapters=WorkerAdapters.of(self.engine.lora),
                          switchable=self.config.switchable, ipc_domain=ipc_domain())

    def request_drain(self, reason: str) -> None:
        """Drain and exit as on SIGTERM (the supervisor starts the worker again)."""
        log.warning("draining and exiting: %s", reason)
        self.stop_requested.set()

    async def run(self) -> int:
        """Serve until SIGINT/SIGTERM or the engine loop dies, then drain. The exit status."""
        config, ctx, loop = self.config, self.ctx, self.ctx.loop
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        port = config.tls.add_port(self.server, f"{config.host}:{config.port}")
        if port == 0:
            log.error("could not bind %s:%d", config.host, config.port)
            return 1
        metrics_server = start_metrics_server(ctx.metrics, config.metrics_port, config.host)
        info = self.worker_info(f"{config.dial_host}:{port}", f"{config.dial_host}:{metrics_server.port}")
        publisher = WorkerPublisher(info, config.registry,
                                    nixl_metadata={r: a.metadata for r, a in enumerate(ctx.rank_agents)} or None,
                                    load_fn=lambda: info.load, kv_events=self.kv_events)
        self.role_switch = RoleSwitch(info, config.switchable, ctx.metrics.registry, publisher)
        duet_pb2_grpc.add_WorkerAdminServicer_to_server(WorkerAdminService(self.role_switch, ctx), self.server)
        loop.after_iteration.append(LoadPublisher(ctx, info, *load_counters(ctx.metrics)))
        # the step-time model: refitted from every step, published with the load, drives the
        # prefill budget beside decode rows
        writes = config.role == "prefill" or config.switchable  # it hands KV over: fit its handoff tail
        tracker = PerfTracker(self.engine, info.perf, config.perf, ctx.metrics.registry, calibration=self.calibration,
                              handoffs=handoff_totals(ctx.metrics.registry) if writes else None)
        loop.step_timers.append(tracker.on_step)
        loop.after_iteration.append(tracker)
        if info.perf.step is not None:
            log.info("step-time model: %s; inter-token target %.0f ms", info.perf.step.to_dict(),
                     info.perf.itl_target_s * 1000)
        if self.engine.spec is not None:  # duet_spec_* counters
            from shared.telemetry.spec_metrics import SpecMetrics
            loop.after_iteration.append(SpecMetrics(self.engine.spec.stats, ctx.metrics.registry))
        loop.start()
        with self.engine.startup.phase("registration"):
            await self.server.start()
            await ctx.watcher.start()
            await load_recorded_adapters(ctx, ctx.watcher.keys, self.served_model)  # loaded at run time before we came
            for service in self.services:
                service.start()
            await publisher.start()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("start-up by phase: %s", self.engine.startup.render())
        kind = f"switchable worker (now {info.role})" if config.switchable else f"{config.role} worker"
        print(f"duet {kind} {ctx.worker_id} ready: grpc {info.address} ({config.tls.describe('server')}) "
              f"metrics {info.metrics_address} model {self.served_model}", file=sys.stderr, flush=True)

        stop = self.stop_requested
        aloop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.add_signal_handler(sig, stop.set)

        async def watch_engine():  # a dead engine thread stops the worker
            while loop.fatal is None:
                await asyncio.sleep(0.25)
            log.error("engine loop died: %s", loop.fatal)
            stop.set()

        watcher_task = asyncio.create_task(watch_engine())
        step_watchdog = StepWatchdog(loop, config.step_timeout_s)  # a step that never returns ends the process
        step_watchdog.start()
        watchdog = ExitWatchdog(config.drain_grace_s + EXIT_AFTER_GRACE_S)
        try:
            await stop.wait()
        finally:
            watchdog.start("leaving the registry")
            await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await publisher.stop(deregister=True)
            for service in self.services:
                watchdog.enter(f"stopping {type(service).__name__}")
                await service.stop()
            watchdog.enter("finishing in-flight work")
            await self._finish_in_flight(config.drain_grace_s)
            watchdog.enter("stopping the gRPC server")
            await self.server.stop(1.0)
            watcher_task.cancel()
            watchdog.enter("stopping the registry watcher")
            await ctx.watcher.stop()
            watchdog.enter("stopping the engine thread")
            step_watchdog.stop()  # the exit watchdog bounds the rest
            loop.stop()
            metrics_server.stop()
            for hook in self.on_stop:
                watchdog.enter(f"closing ({getattr(hook, '__qualname__', hook)})")
                hook()
            watchdog.enter("flushing traces")
            self.tracing.shutdown()
            watchdog.enter("exiting (interpreter teardown)")
        return 1 if loop.fatal is not None else 0

    async def _finish_in_flight(self, grace_s: float) -> None:
        loop, engine = self.ctx.loop, self.engine
        aloop = asyncio.get_running_loop()
        deadline = aloop.time() + grace_s
        while aloop.time() < deadline and loop.fatal is None:
            try:  # an engine thread stuck in a step must not hold the drain past its grace
                busy = await asyncio.wait_for(loop.acall(lambda: engine.has_work or bool(engine.requests)
                                                         or any(check() for check in self.busy)),
                                              max(deadline - aloop.time(), 0.05))
            except asyncio.TimeoutError:
                log.warning("the engine thread did not answer within the drain grace")
                break
            if not busy:
                break
            await asyncio.sleep(0.05)
