"""`duet prefill|decode|worker`: a worker process around the engine.

Wiring: engine (+ its loop thread) -> NIXL agent over the KV pool -> gRPC services for the
role -> registry entry with heartbeat -> /metrics. SIGTERM drains: the worker leaves the
registry first (no new work is routed to it), lets in-flight requests finish within the
grace period, then stops."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Sequence

import grpc

log = logging.getLogger("duet.worker")


def compat_hash(served_model: str, kv_key: str) -> str:
    """Model + KV layout of the whole model (not per rank): workers at any TP sizes whose
    hashes match can pair, the writer re-sharding heads on the way (kv_transfer/head_plan.py)."""
    return hashlib.sha256(f"{served_model}|{kv_key}".encode()).hexdigest()[:16]


def model_kv_key(engine) -> str:
    """L<layers>-H<kv heads>-P<page>-D<head dim>-<KV dtype>, and for an FP8 cache with scales
    other than 1.0 a digest of them (pages written with one scale read wrong with another)."""
    layout, mc = engine.layout, engine.model_config
    key = (f"L{layout.num_layers}-H{mc.num_kv_heads}-P{layout.page_size}-D{layout.head_dim}-"
           f"{str(layout.dtype).removeprefix('torch.')}")
    scales = engine.pool.scales
    if any(s != (1.0, 1.0) for s in scales):
        key += "-kvs" + hashlib.sha256(repr(scales).encode()).hexdigest()[:8]
    return key


async def serve(config) -> int:
    import torch
    from prometheus_client import Counter

    from protos import duet_pb2_grpc
    from services.worker.context import WorkerContext
    from services.worker.engine_loop import EngineLoop
    from services.worker.context import RankAgent
    from services.worker.load_publisher import LoadPublisher
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.registry.kv_events import KvEventBuffer
    from shared.registry.publisher import WorkerPublisher
    from shared.registry.watcher import WorkerWatcher
    from shared.registry.worker_info import RankKvPool, WorkerInfo, WorkerLoad, default_worker_id
    from shared.telemetry.metrics import DuetMetrics, start_metrics_server
    from shared.telemetry.tracing import setup_tracing

    if config.threads:
        torch.set_num_threads(config.threads)
    engine = Engine(EngineConfig(
        model_dir=config.model, dtype=config.dtype, device=config.device, page_size=config.page_size,
        kv_cache_memory=config.kv_cache_memory, mem_fraction=config.mem_fraction,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_running_requests=config.max_running_requests, max_model_len=config.max_model_len,
        enable_prefix_cache=config.enable_prefix_cache, attention_backend=config.attention_backend,
        cuda_graph=config.cuda_graph, tp_size=config.tp, ep_size=config.ep, load_format=config.load_format,
        overlap_schedule=config.overlap_schedule))
    if config.warmup:
        from shared.engine.warmup import warm_up
        warm_up(engine)  # before anything can route work here
    served = config.served_model_name or engine.model_dir.name
    role = config.role
    worker_id = config.worker_id or default_worker_id(role)
    nonce = secrets.token_hex(8)
    kv_layout = model_kv_key(engine)
    chash = compat_hash(served, kv_layout)
    tracing = setup_tracing(role)
    metrics = DuetMetrics(role)
    computed = Counter("duet_engine_tokens_computed", "Tokens whose KV this worker computed",
                       ["phase"], registry=metrics.registry)
    recomputed = Counter("duet_kv_recomputes", "Requests decode recomputed because their KV never arrived",
                         registry=metrics.registry)
    loop = EngineLoop(engine)
    ctx = WorkerContext(config=config, engine=engine, loop=loop, metrics=metrics, worker_id=worker_id,
                        instance_nonce=nonce, compat_hash=chash, page_size=engine.layout.page_size,
                        tracer=tracing.tracer)
    kv_events = KvEventBuffer() if role in ("prefill", "both") else None
    if kv_events is not None:
        engine.kv.cache.events = kv_events
    watcher = WorkerWatcher(config.registry, model=served)
    ctx.watcher = watcher
    if role in ("prefill", "decode"):
        from shared.kv_transfer.agent import KvTransferAgent
        from shared.registry.keys import RegistryKeys
        from shared.registry.publisher import connect_async
        from services.worker.peers import PeerResolver
        agent_name = f"{worker_id}-r{{rank}}-{nonce}"
        ctx.agent = KvTransferAgent(agent_name.format(rank=0), engine.pool.buffer,
                                    write_timeout_s=config.write_timeout_s,
                                    progress_thread=config.nixl_progress_thread, first_head=engine.kv_heads.first)
        # tensor parallel: every rank registers its own pool shard with its own agent
        ctx.rank_agents = [RankAgent(ctx.agent.name, ctx.agent.metadata(), ctx.agent.pool_info)] + [
            RankAgent(agent_name.format(rank=r), md, pool) for r, (md, pool) in enumerate(engine.call_followers(
                "shared.kv_transfer.rank_transfers:open_agent", agent_name, config.write_timeout_s), start=1)]
        ctx.peers = PeerResolver(ctx.agent, connect_async(config.registry), RegistryKeys(config.registry.prefix))
    if role == "prefill":
        from services.prefill.outgoing import OutgoingTransfers
        from shared.kv_transfer.tp_write_stream import FollowerStreams
        followers = FollowerStreams(engine, config.tp - 1) if config.tp > 1 else None
        ctx.outgoing = OutgoingTransfers(engine, metrics, followers=followers)
        loop.add_tick(ctx.outgoing.tick)
        loop.on_step.append(ctx.outgoing.on_step)
    if role == "decode":
        from services.decode.reservations import ReservationBook
        ctx.book = ReservationBook(engine, ctx.agent, ctx.is_live,
                                   quarantine_s=max(2 * config.write_timeout_s, config.notice_timeout_s),
                                   metrics=metrics, claim_timeout_s=config.notice_timeout_s,
                                   num_ranks=config.tp)
        loop.add_tick(ctx.book.tick)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    if role in ("prefill", "both"):
        from services.prefill.service import PrefillService
        duet_pb2_grpc.add_PrefillServicer_to_server(PrefillService(ctx), server)
    if role in ("decode", "both"):
        from services.decode.service import DecodeService
        duet_pb2_grpc.add_DecodeServicer_to_server(DecodeService(ctx), server)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = config.tls.add_port(server, f"{config.host}:{config.port}")
    if port == 0:
        log.error("could not bind %s:%d", config.host, config.port)
        return 1
    metrics_server = start_metrics_server(metrics, config.metrics_port, config.host)
    address = f"{config.dial_host}:{port}"

    load = WorkerLoad(total_pages=engine.kv.capacity, free_pages=engine.kv.capacity)

    pools = [RankKvPool(rank=r, agent_name=a.name, **a.pool.as_dict()) for r, a in enumerate(ctx.rank_agents)]
    info = WorkerInfo(worker_id=worker_id, role=role, address=address, model=served,
                      metrics_address=f"{config.dial_host}:{metrics_server.port}", tp=config.tp,
                      page_size=engine.layout.page_size, compat_hash=chash, kv_layout=kv_layout, instance_nonce=nonce,
                      max_running_requests=config.max_running_requests, kv_pools=pools, load=load)
    publisher = WorkerPublisher(info, config.registry,
                                nixl_metadata={r: a.metadata for r, a in enumerate(ctx.rank_agents)} or None,
                                load_fn=lambda: info.load, kv_events=kv_events)

    loop.after_iteration.append(LoadPublisher(ctx, info, computed, recomputed))
    loop.start()
    await server.start()
    await watcher.start()
    warmer = None
    if role == "prefill":  # connect to decode workers as they join, not on their first request
        from services.prefill.peer_warmup import PeerWarmup
        warmer = PeerWarmup(ctx)
        warmer.start()
    await publisher.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"duet {role} worker {worker_id} ready: grpc {address} ({config.tls.describe('server')}) "
          f"metrics {info.metrics_address} model {served}", file=sys.stderr, flush=True)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, stop.set)

    async def watch_engine():  # a dead engine thread stops the worker
        while loop.fatal is None:
            await asyncio.sleep(0.25)
        log.error("engine loop died: %s", loop.fatal)
        stop.set()

    refresher = asyncio.create_task(watch_engine())
    try:
        await stop.wait()
    finally:
        log.info("draining: leaving the registry, finishing in-flight work")
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await publisher.stop(deregister=True)
        if warmer is not None:
            await warmer.stop()
        grace = float(os.environ.get("DUET_DRAIN_GRACE", "10"))
        deadline = aloop.time() + grace
        while aloop.time() < deadline and loop.fatal is None:
            busy = await loop.acall(lambda: engine.has_work or bool(engine.requests)
                                    or bool(ctx.book and ctx.book.open) or bool(ctx.outgoing and ctx.outgoing.active))
            if not busy:
                break
            await asyncio.sleep(0.05)
        await server.stop(1.0)
        refresher.cancel()
        await watcher.stop()
        loop.stop()
        metrics_server.stop()
        if ctx.agent is not None:
            if config.tp > 1 and loop.fatal is None:
                try:  # the loop thread is gone: this thread may use the control pipe now
                    engine.call_followers("shared.kv_transfer.rank_transfers:close_agent")
                except Exception as exc:
                    log.warning("closing the other ranks' transfer agents: %s", exc)
            ctx.agent.close()
        tracing.shutdown()
    return 1 if loop.fatal is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    from services.worker.config import WorkerConfig
    config = WorkerConfig.from_argv(argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config.tls.check("server")  # a bad certificate path fails now, not after loading the model
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0
    except (ValueError, OSError, MemoryError) as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
