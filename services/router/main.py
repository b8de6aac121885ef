"""`duet router`: the Router gRPC service (off the data path)."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from services.router.config import RouterConfig
from services.router.server import RouterServer
from shared.telemetry.logs import setup_logging
from shared.telemetry.tracing import setup_tracing


async def serve(config: RouterConfig) -> None:
    tracing = setup_tracing("router")
    server = RouterServer(config, tracing=tracing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        # inside the try: a start that fails half way (a port taken) stops what it started, so
        # the process exits and its supervisor sees it; left running, the gRPC server's tasks
        # kept asyncio.run from finishing and the router hung, serving nothing
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
        tracing.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = RouterConfig.from_argv(argv)
        config.tls.check("server")
        config.tls.check_identity("router")
    except ValueError as exc:
        print(f"duet router: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except (RuntimeError, OSError) as exc:  # OSError: a port taken
        logging.getLogger("duet.router").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
