"""A worker's side of the registry: register, heartbeat, deregister.

WorkerPublisher is asyncio-native (rank 0's gRPC server loop runs it as a task).
HeartbeatThread runs the same publisher on its own event loop in a daemon thread,
for a worker whose main loop is synchronous.

Every write is one MULTI/EXEC transaction (HSET + PEXPIRE together), so a reader
never sees a worker entry without a TTL. A heartbeat that finds its entry gone
(TTL lapsed during a stall, or Redis restarted empty) re-registers in full and
re-announces the join.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable

import redis.asyncio as aioredis

from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.kv_events import KvEventBuffer
from shared.registry.worker_info import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


def connect_async(config: RegistryConfig) -> aioredis.Redis:
    """An asyncio Redis client with bounded socket timeouts (create it inside the loop that uses it)."""
    return aioredis.Redis.from_url(config.redis_url, health_check_interval=0, **config.client_kwargs())


class WorkerPublisher:
    """Keeps one worker's registry entry alive while `run()` (or `start()`) is active."""

    def __init__(
        self,
        info: WorkerInfo,
        config: RegistryConfig,
        *,
        nixl_metadata: dict[int, bytes] | None = None,
        load_fn: Callable[[], WorkerLoad] | None = None,
        kv_events: KvEventBuffer | None = None,
    ):
        self.info = info
        self.config = config
        self.keys = RegistryKeys(config.prefix)
        self.nixl_metadata = dict(nixl_metadata or {})
        self.kv_events = kv_events if kv_events is not None else KvEventBuffer()
        self._load_fn = load_fn
        self._client: aioredis.Redis | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._registered = threading.Event()  # threading: HeartbeatThread callers wait on it
        self.registrations = 0                # full (re-)registrations done
        self.failed_beats = 0

    # --- load ------------------------------------------------------------------

    def set_load(self, load: WorkerLoad) -> None:
        """Publish this load at the next heartbeat (safe from any thread)."""
        self.info.load = load

    def _current_load(self) -> WorkerLoad:
        return self._load_fn() if self._load_fn is not None else self.info.load

    # --- Redis operations ----------------------------------------------------

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = connect_async(self.config)
        return self._client

    async def register(self) -> None:
        """Write the whole entry (hash, NIXL metadata, held page hashes) and announce the join."""
        wid, ttl = self.info.worker_id, self.config.ttl_ms
        worker_key, nixl_key, pages_key = self.keys.worker(wid), self.keys.nixl(wid), self.keys.pages(wid)
        host_key = self.keys.host_pages(wid)
        self.info.load = self._current_load()
        held, host_only = self.kv_events.snapshot(), self.kv_events.snapshot_host()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(worker_key, nixl_key, pages_key, host_key)
        pipe.hset(worker_key, mapping=self.info.to_hash())
        pipe.pexpire(worker_key, ttl)
        if self.nixl_metadata:
            pipe.hset(nixl_key, mapping={str(rank): md for rank, md in self.nixl_metadata.items()})
            pipe.pexpire(nixl_key, ttl)
        for key, members in ((pages_key, held), (host_key, host_only)):
            if members:
                pipe.sadd(key, *[str(h) for h in members])
                pipe.pexpire(key, ttl)
        await pipe.execute()
        await self.client.publish(self.keys.events_channel, self._event("join"))
        self.registrations += 1
        self._registered.set()
        log.info("registered worker %s (%s) at %s", wid, self.info.role, self.info.address)

    async def heartbeat_once(self) -> None:
        """Renew the TTLs, publish load and page-hash changes; re-register if the entry was lost."""
        wid, ttl = self.info.worker_id, self.config.ttl_ms
        worker_key, nixl_key = self.keys.worker(wid), self.keys.nixl(wid)
        self.info.load = self._current_load()
        self.info.heartbeat_seq += 1
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(worker_key)
        pipe.hset(worker_key, mapping=self.info.to_hash())
        pipe.pexpire(worker_key, ttl)
        pipe.pexpire(nixl_key, ttl)
        changes = self._queue_kv_events(pipe)
        try:
            results = await pipe.execute()
        except Exception:
            self.kv_events.restore(*changes)
            raise
        if not results[0]:
            log.warning("registry entry of %s was gone (TTL lapse or Redis restart); re-registering", wid)
            await self.register()

    def _queue_kv_events(self, pipe) -> tuple[list[int], list[int], list[int], list[int]]:
        """Add the pending page-hash changes (both sets, their TTLs) to `pipe`; returns them, to
        put back if the pipeline fails."""
        wid, ttl = self.info.worker_id, self.config.ttl_ms
        pages_key, host_key = self.keys.pages(wid), self.keys.host_pages(wid)
        added, removed = self.kv_events.drain()
        host_added, host_removed = self.kv_events.drain_host()
        for key, add, rem in ((pages_key, added, removed), (host_key, host_added, host_removed)):
            if add:
                pipe.sadd(key, *[str(h) for h in add])
            if rem:
                pipe.srem(key, *[str(h) for h in rem])
            pipe.pexpire(key, ttl)
        return added, removed, host_added, host_removed

    async def publish_kv_events(self) -> None:
        """Publish prefix-cache changes now (between heartbeats)."""
        pipe = self.client.pipeline(transaction=True)
        changes = self._queue_kv_events(pipe)
        try:
            await pipe.execute()
        except Exception:
            self.kv_events.restore(*changes)
            raise

    async def announce_role(self, role: str) -> None:
        """Advertise `role` now (a switchable worker's role switch): the entry is rewritten in one
        transaction and a `role` event makes watchers read it at once instead of at their next
        scan. The next heartbeat rewrites it anyway, should this fail."""
        self.info.role = role
        await self.heartbeat_once()
        await self.client.publish(self.keys.events_channel, self._event("role"))
        log.info("worker %s now advertises role %s", self.info.worker_id, role)

    async def deregister(self) -> None:
        wid = self.info.worker_id
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.worker(wid), self.keys.nixl(wid), self.keys.pages(wid), self.keys.host_pages(wid))
        pipe.publish(self.keys.events_channel, self._event("leave"))
        await pipe.execute()
        self._registered.clear()
        log.info("deregistered worker %s", wid)

    def _event(self, kind: str) -> str:
        return json.dumps({"event": kind, "worker_id": self.info.worker_id,
                           "instance_nonce": self.info.instance_nonce})

    # --- lifecycle -------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    async def wait_registered(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.registered:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def run(self) -> None:
        """Register (retrying while Redis is down), then heartbeat until stop() is called."""
        self._stop = self._stop or asyncio.Event()
        interval = self.config.heartbeat_interval_s
        while not self._stop.is_set():
            try:
                if not self.registered:
                    await self.register()
                else:
                    await self.heartbeat_once()
            except Exception as exc:  # Redis down or timing out: keep serving, retry next beat
                self.failed_beats += 1
                log.warning("registry heartbeat of %s failed: %s", self.info.worker_id, exc)
            await self._wait_beat(interval)

    async def _wait_beat(self, interval: float) -> None:
        """Until the next heartbeat or stop(), publishing page-hash changes as they come."""
        loop = asyncio.get_running_loop()
        end = loop.time() + interval
        step = max(0.005, min(self.config.kv_events_interval_s, interval))
        while not self._stop.is_set() and (left := end - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(step, left))
            except asyncio.TimeoutError:
                pass
            if self.registered and self.kv_events.has_pending:
                try:
                    await self.publish_kv_events()
                except Exception as exc:  # the next heartbeat retries them
                    log.debug("publishing KV events of %s failed: %s", self.info.worker_id, exc)

    async def start(self) -> None:
        """Run in the background on the current loop."""
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.run(), name=f"registry-heartbeat-{self.info.worker_id}")

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating; on a clean shutdown also delete the entry and announce the leave."""
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
        if deregister:
            try:
                await self.deregister()
            except Exception as exc:
                log.warning("deregistering %s failed (the TTL will remove it): %s", self.info.worker_id, exc)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class HeartbeatThread:
    """Runs a WorkerPublisher on a private event loop in a daemon thread (for sync workers).

    Update load with `publisher.set_load(...)` and page hashes with
    `publisher.kv_events.stored/removed(...)` from the worker's own thread.
    """

    def __init__(self, publisher: WorkerPublisher):
        self.publisher = publisher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._deregister = True

    def start(self, wait_registered_s: float | None = None) -> bool:
        """Start the thread; optionally wait for the first registration. Returns registered-ness."""
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self.publisher._stop = asyncio.Event()
            ready.set()
            try:
                loop.run_until_complete(self.publisher.run())
                loop.run_until_complete(self.publisher.stop(deregister=self._deregister))
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name="registry-heartbeat", daemon=True)
        self._thread.start()
        ready.wait()
        if wait_registered_s is not None:
            return self.publisher._registered.wait(wait_registered_s)
        return self.publisher.registered

    def stop(self, *, deregister: bool = True, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._deregister = deregister
        stop_event = self.publisher._stop
        if stop_event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(stop_event.set)
        self._thread.join(timeout)
        self._thread = None
