"""The fixed-set actuator: a worker's SetRole RPC (services/worker/role_switch.py), over mutual
TLS as the planner (the only role a worker lets call it: shared/security/caller_guard.py). A
channel per worker instance; the name checked in the worker's certificate is the one the router
proves it by (shared/registry/entry_trust.py)."""
from __future__ import annotations

import grpc

from protos import duet_pb2, duet_pb2_grpc
from shared.registry.entry_trust import probe_name
from shared.registry.worker_info import WorkerInfo
from shared.security.grpc_tls import GrpcTlsConfig

TIMEOUT_S = 10.0


class RoleSwitcher:
    def __init__(self, tls: GrpcTlsConfig):
        self.tls = tls
        self._channels: dict[tuple[str, str, str], grpc.aio.Channel] = {}

    def _stub(self, worker: WorkerInfo) -> duet_pb2_grpc.WorkerAdminStub:
        key = (worker.worker_id, worker.address, worker.instance_nonce)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = self.tls.aio_channel(worker.address, probe_name(worker))
        return duet_pb2_grpc.WorkerAdminStub(channel)

    async def set_role(self, worker: WorkerInfo, role: str, reason: str, hand_over: int = 0) -> duet_pb2.SetRoleReply:
        return await self._stub(worker).SetRole(duet_pb2.SetRoleRequest(role=role, reason=reason, hand_over=hand_over),
                                                timeout=TIMEOUT_S)

    async def forget(self, live: set[tuple[str, str, str]]) -> None:
        """Close the channels of worker instances no longer live."""
        for key in [k for k in self._channels if k not in live]:
            await self._channels.pop(key).close()

    async def close(self) -> None:
        await self.forget(set())
