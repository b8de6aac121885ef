"""Connect to each decode worker as it joins, before a request needs it.

The first KV write to a new peer pays for connection setup inside the transport (UCX
endpoints; with cuda_ipc, mapping the peer's pool): on 2 x H200 the first split request
after start took 1.3-1.5 s to its first token against ~0.3 s for the next. So a prefill
worker writes one page to every compatible decode worker it sees in the registry: its
padding page (page 0, which never holds KV on either side; kv_pool.py) into the peer's, as
the head plan for the pair says (whole page or this rank's head slices). The write is a
probe: no notice, not counted as KV sent. A peer that restarts (new nonce) is warmed again.

With prefill TP > 1 every rank probes the decode ranks it writes to; rank 0 waits for its
own probes, the other ranks' complete in their idle ticks (rank_transfers.probe)."""
from __future__ import annotations

import asyncio
import logging
import time

from shared.kv_transfer.agent import DONE, TransferError
from shared.kv_transfer.head_plan import PairingError, plan_head_copies
from shared.registry.peers import PeerNotFound

log = logging.getLogger("duet.prefill.peer_warmup")

PADDING_PAGE = 0


class PeerWarmup:
    def __init__(self, ctx, interval_s: float = 1.0, timeout_s: float = 30.0):
        self.ctx = ctx
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.warmed: dict[str, str] = {}  # decode worker id -> instance nonce connected to
        self.seconds: dict[str, float] = {}  # decode worker id -> how long its probe took
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self.warm_new_peers()
            except Exception:  # noqa: BLE001 - a probe is an optimisation: log and go on
                log.exception("decode peer warm-up failed")
            await asyncio.sleep(self.interval_s)

    async def warm_new_peers(self) -> int:
        """Probe every compatible decode worker not yet connected to; returns how many."""
        ctx = self.ctx
        done = 0
        for w in ctx.watcher.workers("decode"):
            if self.warmed.get(w.worker_id) == w.instance_nonce or w.compat_hash != ctx.compat_hash:
                continue
            if w.worker_id == ctx.worker_id:  # a switchable worker advertising decode: never its own peer
                continue
            outcome = "refused"
            try:
                ok, self.seconds[w.worker_id] = await self._probe(w)
                outcome = "ok" if ok else "failed"
            except (PeerNotFound, PairingError, TransferError) as exc:
                log.warning("decode worker %s not warmed: %s", w.worker_id, exc)
            if ctx.metrics is not None:
                ctx.metrics.kv_peer_connect_seconds.labels(outcome=outcome).observe(
                    self.seconds.get(w.worker_id, 0.0))
            self.warmed[w.worker_id] = w.instance_nonce  # warmed or refused: not retried per tick
            done += 1
        return done

    async def _probe(self, w) -> tuple[bool, float]:
        ctx = self.ctx
        t0 = time.monotonic()
        peer = await ctx.peers.get(w.worker_id, w.instance_nonce, ctx.compat_hash)
        specs = ctx.peers.rank_specs(peer, w.tp)
        plan = plan_head_copies([a.pool for a in ctx.rank_agents], [s.pool for s in specs])
        handles = [ctx.agent.write_pages(ctx.peers.add(specs[c.dst_rank]), [PADDING_PAGE], [PADDING_PAGE],
                                         heads=None if c.whole_page else c, probe=True)
                   for c in plan if c.src_rank == 0]
        followers_ok = True
        if ctx.config.engine.tp_size > 1:  # the other ranks post theirs on the engine loop (the control pipe's thread)
            posted = await ctx.loop.acall(lambda: ctx.engine.call_followers(
                "shared.kv_transfer.rank_transfers:probe_peers", specs, plan))
            want = [sum(1 for c in plan if c.src_rank == r) for r in range(1, ctx.config.engine.tp_size)]
            followers_ok = list(posted) == want
        states = await asyncio.gather(*(asyncio.to_thread(ctx.agent.wait, h, self.timeout_s) for h in handles))
        seconds = time.monotonic() - t0
        ok = followers_ok and all(s == DONE for s in states)
        if not ok:
            log.warning("probe write to decode worker %s did not complete: %s", w.worker_id, states)
        else:
            log.info("connected to decode worker %s (%d rank(s)) in %.3fs", w.worker_id, len(handles), seconds)
        return ok, seconds
