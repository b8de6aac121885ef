"""KV transfer on a tensor-parallel follower rank (ranks 1..N-1 of a prefill or decode worker).

Every rank holds its own shard of the KV pool (its kv heads), so every rank needs its
own NIXL agent: prefill rank r writes the KV heads it holds into the decode rank(s) that
hold them (head_plan.py; rank r -> rank r when both TP sizes are equal) and sends its
completion notice to decode rank 0, whose scheduler waits for one notice per prefill rank.

Rank 0 drives this over the tensor-parallel control pipe (`TPWorkers.call`): these
functions run in the follower with its Engine as the first argument, and the state lives
on that engine (`engine.rank_services`). Rank 0 batches a tick's operations into one
`apply_ops` call and gets every stream's state back, so a follower needs no Redis client
and no thread of its own. While idle, the follower's control loop calls `idle_tick` so
UCX progresses (host-memory writes need the target to progress too)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.kv_transfer.agent import DONE, FAILED, PENDING, KvTransferAgent, Peer, TransferError
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.pool_info import PoolInfo
from shared.kv_transfer.write_stream import PageWriteStream, rank_stream

SERVICE_KEY = "kv_transfer"


@dataclass(frozen=True)
class PeerSpec:
    """What a follower needs to load one remote rank: sent by rank 0, which read it from Redis."""

    worker_id: str
    instance_nonce: str
    rank: int
    metadata: bytes
    pool: PoolInfo


@dataclass(frozen=True)
class StreamOp:
    """One operation on one follower stream. kind: open | write | finish | abort.
    open: args = (every decode rank's PeerSpec by rank, dst page ids, the head plan): the
    rank writes its copies of the plan (head_plan.py) and notifies decode rank 0;
    write: (first page index, src page ids); finish/abort: (TransferNotice of rank 0,
    restamped with the follower's rank and byte count there)."""

    key: str
    kind: str
    args: tuple = ()


@dataclass
class StreamState:
    state: str
    error: str = ""
    bytes_sent: int = 0


@dataclass
class RankTransfers:
    """A follower rank's agent and its open write streams (prefill) or just its agent (decode)."""

    agent: KvTransferAgent
    rank: int
    streams: dict[str, PageWriteStream] = field(default_factory=dict)
    probes: list = field(default_factory=list)  # connection probes in flight (WriteHandle)

    def peer(self, spec: PeerSpec) -> Peer:
        return self.agent.add_peer(spec.worker_id, spec.instance_nonce, spec.metadata, spec.pool, rank=spec.rank)

    def apply(self, ops: list[StreamOp]) -> dict[str, StreamState]:
        """Apply ops in order, advance every stream, return the state of each stream an op
        named or that is still open; finished streams are dropped after reporting."""
        touched, errors = set(), {}
        if self.probes:
            self.probes = [h for h in self.probes if self.agent.poll(h) == PENDING]
        for op in ops:
            touched.add(op.key)
            try:
                self._apply_one(op)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own types; the stream fails, the rank lives
                errors.setdefault(op.key, f"rank {self.rank}: {exc}")  # the first error is the cause
                stream = self.streams.get(op.key)
                if stream is not None:
                    stream.state, stream.error = FAILED, errors[op.key]
        states: dict[str, StreamState] = {}
        for key in touched | set(self.streams):
            stream = self.streams.get(key)
            if stream is None:
                states[key] = StreamState(FAILED, errors.get(key, f"rank {self.rank}: no such stream"))
                continue
            state = stream.poll()
            states[key] = StreamState(state, stream.error, stream.bytes_sent)
            if state in (DONE, FAILED):
                del self.streams[key]  # reported; later ops on it fail, which rank 0 expects
        return states

    def _apply_one(self, op: StreamOp) -> None:
        if op.kind == "open":
            specs, dst, copies = op.args
            mine = {c.dst_rank for c in copies if c.src_rank == self.rank} | {0}
            peers = {j: self.peer(specs[j]) for j in sorted(mine)}  # only the decode ranks it writes
            self.streams[op.key] = rank_stream(self.agent, self.rank, peers, copies, dst)
            return
        stream = self.streams.get(op.key)
        if stream is None:
            raise TransferError(f"stream {op.key} is not open on this rank")
        if op.kind == "write":
            first, src = op.args
            stream.write(first, src)
        elif op.kind in ("finish", "abort"):
            (notice,) = op.args
            mine = TransferNotice(**{**notice.__dict__, "rank": self.rank, "kv_bytes": 0})
            (stream.finish if op.kind == "finish" else stream.abort)(mine)
        else:
            raise ValueError(f"unknown stream op {op.kind!r}")

    def probe(self, specs: list[PeerSpec], copies) -> int:
        """Connect to a decode worker before its first request (services/prefill/peer_warmup.py):
        post this rank's probe writes of the padding page; they complete in idle ticks.
        Returns how many were posted."""
        posted = 0
        for c in copies:
            if c.src_rank == self.rank:
                self.probes.append(self.agent.write_pages(self.peer(specs[c.dst_rank]), [0], [0],
                                                          heads=None if c.whole_page else c, probe=True))
                posted += 1
        return posted

    def idle_tick(self) -> None:
        """Let UCX progress while rank 0 sends nothing (a decode rank is a passive target)."""
        self.agent.get_notifs()
        for stream in self.streams.values():
            stream.poll()
        if self.probes:
            self.probes = [h for h in self.probes if self.agent.poll(h) == PENDING]


# -- entry points run on followers through TPWorkers.call(target, *args) ----------------------

def open_agent(engine, name_template: str, write_timeout_s: float) -> tuple[bytes, PoolInfo]:
    """Create this rank's agent (named name_template.format(rank=...)) over its pool shard;
    return (NIXL metadata, pool layout)."""
    agent = KvTransferAgent(name_template.format(rank=engine.tp.rank), engine.pool.buffer,
                            write_timeout_s=write_timeout_s, progress_thread=False,
                            first_head=engine.kv_heads.first)
    engine.rank_services[SERVICE_KEY] = RankTransfers(agent, engine.tp.rank)
    return agent.metadata(), agent.pool_info


def apply_ops(engine, ops: list[StreamOp]) -> dict[str, StreamState]:
    return engine.rank_services[SERVICE_KEY].apply(ops)


def probe_peers(engine, specs: list[PeerSpec], copies) -> int:
    return engine.rank_services[SERVICE_KEY].probe(specs, copies)


def close_agent(engine) -> None:
    service = engine.rank_services.pop(SERVICE_KEY, None)
    if service is not None:
        service.agent.close()
