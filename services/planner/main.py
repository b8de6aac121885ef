"""`duet planner`: sets the prefill/decode split of the workers from what they and the gateways
measure, against the TTFT and ITL targets.

Every `--planner-interval` it reads the registry (the live workers: roles, load, step-time
models), each worker's /metrics (addresses from the registry) and the gateways' /metrics
(scrape.py), folds them into the window's load (load_window.py), predicts every split of the
workers by their models (predict.py) and decides (decide.py); a decision to switch goes to the
workers that must change role as SetRole calls (assign.py, role_switcher.py). With `--k8s-scale`
it also sizes the prefill and decode pools, one pod at a time (kube_scale.py). Each decision is
a log line, a metric and a span event (report.py). The workers, router and gateways run the same
without it: it only moves roles and replicas."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence

import grpc

from services.planner.assign import assign, fixed_split, hand_overs
from services.planner.config import PlannerConfig
from services.planner.decide import RESTARTS_WINDOW, Decider, Decision, pool_step
from services.planner.kube_scale import KubeApi, KubeError, namespace_of
from services.planner.load_window import LoadWindow, Reading
from services.planner.predict import Fleet, Split
from services.planner.report import PlannerMetrics, report, report_pool
from services.planner.role_switcher import RoleSwitcher
from services.planner.scrape import read_gateways, read_workers
from shared.registry.entry_trust import EntryTrust
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import WorkerInfo
from shared.telemetry.logs import setup_logging
from shared.telemetry.metrics import start_metrics_server
from shared.telemetry.tracing import setup_tracing

log = logging.getLogger("duet.planner")
ROLES_SEEN_S = 3.0  # how long the hand-overs wait for the registry to show the new roles


class Planner:
    def __init__(self, config: PlannerConfig, tracer, metrics: PlannerMetrics, kube: KubeApi | None = None):
        self.config = config
        self.tracer = tracer
        self.metrics = metrics
        self.kube = kube
        self.namespace = namespace_of(config.k8s.namespace) if kube is not None else ""
        timing = config.timing
        # under mutual TLS, as the router: only entries whose worker proved who it is (their
        # metrics are read, their roles switched)
        self.trust = EntryTrust(config.tls) if config.tls.mutual else None
        self.watcher = WorkerWatcher(config.registry, model=config.model or None, trust=self.trust)
        self.window = LoadWindow(timing.window_s)
        self.decider = Decider(timing.hysteresis, timing.dwell_s, timing.min_requests, time.monotonic(),
                               headroom_above=timing.headroom_above)
        self.switcher = RoleSwitcher(config.tls)

    def fleet(self, workers: list[WorkerInfo]) -> Fleet | None:
        on_gpu = any(p.mem_type == "VRAM" for w in workers for p in w.kv_pools)
        return Fleet.of(workers, self.config.ttft.target_s(on_gpu), self.config.slo.itl_ms / 1000)

    async def read(self, workers: list[WorkerInfo]) -> Reading:
        gateways, figures = await asyncio.gather(
            read_gateways(self.config.gateway_metrics, self.config.model),
            read_workers({f"{w.worker_id}/{w.instance_nonce}": w.metrics_address for w in workers
                          if w.metrics_address}))
        return Reading(time.monotonic(), gateways, figures, tuple(workers))

    async def step(self) -> Decision:
        """One reading and decision (and the switches or the pool step it calls for)."""
        workers = self.watcher.workers()
        self.window.add(await self.read(workers))
        now = time.monotonic()
        fleet = self.fleet(workers)
        current = Split.of(w.role for w in workers)
        with self.tracer.start_as_current_span("planner.decide") as span:
            decision = self.decider.decide(now, current, fixed_split(workers), self.window.load(), fleet)
            report(decision, fleet, self.metrics, span)
            if decision.action == "switch":
                await self.switch(workers, decision)
            elif decision.reason in RESTARTS_WINDOW:
                self.window.reset()
            elif self.kube is not None and fleet is not None and self.decider.dwelt(now):
                await self.scale(workers, decision, fleet, span)
        await self.switcher.forget({(w.worker_id, w.address, w.instance_nonce) for w in workers})
        return decision

    async def switch(self, workers: list[WorkerInfo], decision: Decision) -> None:
        """Every worker to its new role, then the hand-overs (assign.hand_overs): a stream handed
        over is routed on the new split, so it must be in place first, as the router sees it."""
        why = f"planner: {decision.current} -> {decision.target} ({decision.reason})"
        moves = assign(workers, decision.target)
        switched = []
        for worker, role in moves:
            try:
                reply = await self.switcher.set_role(worker, role, why)
            except grpc.aio.AioRpcError as exc:
                self.metrics.decisions.labels(action="switch", reason="failed").inc()
                log.error("planner: %s refused the switch to %s: %s", worker.worker_id, role,
                          exc.details() or exc.code().name)
                continue
            switched.append((worker, role))
            log.info("planner: %s %s -> %s (%d request(s) under way)", worker.worker_id, reply.previous_role,
                     reply.role, reply.inflight_requests)
        handing = hand_overs(workers, switched, self.config.timing.hand_over_min) if len(switched) == len(moves) else {}
        if handing:
            await self._roles_seen(switched)
        for worker, role in switched:
            if worker.worker_id not in handing:
                continue
            try:
                reply = await self.switcher.set_role(worker, role, why, handing[worker.worker_id])
            except grpc.aio.AioRpcError as exc:
                log.error("planner: %s refused the hand-over: %s", worker.worker_id, exc.details() or exc.code().name)
                continue
            log.info("planner: %s handed %d of %d decoding stream(s) over to the new split", worker.worker_id,
                     reply.handed_over, handing[worker.worker_id])
        self.decider.changed(time.monotonic())
        self.window.reset()

    async def _roles_seen(self, switched: list[tuple[WorkerInfo, str]]) -> None:
        """Until the registry (as the router's watcher reads it too: the role events) shows every
        switched worker in its new role, at most ROLES_SEEN_S."""
        want = {w.worker_id: role for w, role in switched}
        deadline = time.monotonic() + ROLES_SEEN_S
        while time.monotonic() < deadline:
            seen = {w.worker_id: w.role for w in self.watcher.workers()}
            if all(seen.get(worker_id, role) == role for worker_id, role in want.items()):
                return
            await asyncio.sleep(0.05)

    async def scale(self, workers: list[WorkerInfo], decision: Decision, fleet: Fleet, span) -> None:
        """One pod more or fewer in a pool, once the pools hold what they were last set to."""
        k8s = self.config.k8s
        pools = {"prefill": (k8s.prefill_deployment, k8s.prefill_min, k8s.prefill_max),
                 "decode": (k8s.decode_deployment, k8s.decode_min, k8s.decode_max)}
        try:
            replicas = {pool: await self.kube.replicas(self.namespace, name) for pool, (name, _, _) in pools.items()}
        except KubeError as exc:
            log.warning("planner: reading the pools: %s", exc)
            return
        live = {pool: sum(w.worker_id.startswith(name + "-") for w in workers) for pool, (name, _, _) in pools.items()}
        if live != replicas:  # pods starting or leaving: judge once they are there
            return
        step = pool_step(decision.current.workers, decision.load, fleet, decision.corrections,
                         self.config.timing.hysteresis,
                         {pool: (replicas[pool], lo, hi) for pool, (_, lo, hi) in pools.items()}, decision.by_way)
        if step is None or decision.load.requests < self.config.timing.min_requests:
            return
        name = pools[step.pool][0]
        target = replicas[step.pool] + step.delta
        try:
            await self.kube.set_replicas(self.namespace, name, target)
        except KubeError as exc:
            log.error("planner: scaling %s to %d: %s", name, target, exc)
            return
        report_pool(step, step.pool, target, self.metrics, span)
        self.decider.changed(time.monotonic())
        self.window.reset()


async def serve(config: PlannerConfig) -> None:
    from prometheus_client import CollectorRegistry

    tracing = setup_tracing("planner")
    registry = CollectorRegistry()
    metrics_server = start_metrics_server(registry, config.metrics_port, config.host)
    kube = KubeApi.in_cluster() if config.k8s.enabled else None
    planner = Planner(config, tracing.tracer, PlannerMetrics(registry), kube)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await planner.watcher.start()
    print(f"duet planner ready: metrics {config.host}:{metrics_server.port}; every {config.timing.interval_s:g}s, "
          f"gateways {', '.join(config.gateway_metrics) or 'none'}"
          + (f", scaling {planner.namespace}/{config.k8s.prefill_deployment},{config.k8s.decode_deployment}"
             if kube else ""), file=sys.stderr, flush=True)
    try:
        while not stop.is_set():
            try:
                await planner.step()
            except Exception:  # a failed reading or decision: log it, try again next interval
                log.exception("planner step failed")
            try:
                await asyncio.wait_for(stop.wait(), config.timing.interval_s)
            except asyncio.TimeoutError:
                pass
    finally:
        await planner.switcher.close()
        await planner.watcher.stop()
        if planner.trust is not None:
            await planner.trust.close()
        metrics_server.stop()
        tracing.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = PlannerConfig.from_argv(argv)
        config.tls.check("client")
        config.tls.check_identity("planner")
    except ValueError as exc:
        print(f"duet planner: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except (KubeError, OSError) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
