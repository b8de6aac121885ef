"""Rank 0's view of one reservation's writes from every tensor-parallel rank of a prefill worker.

`TpWriteStream` has PageWriteStream's interface, so the prefill side treats a TP worker
like a single-rank one: rank 0 writes its own shard through a local PageWriteStream and
mirrors each operation into the followers' streams (rank_transfers.py). Follower
operations are queued and sent once per engine-loop tick in one call (`FollowerStreams.flush`),
which also brings back every follower stream's state. The whole stream is DONE only when
every rank's writes landed and its notice went out: only then may rank 0 free the source
pages, which every rank reuses at the same ids."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from shared.kv_transfer.agent import DONE, FAILED, PENDING
from shared.kv_transfer.head_plan import HeadCopy
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.rank_transfers import PeerSpec, StreamOp, StreamState
from shared.kv_transfer.write_stream import PageWriteStream

APPLY = "shared.kv_transfer.rank_transfers:apply_ops"


class FollowerStreams:
    """Queue of follower stream operations; owned by the engine-loop thread."""

    def __init__(self, engine, num_followers: int):
        self.engine = engine
        self.num_followers = num_followers
        self._ops: list[StreamOp] = []
        self._open: set[str] = set()
        self.states: dict[str, list[StreamState]] = {}
        self._keys = itertools.count(1)

    def new_key(self) -> str:
        return f"s{next(self._keys)}"

    def queue(self, op: StreamOp) -> None:
        if op.kind == "open":
            self._open.add(op.key)
        self._ops.append(op)

    def forget(self, key: str) -> None:
        self.states.pop(key, None)

    def flush(self) -> bool:
        """Send queued ops and poll open streams on every follower; False if nothing to do."""
        if not self._ops and not self._open:
            return False
        ops, self._ops = self._ops, []
        per_rank = self.engine.call_followers(APPLY, ops)
        for key in {op.key for op in ops} | self._open:
            states = [r.get(key, StreamState(FAILED, "stream unknown to a rank")) for r in per_rank]
            self.states[key] = states
            if all(s.state in (DONE, FAILED) for s in states):
                self._open.discard(key)  # the followers dropped it
        return True


class TpWriteStream:
    def __init__(self, local: PageWriteStream, followers: FollowerStreams, peers: Sequence[PeerSpec],
                 dst_page_ids: Sequence[int], plan: Sequence[HeadCopy]):
        """local: rank 0's stream. peers: every decode rank, by rank. plan: every rank's head
        copies (head_plan.py); each prefill rank writes its own and sends its notice to
        peers[0] (decode's scheduler)."""
        self.local = local
        self.followers = followers
        self.key = followers.new_key()
        self.dst_page_ids = list(dst_page_ids)
        self._notice: TransferNotice | None = None
        self._final: tuple[str, str] | None = None  # (DONE or FAILED, error) once settled
        self._final_bytes = 0
        followers.queue(StreamOp(self.key, "open", (tuple(peers), self.dst_page_ids, tuple(plan))))

    def write(self, first_page_index: int, src_page_ids: Sequence[int]) -> None:
        self.local.write(first_page_index, src_page_ids)  # raises on a bad range before anything is queued
        self.followers.queue(StreamOp(self.key, "write", (first_page_index, list(src_page_ids))))

    def finish(self, notice: TransferNotice) -> None:
        self._notice = notice
        self.local.finish(notice)
        self.followers.queue(StreamOp(self.key, "finish", (notice,)))

    def abort(self, notice: TransferNotice) -> None:
        self._notice = TransferNotice(**{**notice.__dict__, "kind": "abort"})
        self.local.abort(notice)
        self.followers.queue(StreamOp(self.key, "abort", (notice,)))
        self._final = None  # like the local stream, a FAILED one waits again: for every rank's abort notice

    @property
    def notice_queued(self) -> bool:
        return self._notice is not None

    @property
    def state(self) -> str:
        return self.poll()

    @property
    def error(self) -> str:
        self.poll()
        return self._final[1] if self._final else ""

    def poll(self) -> str:
        if self._final is not None:
            return self._final[0]
        local = self.local.poll()
        remote = self.followers.states.get(self.key)
        states = [local] + ([s.state for s in remote] if remote else [PENDING])
        if self._notice is not None and self._notice.kind == "abort":
            # like PageWriteStream: DONE once every rank has nothing in flight and told
            # decode (a rank that failed, or never opened, has nothing in flight either)
            if PENDING in states:
                return PENDING
            final = (DONE, "")
        elif FAILED in states:
            errors = [self.local.error] + [s.error for s in (remote or [])]
            final = (FAILED, "; ".join(e for e in errors if e) or "write failed")
        elif all(s == DONE for s in states):
            final = (DONE, "")
        else:
            return PENDING
        self._final_bytes = self.bytes_sent
        self._final = final
        self.followers.forget(self.key)
        return final[0]

    @property
    def bytes_sent(self) -> int:
        if self._final is not None:
            return self._final_bytes
        remote = self.followers.states.get(self.key) or []
        return self.local.bytes_sent + sum(s.bytes_sent for s in remote)
