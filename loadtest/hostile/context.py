"""ProbeContext: what a probe function gets (the server, sizes, watches), built once per suite."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loadtest.hostile.client import Server
from loadtest.hostile.config import ProbeSizes
from loadtest.hostile.kv_metrics import KvWatch
from loadtest.hostile.monitors import GatewayProcess


@dataclass
class ProbeContext:
    server: Server
    sizes: ProbeSizes = field(default_factory=ProbeSizes)
    gateway: GatewayProcess | None = None
    kv: KvWatch | None = None
    # set by the RSS watch past the cap; probes that escalate stop there (the runner also
    # cancels the probe)
    abort: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def model(self) -> str:
        return self.server.model
