"""Trusting a registry entry only once its worker proved it is that worker.

Anyone who can write to Redis can add an entry naming any id and any address. Under mutual
TLS, the router (which hands workers' addresses to the gateway) dials each entry it reads and
asks for its health check with the name the worker's certificate must carry
(shared/security/identity.py: <id>.<service>.duet.internal): the handshake fails unless the
server at that address holds a certificate from the stack's CA naming that worker (or, with a
role-wide certificate, that role). Until its probe succeeds an entry is not served to callers
of `admits`; an entry whose probe failed is probed again with backoff (a worker that was
not yet listening), and a changed address or instance nonce is a new entry.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.registry.worker_info import WorkerInfo
from shared.security.grpc_tls import GrpcTlsConfig
from shared.security.identity import server_name

log = logging.getLogger(__name__)

# a call the server answered, whatever it said, came over a handshake that checked the name
_UNREACHED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def probe_name(info: WorkerInfo) -> str:
    """The name the worker's certificate must carry: the service its role serves (a `both`
    worker is asked as a decode worker, as the gateway dials it)."""
    return server_name("prefill" if info.role == "prefill" else "decode", info.worker_id)


def entry_key(info: WorkerInfo) -> tuple[str, str, str, str]:
    """What was proven: a role switch between decode and `both` asks the same name and needs
    no new probe; one to or from prefill does (a worker's certificate may serve one of them)."""
    return info.worker_id, probe_name(info), info.address, info.instance_nonce


@dataclass
class _Failed:
    retry_at: float
    backoff_s: float


@dataclass
class EntryTrust:
    tls: GrpcTlsConfig
    probe_timeout_s: float = 3.0
    first_retry_s: float = 0.5
    max_retry_s: float = 30.0
    _trusted: set = field(default_factory=set)
    _failed: dict = field(default_factory=dict)
    _probing: dict = field(default_factory=dict)  # key -> asyncio.Task

    def admits(self, info: WorkerInfo) -> bool:
        return entry_key(info) in self._trusted

    @property
    def pending(self) -> bool:
        return bool(self._probing)

    def sync(self, entries: list[WorkerInfo]) -> None:
        """The entries the registry holds now: probe the new ones (and failed ones whose retry
        is due), forget the ones gone."""
        now = time.monotonic()
        live = {entry_key(i): i for i in entries}
        self._trusted &= live.keys()
        self._failed = {k: v for k, v in self._failed.items() if k in live}
        for key, info in live.items():
            if key in self._trusted or key in self._probing:
                continue
            failed = self._failed.get(key)
            if failed is not None and now < failed.retry_at:
                continue
            self._probing[key] = asyncio.create_task(self._probe(key, info), name=f"trust-{info.worker_id}")

    async def settle(self, timeout_s: float) -> None:
        """Wait (up to timeout_s) for the probes under way."""
        tasks = list(self._probing.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        for task in self._probing.values():
            task.cancel()
        if self._probing:
            await asyncio.wait(list(self._probing.values()), timeout=self.probe_timeout_s)
        self._probing.clear()

    async def _probe(self, key, info: WorkerInfo) -> None:
        try:
            proven, detail = await self._ask(info)
        finally:
            self._probing.pop(key, None)
        if proven:
            self._trusted.add(key)
            self._failed.pop(key, None)
            return
        failed = self._failed.get(key)
        backoff = min(self.max_retry_s, failed.backoff_s * 2) if failed else self.first_retry_s
        if failed is None:
            log.warning("registry entry %s (%s at %s) not trusted: %s", info.worker_id, info.role, info.address, detail)
        self._failed[key] = _Failed(time.monotonic() + backoff, backoff)

    async def _ask(self, info: WorkerInfo) -> tuple[bool, str]:
        # a subchannel of its own: a connection another channel opened proves nothing here
        channel = self.tls.aio_channel(info.address, probe_name(info), [("grpc.use_local_subchannel_pool", 1)])
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=self.probe_timeout_s)
            return True, ""
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _UNREACHED:
                return False, exc.details() or exc.code().name
            return True, ""
        finally:
            await channel.close()
