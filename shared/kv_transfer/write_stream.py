"""One reservation's writes from one prefill rank, then its completion notice.

Prefill posts a write for each run of pages as chunks finish (so the transfer hides
behind compute), then `finish(notice)`. The notice is sent only after every write
reported DONE (NIXL flushes each transfer, so DONE means the data is at the peer),
so decode never sees the notice before the last byte. If any write fails the
stream is FAILED and the caller frees its pages; decode recomputes or fails after
its own deadline.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shared.kv_transfer.agent import DONE, FAILED, PENDING, KvTransferAgent, Peer, TransferError, WriteHandle
from shared.kv_transfer.head_plan import HeadCopy
from shared.kv_transfer.notice import TransferNotice


@dataclass(frozen=True)
class WriteTarget:
    """One destination rank of a stream; heads: the head range this rank writes there (None:
    whole pages, the peer's layout equals ours)."""

    peer: Peer
    heads: HeadCopy | None = None


class PageWriteStream:
    def __init__(self, agent: KvTransferAgent, peer: Peer | None, dst_page_ids: Sequence[int],
                 notice_peer: Peer | None = None, targets: Sequence[WriteTarget] | None = None,
                 notices: tuple[bool, int] = (True, 0)):
        """dst_page_ids: the reservation's pages on the peer rank(s), in prompt order (every
        rank of a TP worker uses the same page ids).
        notice_peer: where the notice goes (default: the data peer). With TP, every prefill
        rank notifies decode rank 0 (its scheduler) while writing to its own decode rank(s).
        targets: the decode ranks this rank writes (head_plan.py) when the workers' TP sizes
        differ; default the one peer, whole pages. May be empty (a replica nobody reads
        from). notices: (whether this rank sends a notice, how many the reader must wait
        for, stamped on it; 0: as many as the reader has ranks)."""
        self.agent = agent
        self.targets = list(targets) if targets is not None else [WriteTarget(peer)]
        self.peer = peer
        self.notice_peer = notice_peer or peer
        if self.notice_peer is None:
            raise ValueError("a stream needs a notice peer")
        self.send_notice, self.notices_expected = notices
        self.dst_page_ids = list(dst_page_ids)
        self._handles: list[WriteHandle] = []
        self._written = [False] * len(self.dst_page_ids)
        self._notice: TransferNotice | None = None
        self.state = PENDING
        self.error = ""

    def write(self, first_page_index: int, src_page_ids: Sequence[int]) -> None:
        """Write local pages into reservation slots first_page_index, first_page_index+1, ..."""
        if self.state != PENDING or self._notice is not None:
            raise TransferError(f"stream is {self.state}{' and finished' if self._notice else ''}")
        end = first_page_index + len(src_page_ids)
        if first_page_index < 0 or end > len(self.dst_page_ids):
            raise TransferError(f"pages [{first_page_index}, {end}) outside a reservation of "
                                f"{len(self.dst_page_ids)} pages")
        try:
            for target in self.targets:
                self._handles.append(self.agent.write_pages(target.peer, src_page_ids,
                                                            self.dst_page_ids[first_page_index:end],
                                                            heads=target.heads))
        except TransferError as exc:
            self._set_failed(str(exc))
            raise
        for i in range(first_page_index, end):
            self._written[i] = True

    def finish(self, notice: TransferNotice) -> None:
        """No more writes; send `notice` once all writes have landed (see poll())."""
        self._notice = notice
        self.poll()

    def abort(self, notice: TransferNotice) -> None:
        """Stop writing; once no write is in flight any more, tell the peer (kind="abort")
        so it can reuse the pages at once instead of waiting for its deadline."""
        self._notice = TransferNotice(**{**notice.__dict__, "kind": "abort"})
        if self.state == FAILED:  # failed writes are no longer in flight: the abort can go out
            self.state = PENDING
        self.poll()

    def poll(self) -> str:
        """Advance: PENDING, DONE (all writes landed and notice sent) or FAILED. Non-blocking."""
        if self.state != PENDING:
            return self.state
        aborting = self._notice is not None and self._notice.kind == "abort"
        for handle in self._handles:
            if self.agent.poll(handle) == FAILED and not aborting:
                self._set_failed(handle.error or "write failed")
                return self.state
        if self._notice is None or any(h.state == PENDING for h in self._handles):
            return self.state
        if not self.send_notice:  # a rank that wrote nothing: the reader does not wait for it
            self.state = DONE
            return self.state
        notice = TransferNotice(**{**self._notice.__dict__, "num_ranks": self.notices_expected})
        if notice.kv_bytes == 0 and self.bytes_sent:
            notice = TransferNotice(**{**notice.__dict__, "kv_bytes": self.bytes_sent})
        try:
            self.agent.send_notif(self.notice_peer, notice.encode())
        except TransferError as exc:
            self._set_failed(str(exc))
            return self.state
        self.state = DONE
        return self.state

    def wait(self, timeout_s: float, poll_interval_s: float = 0.0005) -> str:
        """Block until DONE/FAILED or the timeout (then still PENDING)."""
        end = time.monotonic() + timeout_s
        while self.poll() == PENDING and time.monotonic() < end:
            time.sleep(poll_interval_s)
        return self.state

    async def wait_async(self, timeout_s: float, poll_interval_s: float = 0.001) -> str:
        """Same as wait() without blocking the event loop."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.poll() == PENDING and loop.time() < end:
            await asyncio.sleep(poll_interval_s)
        return self.state

    @property
    def notice_queued(self) -> bool:
        """finish() or abort() was called: no more writes."""
        return self._notice is not None

    def _set_failed(self, reason: str) -> None:
        self.state, self.error = FAILED, reason

    @property
    def pages_written(self) -> int:
        return sum(self._written)

    @property
    def bytes_sent(self) -> int:
        return sum(h.num_bytes for h in self._handles if h.state == DONE)

    @property
    def num_descriptors(self) -> int:
        return sum(h.num_descriptors for h in self._handles)


def rank_stream(agent: KvTransferAgent, rank: int, decode_peers: Sequence[Peer], copies: Sequence[HeadCopy],
                dst_page_ids: Sequence[int]) -> PageWriteStream:
    """Prefill rank `rank`'s stream for one reservation: its share of the head plan
    (head_plan.plan_head_copies) to the decode ranks it names, then its notice to decode
    rank 0, which waits for one from every rank that writes (a replica that writes nothing
    sends none)."""
    targets = [WriteTarget(decode_peers[c.dst_rank], c) for c in copies if c.src_rank == rank]
    writers = {c.src_rank for c in copies} | {0}  # rank 0 always tells (its notice has the first token)
    return PageWriteStream(agent, None, dst_page_ids, notice_peer=decode_peers[0], targets=targets,
                           notices=(rank in writers, len(writers)))
