"""Everything a worker's gRPC services share, passed explicitly."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from shared.telemetry.propagation import extract_grpc_context


@dataclass(frozen=True)
class RankAgent:
    """One tensor-parallel rank's NIXL agent, as the registry entry publishes it."""

    name: str
    metadata: bytes
    pool: object  # shared.kv_transfer.pool_info.PoolInfo


@dataclass
class WorkerContext:
    config: object  # WorkerConfig
    engine: object  # shared.engine.Engine
    loop: object  # EngineLoop
    metrics: object  # DuetMetrics
    worker_id: str
    instance_nonce: str
    compat_hash: str
    page_size: int
    tracer: object
    agent: object | None = None  # KvTransferAgent (prefill/decode roles), rank 0's
    rank_agents: list["RankAgent"] = field(default_factory=list)  # one per TP rank, rank 0 first
    peers: object | None = None  # PeerResolver
    inbox: object | None = None  # NoticeInbox: rank 0's agent's notices, sorted by their reader
    outgoing: object | None = None  # OutgoingTransfers (prefill)
    book: object | None = None  # ReservationBook (decode)
    reserve_queue: object | None = None  # ReserveQueue: Reserve calls waiting for room (decode)
    issuer: object | None = None  # CapabilityIssuer: signs each reservation's write capability (decode)
    watcher: object | None = None  # WorkerWatcher
    grammar_guard: object | None = None  # GrammarGuard: checks a grammar within the limits before compiling it
    recomputes: int = 0

    def is_live(self, worker_id: str, instance_nonce: str | None = None) -> bool:
        """Whether a peer (this instance of it, if given) is in the last known registry set (a
        Redis outage keeps it)."""
        return True if self.watcher is None else self.watcher.is_live(worker_id, instance_nonce)

    @contextmanager
    def span(self, name: str, grpc_context, **attrs):
        """A span under the caller's (from grpc_context's metadata), or with grpc_context None
        under the current span (a phase inside the request's span)."""
        parent = extract_grpc_context(grpc_context.invocation_metadata()) if grpc_context else None
        with self.tracer.start_as_current_span(name, context=parent) as span:
            span.set_attribute("duet.worker_id", self.worker_id)
            for k, v in attrs.items():
                span.set_attribute(f"duet.{k}", v)
            yield span
