"""Decode's side of a lapsed lease or a cancel: tell the reservation's writer to stop.

A reservation whose holder stopped renewing it, or which its holder cancelled after sending it
to prefill, is quarantined while a write may land (reservations.py); its writer may not know
(the gateway that stopped renewing may be stopped itself, its Prefill call still live, or it
never sent one; a Prefill call cancelled before its handler ran leaves the writer nothing to
answer). So decode sends the writer a
`revoke` notice over NIXL (shared/kv_transfer/notice.py), MACed with the capability's secret
and carrying a token: a writer that is writing cancels the transfer and sends its abort notice
once its writes in flight settled; one that holds none refuses the capability from now on and
answers at once with an abort echoing the token. Either abort frees the pages; without one
the quarantine runs to its end. Called on the engine-loop thread; the writer's NIXL metadata,
when this agent does not hold it yet, is read from the registry on the asyncio loop."""
from __future__ import annotations

import asyncio
import logging

from shared.kv_transfer.agent import TransferError
from shared.kv_transfer.notice import TransferNotice
from shared.registry.peers import PeerNotFound

log = logging.getLogger("duet.decode")


class Revoker:
    def __init__(self, ctx):
        self.ctx = ctx
        self._aloop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()

    async def stop(self) -> None:
        self._aloop = None

    def __call__(self, res) -> None:
        """Send res's writer a revoke (res: a quarantined Reservation, with its token)."""
        notice = TransferNotice(reservation_id=res.reservation_id, generation=res.generation, rank=0,
                                request_id=res.request_id, kind="revoke", num_ranks=1,
                                reply_to=self.ctx.worker_id, reply_nonce=self.ctx.instance_nonce,
                                ack=res.revoke_token, key=res.secret)
        peer = self.ctx.agent.peer(res.writer_id)
        if peer is not None:
            self._send(peer, notice, res.writer_id)
        elif self._aloop is not None:
            asyncio.run_coroutine_threadsafe(self._resolve_and_send(res.writer_id, notice), self._aloop)

    async def _resolve_and_send(self, writer_id: str, notice: TransferNotice) -> None:
        try:
            peer = await self.ctx.peers.get(writer_id, "", "")
        except (PeerNotFound, TransferError) as exc:
            log.info("could not revoke reservation %d at %s: %s", notice.reservation_id, writer_id, exc)
            return
        self._send(peer, notice, writer_id)

    def _send(self, peer, notice: TransferNotice, writer_id: str) -> None:
        try:
            self.ctx.agent.send_notif(peer, notice.encode())
        except TransferError as exc:  # the writer is gone: its leave frees the pages
            log.info("could not revoke reservation %d at %s: %s", notice.reservation_id, writer_id, exc)
