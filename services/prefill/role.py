"""A prefill worker, as it installs itself into the worker host (services/worker/host.py):
KV events for prefix-aware routing, the transfer agents, the outgoing KV writes on the engine
loop, the Prefill gRPC service, and the warm-up of decode peers as they join."""
from __future__ import annotations

from protos import duet_pb2_grpc
from services.prefill.outgoing import OutgoingTransfers
from services.prefill.peer_warmup import PeerWarmup
from services.prefill.service import PrefillService
from services.worker_runtime.peer_memory_exit import PeerMemoryExit, ipc_domain
from services.worker_runtime.transfer import open_host_agents
from shared.kv_transfer.notice import REVOCATIONS
from shared.kv_transfer.tp_write_stream import FollowerStreams


def install(host) -> None:
    host.publish_kv_events()
    open_host_agents(host)
    add_outgoing(host)
    add_service(host)


def add_outgoing(host) -> None:
    """The KV writes into decode reservations, on the engine loop (needs the agents), and the
    warm-up of decode peers as they join."""
    ctx, engine, tp = host.ctx, host.engine, host.config.engine.tp_size
    ctx.outgoing = OutgoingTransfers(engine, ctx.metrics, followers=FollowerStreams(engine, tp - 1) if tp > 1 else None,
                                     is_live=ctx.is_live, lease_s=host.config.lease_ttl_s,
                                     revocations=ctx.inbox.view(REVOCATIONS), agent=ctx.agent)
    ctx.loop.add_tick(ctx.outgoing.tick)
    ctx.loop.on_step.append(ctx.outgoing.on_step)
    host.busy.append(lambda: bool(ctx.outgoing.active))
    host.services.append(PeerWarmup(ctx))  # connect to decode workers as they join, not on their first request
    host.services.append(PeerMemoryExit(  # a same-host GPU peer written into holds its memory until we exit
        written=ctx.agent.written_peers, workers=ctx.watcher.workers, drain=host.request_drain,
        mode=host.config.exit_for_peer_memory, mine=ipc_domain(), mine_on_gpu=ctx.agent.pool_info.mem_type == "VRAM",
        me=ctx.worker_id))


def add_service(host) -> None:
    duet_pb2_grpc.add_PrefillServicer_to_server(PrefillService(host.ctx), host.server)
