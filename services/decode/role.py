"""A decode worker, as it installs itself into the worker host (services/worker/host.py): KV
events (it keeps what it decoded, and the router pairs a conversation's later turns with the
worker that holds them), the transfer agents prefill writes into, the reservation book and the
queue of Reserve calls on the engine loop, the key that signs each reservation's write
capability, and the Decode gRPC service."""
from __future__ import annotations

from protos import duet_pb2_grpc
from services.decode.reserve_queue import ReserveQueue
from services.decode.reservations import ReservationBook
from services.decode.revoker import Revoker
from services.decode.service import DecodeService
from services.worker_runtime.transfer import open_host_agents
from shared.kv_transfer.capability import CapabilityIssuer
from shared.kv_transfer.notice import COMPLETIONS


def install(host) -> None:
    host.publish_kv_events()
    open_host_agents(host)
    add_book(host)
    add_service(host)


def add_book(host) -> None:
    """The reservations prefill workers write into, settled on the engine loop (needs the agents)."""
    ctx, config = host.ctx, host.config
    revoker = Revoker(ctx)  # tells a lapsed reservation's writer to stop
    host.services.append(revoker)
    ctx.book = ReservationBook(host.engine, ctx.inbox.view(COMPLETIONS), ctx.is_live,
                               quarantine_s=max(2 * config.write_timeout_s, config.notice_timeout_s),
                               metrics=ctx.metrics, claim_timeout_s=config.notice_timeout_s,
                               num_ranks=config.engine.tp_size, ttl_s=config.reservation_ttl_s,
                               lease_s=config.lease_ttl_s, revoke=revoker)
    ctx.issuer = CapabilityIssuer()  # this instance's key: its public half goes into the registry entry
    ctx.reserve_queue = ReserveQueue(ctx.book, config.engine.max_running_requests, config.reserve_aging_s)
    ctx.loop.add_tick(ctx.book.tick)
    ctx.loop.add_tick(ctx.reserve_queue.tick)  # after the book's: what it just freed is granted at once
    host.busy.append(lambda: bool(ctx.book.open))


def add_service(host) -> None:
    duet_pb2_grpc.add_DecodeServicer_to_server(DecodeService(host.ctx), host.server)
