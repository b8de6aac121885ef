"""ProbeContext: what a probe function gets (the server, sizes, watches), built once per suite."""
from __future__ import annotations

import asyncio
import uuid
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
    # put into templates and schemas, so that a second run against the same server is not
    # answered by the caches the first one filled (compiled templates, compiled grammars)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def model(self) -> str:
        return self.server.model
