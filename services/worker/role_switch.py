"""The role a worker advertises, and the SetRole RPC that changes it at run time.

A switchable worker (`--switchable`, roles.py: install_switchable) holds every role's parts, so
a switch is only what it advertises: its registry entry's `role`, which is what the router
places on. SetRole rewrites the entry at once and publishes a `role` event (watchers read it at
once, not at their next scan; shared/registry/publisher.py: announce_role), so the router sends
no new work of the old role from its next Route on. Work already under way (a prefill, a
reservation, a decoding stream) finishes here, and work of the old role that a router placed
before it saw the change is still served: nothing is refused for a role, so no request fails
across a switch. The planner may also ask a worker to hand some of its decoding streams over
(`hand_over`: the busier worker after a switch, or one turned prefill, so the running batch
spreads over the new split): those end with finish reason "moved" and their gateways continue
them on another worker from the tokens sent, as failover does (services/gateway/backends/
migration.py), token for token. The engine and its KV cache stay, so a decode worker turned
`both` keeps the conversations it holds (SGLang's runtime prefill<->decode switch rebuilds its
role structures instead; here they are all built at start). Only the planner may call SetRole
(shared/security/caller_guard.py); a worker started with a fixed role refuses it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Gauge

from protos import duet_pb2, duet_pb2_grpc
from shared.registry.worker_info import ROLES

log = logging.getLogger("duet.worker.role")


@dataclass
class RoleSwitch:
    """What the worker advertises and how to change it. `info` is the WorkerInfo the publisher
    sends; `publisher` is set once the host serves (before that a switch only sets the field)."""

    info: object             # WorkerInfo
    switchable: bool
    registry: object         # the metrics' CollectorRegistry
    publisher: object | None = None   # WorkerPublisher
    since: float = field(default_factory=time.monotonic)
    switches: int = 0

    def __post_init__(self) -> None:
        self.role_gauge = Gauge("duet_worker_role", "1 for the role this worker advertises now, 0 for the others",
                                ["role"], registry=self.registry)
        self.switch_counter = Counter("duet_worker_role_switches", "Role switches of this worker (SetRole)",
                                      ["from_role", "to_role"], registry=self.registry)
        self.handed_over = Counter("duet_worker_streams_handed_over",
                                   "Decoding streams this worker ended as moved for their gateways to continue "
                                   "elsewhere (SetRole hand_over)", registry=self.registry)
        self._show()

    @property
    def role(self) -> str:
        return self.info.role

    def _show(self) -> None:
        for role in ROLES:
            self.role_gauge.labels(role=role).set(1 if role == self.info.role else 0)

    async def switch(self, role: str, reason: str, inflight: int) -> str:
        """Advertise `role` now; the role advertised before."""
        before = self.info.role
        if self.publisher is not None:
            await self.publisher.announce_role(role)
        else:
            self.info.role = role
        self.switches += 1
        self.since = time.monotonic()
        self.switch_counter.labels(from_role=before, to_role=role).inc()
        self._show()
        log.info("role switch: %s -> %s (%s); %d request(s) under way finish here",
                 before, role, reason or "no reason given", inflight)
        return before


class WorkerAdminService(duet_pb2_grpc.WorkerAdminServicer):
    def __init__(self, switch: RoleSwitch, ctx):
        self.switch = switch
        self.ctx = ctx  # WorkerContext: the engine loop, book, outgoing

    async def SetRole(self, request: duet_pb2.SetRoleRequest, context: grpc.aio.ServicerContext):
        switch = self.switch
        if not switch.switchable:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.ctx.worker_id} was started with the fixed role {switch.role} "
                                f"(start it with --switchable to change roles at run time)")
        if request.role not in ROLES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"role must be one of {', '.join(ROLES)}, got {request.role!r}")
        if request.hand_over < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hand_over must be >= 0, got {request.hand_over}")
        inflight = await self.ctx.loop.acall(self._inflight)
        before, changed = switch.role, request.role != switch.role
        if changed:
            before = await switch.switch(request.role, request.reason, inflight)
        handed = await self._hand_over(request.hand_over) if request.hand_over else 0
        return duet_pb2.SetRoleReply(role=request.role, previous_role=before, changed=changed,
                                     inflight_requests=inflight, handed_over=handed)

    async def _hand_over(self, count: int) -> int:
        """End up to `count` decoding streams as "moved", after the new role is announced (the
        router already places on the new split when their gateways route the continuations);
        they continue elsewhere on failover's path, never decoding here again."""
        loop = self.ctx.loop
        handed = await loop.acall(lambda: loop.hand_over(count))
        self.switch.handed_over.inc(handed)
        log.info("handed over %d of the %d decoding stream(s) asked for: their gateways continue them on "
                 "other workers", handed, count)
        return handed

    def _inflight(self) -> int:
        """On the engine loop: requests in the engine (prefills writing out among them) plus
        reservations waiting for their KV."""
        ctx = self.ctx
        return len(ctx.engine.requests) + (len(ctx.book.open) if ctx.book is not None else 0)
