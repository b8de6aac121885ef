"""A decode worker, as it installs itself into the worker host (services/worker/host.py): KV
events (it keeps what it decoded, and the router pairs a conversation's later turns with the
worker that holds them), the transfer agents prefill writes into, the reservation book on the
engine loop, and the Decode gRPC service."""
from __future__ import annotations

from protos import duet_pb2_grpc
from services.decode.reservations import ReservationBook
from services.decode.service import DecodeService
from services.worker_runtime.transfer import open_host_agents


def install(host) -> None:
    host.publish_kv_events()
    open_host_agents(host)
    add_book(host)
    add_service(host)


def add_book(host) -> None:
    """The reservations prefill workers write into, settled on the engine loop (needs the agents)."""
    ctx, config = host.ctx, host.config
    ctx.book = ReservationBook(host.engine, ctx.agent, ctx.is_live,
                               quarantine_s=max(2 * config.write_timeout_s, config.notice_timeout_s),
                               metrics=ctx.metrics, claim_timeout_s=config.notice_timeout_s,
                               num_ranks=config.engine.tp_size)
    ctx.loop.add_tick(ctx.book.tick)
    host.busy.append(lambda: bool(ctx.book.open))


def add_service(host) -> None:
    duet_pb2_grpc.add_DecodeServicer_to_server(DecodeService(host.ctx), host.server)
