"""The KV transfer agents of a split worker (prefill, decode, or a switchable worker, which may be
either): one NIXL agent per TP rank over its shard of the KV pool, and the resolver of peers by
registry id. A colocated (`both`) worker transfers nothing and opens none."""
from __future__ import annotations

import logging

from services.worker_runtime.context import RankAgent
from services.worker_runtime.peers import PeerResolver
from shared.kv_transfer.agent import KvTransferAgent
from shared.kv_transfer.notice_inbox import NoticeInbox
from shared.registry.keys import RegistryKeys
from shared.registry.publisher import connect_async

log = logging.getLogger("duet.worker")


def open_agents(ctx, *, write_timeout_s: float, progress_thread: bool, registry) -> None:
    """Sets ctx.agent (rank 0's), ctx.rank_agents (every rank's, rank 0 first), ctx.inbox
    (rank 0's notices) and ctx.peers."""
    engine = ctx.engine
    agent_name = f"{ctx.worker_id}-r{{rank}}-{ctx.instance_nonce}"
    ctx.agent = KvTransferAgent(agent_name.format(rank=0), engine.pool.buffer, write_timeout_s=write_timeout_s,
                                progress_thread=progress_thread, first_head=engine.kv_heads.first)
    # tensor parallel: every rank registers its own pool shard with its own agent
    ctx.rank_agents = [RankAgent(ctx.agent.name, ctx.agent.metadata(), ctx.agent.pool_info)] + [
        RankAgent(agent_name.format(rank=r), md, pool) for r, (md, pool) in enumerate(engine.call_followers(
            "shared.kv_transfer.rank_transfers:open_agent", agent_name, write_timeout_s), start=1)]
    ctx.inbox = NoticeInbox(ctx.agent)
    ctx.peers = PeerResolver(ctx.agent, connect_async(registry), RegistryKeys(registry.prefix))


def open_host_agents(host) -> None:
    """Open the agents of a worker host (services/worker/host.py) and close them when it stops."""
    ctx, config = host.ctx, host.config
    open_agents(ctx, write_timeout_s=config.write_timeout_s, progress_thread=config.nixl_progress_thread,
                registry=config.registry)
    host.on_stop.append(lambda: close_agents(ctx, config.engine.tp_size))


def close_agents(ctx, tp: int) -> None:
    """After the engine loop stopped: the other ranks' agents, then rank 0's."""
    if ctx.agent is None:
        return
    if tp > 1 and ctx.loop.fatal is None:
        try:  # the loop thread is gone: this thread may use the control pipe now
            ctx.engine.call_followers("shared.kv_transfer.rank_transfers:close_agent")
        except Exception as exc:
            log.warning("closing the other ranks' transfer agents: %s", exc)
    ctx.agent.close()
