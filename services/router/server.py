"""Router process wiring: watcher + gRPC server + /metrics, started and stopped together."""
from __future__ import annotations

import logging

import grpc
from prometheus_client import Gauge

from protos import duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.registry.entry_trust import EntryTrust
from shared.registry.watcher import WorkerWatcher
from shared.security.secret_files import redact_url
from shared.telemetry.metrics import DuetMetrics, MetricsServer, start_metrics_server
from shared.telemetry.tracing import Tracing

log = logging.getLogger(__name__)


class RouterServer:
    """`await start()` returns once the first registry scan is done and the port is bound."""

    def __init__(self, config: RouterConfig, *, tracing: Tracing | None = None, metrics: DuetMetrics | None = None):
        self.config = config
        self.metrics = metrics or DuetMetrics("router")
        # mutual TLS: route only to entries whose worker proved its identity (entry_trust.py)
        self.trust = EntryTrust(config.tls) if config.tls.mutual else None
        # every model's workers: each Route names its model (service.eligible filters by it), so
        # one router serves several models' pools; --model is only the default for one naming none
        self.watcher = WorkerWatcher(config.registry, trust=self.trust)
        self.service = RouterService(config, self.watcher, self.metrics,
                                     tracer=tracing.tracer if tracing is not None else None)
        self._grpc: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self.port = 0
        # Requests routed and not yet released: back to 0 when the load ends (abort storms).
        Gauge("duet_router_inflight_requests", "Requests routed and not yet released",
              registry=self.metrics.registry).set_function(lambda: len(self.service.inflight))

    @property
    def metrics_port(self) -> int:
        return self._metrics_server.port if self._metrics_server else 0

    async def start(self) -> int:
        await self.watcher.start()
        if self.trust is not None:  # the workers already registered are asked who they are first
            await self.trust.settle(self.trust.probe_timeout_s)
        if not self.watcher.redis_ok:
            log.warning("registry %s not reachable yet; routing starts when it is",
                        redact_url(self.config.registry.redis_url))
        if self.config.metrics_port:  # bound before gRPC serves: a taken port fails before anything runs
            try:
                self._metrics_server = start_metrics_server(self.metrics, self.config.metrics_port, self.config.host)
            except OSError as exc:
                raise OSError(f"could not bind the router's metrics to {self.config.host}:{self.config.metrics_port}: "
                              f"{exc.strerror or exc}") from exc
        self._grpc = grpc.aio.server(interceptors=self.config.tls.interceptors())
        duet_pb2_grpc.add_RouterServicer_to_server(self.service, self._grpc)
        self.port = self.config.tls.add_port(self._grpc, f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind the router to {self.config.host}:{self.config.port}")
        await self._grpc.start()
        log.info("router listening on %s:%d (%s; metrics %s), %d workers known",
                 self.config.host, self.port, self.config.tls.describe("server"), self.metrics_port or "off",
                 len(self.watcher.workers()))
        return self.port

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(self.config.grace_s)
            self._grpc = None
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        await self.watcher.stop()
        if self.trust is not None:
            await self.trust.close()
