"""`duet prefill|decode|worker`: a worker process around the engine.

Wiring: engine (+ its loop thread) -> the role's parts (NIXL agents over the KV pool, gRPC
services; services/worker/roles.py) installed into the host -> registry entry with heartbeat
-> /metrics (services/worker/host.py). SIGTERM drains: the worker leaves the registry first
(no new work is routed to it), lets in-flight requests finish within the grace period, then
stops."""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from services.worker.config import WorkerConfig
from shared.telemetry.logs import setup_logging

log = logging.getLogger("duet.worker")


async def serve(config: WorkerConfig) -> int:
    """Build the engine, install the role into the host, serve until SIGTERM; the exit status."""
    # torch, NIXL, gRPC and the role services load here, once the flags parsed: `duet worker
    # --help` and a bad flag answer at once
    from services.worker.host import WorkerHost
    from services.worker.checkpoint import checkpoint_fingerprint
    from services.worker.perf_calibration import calibrate_once
    from services.worker.roles import install_role
    from services.worker_runtime.gil_switch import apply_switch_interval
    from shared.engine.engine import Engine
    from shared.engine.startup_phases import process_age_s
    from shared.engine.warmup import warm_up

    if config.role == "prefill" and not config.switchable:  # it stops every request after its first token
        config.engine.runs_decode = False  # no decode graphs, no decode warm-up
        if config.engine.speculative_method:  # speculation lives on the decode pool
            log.info("prefill worker: speculative decoding settings ignored")
            config.engine.speculative_method = None
    before_engine = process_age_s()  # the interpreter, imports, flags
    engine = Engine(config.engine)
    apply_switch_interval(config.gil_switch_interval_ms, engine.device.type)
    phases = engine.startup  # logged phase by phase once registered (WorkerHost.run)
    if before_engine is not None:
        phases.phases.insert(0, ("process", before_engine))
    if config.warmup:
        with phases.phase("warm-up"):
            warm_up(engine)  # before anything can route work here
    checkpoint = checkpoint_fingerprint(engine.model_dir, config.engine.quantization)
    with phases.phase("calibration"):
        calibration = calibrate_once(engine, config.perf, checkpoint) if config.perf.calibrate else []
    with phases.phase("role"):  # gRPC services, NIXL agents over the KV pool
        host = WorkerHost.create(config, engine, checkpoint, calibration)
        install_role(host)
    return await host.run()


def main(argv: Sequence[str] | None = None) -> int:
    config = WorkerConfig.from_argv(argv)
    setup_logging(config.log_level)
    try:
        config.tls.check("server")  # a bad certificate path fails now, not after loading the model
        # a switchable worker's certificate names the role `worker`: it may advertise any
        config.tls.check_identity("worker" if config.switchable else config.role, config.worker_id or "")
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0
    except (ValueError, OSError, MemoryError) as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
