"""A NIXL agent over one KV pool tensor: the pool is registered once; per request only
descriptor lists are built.

Peers are keyed by registry worker id and cached with the instance nonce they were
added under; adding the same worker with a new nonce (it restarted) drops the old
NIXL metadata and fails that peer's in-flight writes. All writes are WRITEs from
the caller's pool into the peer's pool (prefill -> decode); every call is
non-blocking except `wait()`.

NIXL's agent is not thread-safe in its default sync mode, so every call into it is
made under one lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.kv_transfer.descriptors import descriptor_arrays, merge_page_runs
from shared.kv_transfer.head_plan import HeadCopy, copy_bytes_per_page, copy_descriptors
from shared.kv_transfer.notice import TransferNotice
from shared.kv_transfer.pool_info import PoolInfo

log = logging.getLogger(__name__)

PENDING, DONE, FAILED = "PENDING", "DONE", "FAILED"


class TransferError(RuntimeError):
    """A write could not be posted (peer unknown or gone, bad page ids)."""


@dataclass(frozen=True)
class Peer:
    worker_id: str
    instance_nonce: str
    agent_name: str      # NIXL agent name of the remote rank
    pool: PoolInfo       # the remote rank's pool
    rank: int = 0        # the remote TP rank

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker_id, self.rank)


@dataclass
class WriteHandle:
    """One posted write (one NIXL transfer request, possibly many descriptors)."""

    peer: Peer
    num_bytes: int
    num_descriptors: int
    num_pages: int
    started: float                 # time.monotonic() at post
    deadline: float                # monotonic; past it the write counts as failed
    state: str = PENDING
    error: str = ""
    finished: float = 0.0
    probe: bool = False  # a connection warm-up write (peer_warmup.py): not KV, not counted
    _xfer: object | None = field(default=None, repr=False)

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started


class KvTransferAgent:
    """One NIXL agent (one TP rank) with its KV pool registered."""

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        *,
        backends: Sequence[str] = ("UCX",),
        write_timeout_s: float = 30.0,
        metrics=None,
        progress_thread: bool = True,
        first_head: int = 0,
    ):
        """name: unique NIXL agent name (e.g. f"{worker_id}-r{rank}-{nonce}").
        metrics: optional object with observe_kv_transfer(direction, num_bytes, seconds)
        (shared.telemetry.metrics.DuetMetrics).
        progress_thread: NIXL's own UCX progress thread. The Python binding runs it with a
        zero delay, so it spins a core even when idle. Without it, UCX progresses only
        inside this agent's calls (poll, get_notifs, ...), so both sides must keep
        polling while a transfer is in flight (host-memory writes over shm/TCP need the
        target's progress too); the workers' engine loops do, and turn it off."""
        from nixl._api import nixl_agent, nixl_agent_config  # heavy: loads UCX

        self.name = name
        self.pool = pool
        self.pool_info = PoolInfo.from_tensor(pool, first_head=first_head)  # first_head: this rank's KV heads
        self.write_timeout_s = write_timeout_s
        self._metrics = metrics
        self._lock = threading.RLock()
        self._nixl = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                        backends=list(backends)))
        self._reg = self._nixl.register_memory(pool)
        self._peers: dict[tuple[str, int], Peer] = {}
        self._inflight: list[WriteHandle] = []
        self.bytes_sent = 0
        self.writes_done = 0
        self.writes_failed = 0
        self.descriptors_posted = 0
        # (worker id, instance nonce) of every peer written into: between GPUs of one host
        # their memory stays mapped here until exit (services/worker_runtime/peer_memory_exit.py)
        self._written: set[tuple[str, str]] = set()
        self._closed = False

    # --- metadata and peers ----------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (publish it in the registry)."""
        with self._lock:
            return self._nixl.get_agent_metadata()

    def add_peer(self, worker_id: str, instance_nonce: str, metadata: bytes, pool: PoolInfo,
                 rank: int = 0) -> Peer:
        """Load a remote rank's metadata, or return the cached peer if the nonce is unchanged.

        A new nonce for a known worker (it restarted) drops every cached rank of it first."""
        with self._lock:
            cached = self._peers.get((worker_id, rank))
            if cached is not None and cached.instance_nonce == instance_nonce:
                return cached
            stale = [p for p in self._peers.values() if p.worker_id == worker_id and p.instance_nonce != instance_nonce]
            for old in stale:
                log.info("peer %s restarted (nonce %s -> %s): dropping its metadata and writes",
                         worker_id, old.instance_nonce, instance_nonce)
                self._drop_peer(old, reason="peer restarted")
            agent_name = self._nixl.add_remote_agent(metadata)
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            peer = Peer(worker_id=worker_id, instance_nonce=instance_nonce, agent_name=agent_name, pool=pool,
                        rank=rank)
            self._peers[peer.key] = peer
            return peer

    def written_peers(self) -> set[tuple[str, str]]:
        """(worker id, instance nonce) of every peer a write was posted to."""
        with self._lock:
            return set(self._written)

    def peer(self, worker_id: str, rank: int = 0) -> Peer | None:
        return self._peers.get((worker_id, rank))

    def remove_peer(self, worker_id: str) -> None:
        """Forget every rank of a worker (it left the registry); their in-flight writes fail."""
        with self._lock:
            for peer in [p for p in self._peers.values() if p.worker_id == worker_id]:
                self._drop_peer(peer, reason="peer removed")

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        for handle in [h for h in self._inflight if h.peer.key == peer.key]:
            self._fail(handle, reason)
        self._peers.pop(peer.key, None)
        try:
            self._nixl.remove_remote_agent(peer.agent_name)
        except Exception as exc:  # already gone inside NIXL
            log.debug("remove_remote_agent(%s): %s", peer.agent_name, exc)

    def _check_current(self, peer: Peer) -> None:
        current = self._peers.get(peer.key)
        if current is None or current.instance_nonce != peer.instance_nonce:
            raise TransferError(f"peer {peer.worker_id} (nonce {peer.instance_nonce}) is no longer known")

    # --- writes -----------------------------------------------------------------

    def write_pages(self, peer: Peer, src_page_ids: Sequence[int], dst_page_ids: Sequence[int],
                    notif: bytes = b"", heads: HeadCopy | None = None, probe: bool = False) -> WriteHandle:
        """Post a WRITE of local pages src[i] into the peer's pages dst[i]. Non-blocking.

        Contiguous runs on both sides become one descriptor each. heads: only that head
        range of each page (workers at different TP sizes, head_plan.py): one descriptor
        per page and K/V block. `notif` (if any) is delivered to the peer after this
        write's data has landed there. Raises TransferError if it cannot be posted (the
        peer is gone, bad page ids)."""
        if len(src_page_ids) == 0:
            raise TransferError("write_pages needs at least one page")
        self.pool_info.check_pages(src_page_ids, "source")
        peer.pool.check_pages(dst_page_ids, "destination")
        if heads is None:
            src, dst = descriptor_arrays(merge_page_runs(src_page_ids, dst_page_ids), self.pool_info, peer.pool)
            num_bytes = len(src_page_ids) * self.pool_info.page_bytes
        else:
            src, dst = copy_descriptors(heads, src_page_ids, dst_page_ids, self.pool_info, peer.pool)
            num_bytes = len(src_page_ids) * copy_bytes_per_page(heads, self.pool_info)
        now = time.monotonic()
        handle = WriteHandle(peer=peer, num_bytes=num_bytes, num_descriptors=len(src),
                             num_pages=len(src_page_ids), started=now, deadline=now + self.write_timeout_s,
                             probe=probe)
        with self._lock:
            self._check_current(peer)
            try:
                xfer = self._nixl.initialize_xfer(
                    "WRITE",
                    self._nixl.get_xfer_descs(src, self.pool_info.mem_type),
                    self._nixl.get_xfer_descs(dst, peer.pool.mem_type),
                    peer.agent_name,
                    notif,
                )
                handle._xfer = xfer
                state = self._nixl.transfer(xfer)
            except Exception as exc:
                if handle._xfer is not None:
                    self._release(handle)
                self.writes_failed += 1
                raise TransferError(f"write to {peer.worker_id} could not be posted: {exc}") from exc
            if not probe:
                self.descriptors_posted += len(src)
            if state == "ERR":
                self._release(handle)
                self.writes_failed += 1
                raise TransferError(f"write to {peer.worker_id} failed at post")
            self._inflight.append(handle)
            self._written.add((peer.worker_id, peer.instance_nonce))
            self._update(handle)
        return handle

    def poll(self, handle: WriteHandle) -> str:
        """PENDING, DONE or FAILED (FAILED also when past the deadline). Non-blocking."""
        with self._lock:
            if handle.state == PENDING:
                self._update(handle)
            return handle.state

    def poll_all(self) -> list[WriteHandle]:
        """Advance every in-flight write; return those that finished (DONE or FAILED) now."""
        with self._lock:
            finished = []
            for handle in list(self._inflight):
                self._update(handle)
                if handle.state != PENDING:
                    finished.append(handle)
            return finished

    def wait(self, handle: WriteHandle, timeout_s: float | None = None, poll_interval_s: float = 0.0005) -> str:
        """Block until the write is DONE/FAILED (tests and simple sync callers)."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.write_timeout_s + 1)
        while self.poll(handle) == PENDING and time.monotonic() < end:
            time.sleep(poll_interval_s)
        return handle.state

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def _update(self, handle: WriteHandle) -> None:
        try:
            state = self._nixl.check_xfer_state(handle._xfer)
        except Exception as exc:
            self._fail(handle, f"state check failed: {exc}")
            return
        if state == "DONE":
            handle.state, handle.finished = DONE, time.monotonic()
            self._inflight.remove(handle)
            self._release(handle)
            if handle.probe:
                return
            self.bytes_sent += handle.num_bytes
            self.writes_done += 1
            if self._metrics is not None:
                self._metrics.observe_kv_transfer("sent", handle.num_bytes, handle.seconds)
        elif state == "ERR":
            self._fail(handle, "transfer error (peer gone?)")
        elif time.monotonic() > handle.deadline:
            self._fail(handle, f"no completion within {self.write_timeout_s}s")

    def _fail(self, handle: WriteHandle, reason: str) -> None:
        if handle.state != PENDING:
            return
        handle.state, handle.error, handle.finished = FAILED, reason, time.monotonic()
        if handle in self._inflight:
            self._inflight.remove(handle)
        self._release(handle)
        self.writes_failed += 1
        log.warning("KV write to %s failed: %s", handle.peer.worker_id, reason)

    def _release(self, handle: WriteHandle) -> None:
        xfer, handle._xfer = handle._xfer, None
        if xfer is None:
            return
        try:
            self._nixl.release_xfer_handle(xfer)
        except Exception as exc:  # NIXL could not cancel an active transfer; it frees it at agent teardown
            log.debug("releasing transfer handle: %s", exc)

    # --- notifications ------------------------------------------------------------

    def send_notif(self, peer: Peer, message: bytes) -> None:
        """A standalone notification (ordered after writes that already reported DONE)."""
        with self._lock:
            self._check_current(peer)
            try:
                self._nixl.send_notif(peer.agent_name, message)
            except Exception as exc:
                raise TransferError(f"notification to {peer.worker_id} failed: {exc}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message), oldest first per sender."""
        with self._lock:
            raw = self._nixl.get_new_notifs()
        out = []
        for sender, messages in raw.items():
            name = sender.decode() if isinstance(sender, bytes) else sender
            out.extend((name, bytes(m)) for m in messages)
        return out

    def get_notices(self) -> list[TransferNotice]:
        """New Duet completion notices (other notifications are dropped with a log line)."""
        notices = []
        for sender, message in self.get_notifs():
            notice = TransferNotice.decode(message)
            if notice is None:
                log.warning("ignoring a non-Duet notification from %s", sender)
                continue
            notices.append(notice)
        return notices

    # --- teardown -----------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._inflight):
                self._fail(handle, "agent closing")
            for peer in list(self._peers.values()):
                self._drop_peer(peer, reason="agent closing")
            try:
                self._nixl.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("deregister_memory: %s", exc)

    def __enter__(self) -> "KvTransferAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
