"""The gateway's side of decode's reservation leases (docs/ARCHITECTURE.md, "The KV handoff"):
a reservation the gateway holds lives on its decode worker only while the gateway renews it, so
a gateway that dies, stops or loses the network strands no decode pages for long.

A request holds its reservation's lease from Reserve's answer until decode has its Generate
(the stream is its liveness from then on) or it cancels. One task renews every lease held,
batched: one RenewLease per decode worker instance every third of the shortest lease held
there, so the cost is one small unary call per decode worker and period, not one per request.
A reservation decode no longer holds (its lease lapsed: this gateway was too slow, or decode
was stopped) is dropped; the request learns it from its Generate (NOT_FOUND: a lost worker,
migration.py)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from protos import duet_pb2
from shared.wire.lease import ReservationKey, renew_reply_from_proto, renew_request_to_proto

log = logging.getLogger("duet.gateway.leases")

Instance = tuple[str, str]  # a decode worker's (registry id, instance nonce)


@dataclass
class _Held:
    """The leases held on one decode worker instance and the stub that renews them."""

    stub: object  # duet_pb2_grpc.DecodeStub
    ttl_s: dict[ReservationKey, float] = field(default_factory=dict)


class LeaseKeeper:
    def __init__(self, rpc_timeout_s: float = 5.0):
        self.rpc_timeout_s = rpc_timeout_s
        self._held: dict[Instance, _Held] = {}
        self._task: asyncio.Task | None = None

    def hold(self, stub, worker: duet_pb2.WorkerRef, reservation: duet_pb2.Reservation) -> None:
        """Renew reservation on worker (through stub) from now until drop()."""
        if reservation.lease_ttl_ms <= 0:
            return  # a decode worker without leases keeps it to its capability's lifetime
        held = self._held.setdefault((worker.worker_id, worker.instance_nonce), _Held(stub))
        held.ttl_s[(reservation.reservation_id, reservation.generation)] = reservation.lease_ttl_ms / 1000.0
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._renew_while_held())

    def drop(self, worker: duet_pb2.WorkerRef, reservation: duet_pb2.Reservation) -> None:
        """Stop renewing it (claimed by a Generate, cancelled, or given up). Idempotent."""
        instance = (worker.worker_id, worker.instance_nonce)
        held = self._held.get(instance)
        if held is not None:
            held.ttl_s.pop((reservation.reservation_id, reservation.generation), None)
            if not held.ttl_s:
                del self._held[instance]

    def held(self) -> int:
        return sum(len(h.ttl_s) for h in self._held.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._held.clear()

    async def _renew_while_held(self) -> None:
        while self._held:
            period = min(ttl for h in self._held.values() for ttl in h.ttl_s.values()) / 3
            await asyncio.sleep(period)
            # each call bounded by the period: a stopped decode worker delays no other one's round
            await asyncio.gather(*(self._renew(instance, held, min(self.rpc_timeout_s, period))
                                   for instance, held in list(self._held.items())))

    async def _renew(self, instance: Instance, held: _Held, timeout_s: float) -> None:
        keys = list(held.ttl_s)
        if not keys:
            return
        try:
            reply = await held.stub.RenewLease(renew_request_to_proto(keys), timeout=timeout_s)
        except Exception as exc:  # decode unreachable: its leases lapse there; the requests find out
            log.info("renewing %d reservation leases on decode worker %s failed: %s", len(keys), instance[0], exc)
            return
        for key in renew_reply_from_proto(reply):
            if held.ttl_s.pop(key, None) is not None:
                log.warning("decode worker %s no longer holds reservation %d/%d (its lease lapsed, or it was "
                            "claimed or freed)", instance[0], *key)
        if not held.ttl_s and self._held.get(instance) is held:
            del self._held[instance]
