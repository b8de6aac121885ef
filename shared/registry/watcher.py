"""The live worker set as read from Redis, kept current in the background.

A periodic SCAN is the source of truth (it is how leaves by TTL are seen); the join
channel makes new workers appear at once. When Redis cannot be reached the watcher
keeps serving the last set it read (docs/ARCHITECTURE.md, "Failure rules": serving stays up), and says so in
`redis_ok`. Filters: model and compat hash (several deployments may share a Redis), and,
given an EntryTrust (the router under mutual TLS: entry_trust.py), only entries whose worker
proved it is the worker they name.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from shared.registry.config import RegistryConfig
from shared.registry.entry_trust import EntryTrust
from shared.registry.keys import RegistryKeys
from shared.registry.publisher import connect_async
from shared.registry.worker_info import WorkerInfo

log = logging.getLogger(__name__)


class WorkerWatcher:
    def __init__(
        self,
        config: RegistryConfig,
        *,
        model: str | None = None,
        compat_hash: str | None = None,
        on_change: Callable[[dict[str, WorkerInfo]], None] | None = None,
        trust: EntryTrust | None = None,
    ):
        self.config = config
        self.keys = RegistryKeys(config.prefix)
        self.model = model or None
        self.compat_hash = compat_hash or None
        self._on_change = on_change
        self.trust = trust
        self._workers: dict[str, WorkerInfo] = {}
        self._client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        # stop() sets it before cancelling: a loop whose cancellation a Redis call swallowed
        # (redis-py does, when cancelled while its pub/sub connection is being set up) still
        # ends at its next turn instead of running forever
        self._stopping = False
        self.redis_ok = False
        self.scans = 0
        self._outage = False  # Redis failed since the last good scan
        self._keep_known_until = 0.0  # monotonic: after an outage, known workers get a TTL to re-register

    # --- reading the set (no I/O) ----------------------------------------------

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Last known live workers, optionally of one role, sorted by id."""
        found = [w for w in self._workers.values() if (role is None or w.role == role) and self._trusted(w)]
        return sorted(found, key=lambda w: w.worker_id)

    def get(self, worker_id: str) -> WorkerInfo | None:
        info = self._workers.get(worker_id)
        return info if info is not None and self._trusted(info) else None

    def _trusted(self, info: WorkerInfo) -> bool:
        return self.trust is None or self.trust.admits(info)

    def is_live(self, worker_id: str, instance_nonce: str | None = None) -> bool:
        """In the last known set (with this nonce, if given). A Redis outage never makes a worker 'gone'."""
        info = self._workers.get(worker_id)
        return info is not None and (instance_nonce is None or info.instance_nonce == instance_nonce)

    def _accepts(self, info: WorkerInfo) -> bool:
        return ((self.model is None or info.model == self.model)
                and (self.compat_hash is None or info.compat_hash == self.compat_hash))

    # --- Redis -------------------------------------------------------------------

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = connect_async(self.config)
        return self._client

    async def refresh(self) -> bool:
        """One full scan. Replaces the set on success; keeps it (returns False) if Redis fails."""
        try:
            ids = []
            async for key in self.client.scan_iter(match=self.keys.worker_scan_pattern, count=500):
                worker_id = self.keys.worker_id_from_key(key.decode() if isinstance(key, bytes) else key)
                if worker_id is not None:
                    ids.append(worker_id)
            pipe = self.client.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(self.keys.worker(worker_id))
            raws = await pipe.execute() if ids else []
        except Exception as exc:
            if self.redis_ok:
                log.warning("registry unreachable, serving the last known %d workers: %s", len(self._workers), exc)
            self.redis_ok = False
            self._note_outage()
            return False
        fresh: dict[str, WorkerInfo] = {}
        for worker_id, raw in zip(ids, raws):
            info = self._decode(worker_id, raw)
            if info is not None and self._accepts(info):
                fresh[worker_id] = info
        now = asyncio.get_running_loop().time()
        if self._outage:
            # A Redis that comes back (restarted, empty) does not know the workers yet: they
            # re-register at their next heartbeat. Until one TTL has passed, a known worker
            # missing from the scan is not gone; after that the scan is the truth again.
            self._outage = False
            self._keep_known_until = now + self.config.ttl_s
        if now < self._keep_known_until:
            fresh = {**self._workers, **fresh}
        self.redis_ok = True
        self.scans += 1
        self._replace(fresh)
        return True

    def rescan_soon(self) -> None:
        """Scan now rather than at the next interval (a reader just found Redis answering again)."""
        self._wake.set()

    async def refresh_one(self, worker_id: str) -> WorkerInfo | None:
        """Read one worker now (after a join announcement)."""
        try:
            raw = await self.client.hgetall(self.keys.worker(worker_id))
        except Exception as exc:
            log.debug("reading worker %s failed: %s", worker_id, exc)
            return None
        info = self._decode(worker_id, raw)
        if info is not None and self._accepts(info):
            self._replace({**self._workers, worker_id: info})
        return info

    def _note_outage(self) -> None:
        if self.scans > 0:  # a Redis that was never reached has no known set to protect
            self._outage = True

    def _decode(self, worker_id: str, raw: dict) -> WorkerInfo | None:
        if not raw:
            return None  # expired between SCAN and HGETALL
        try:
            return WorkerInfo.from_hash(raw)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring malformed registry entry %s: %s", worker_id, exc)
            return None

    def _replace(self, fresh: dict[str, WorkerInfo]) -> None:
        changed = fresh.keys() != self._workers.keys() or any(
            fresh[k].instance_nonce != self._workers[k].instance_nonce for k in fresh)
        self._workers = fresh
        if self.trust is not None:
            self.trust.sync(list(fresh.values()))
        if changed and self._on_change is not None:
            self._on_change(dict(fresh))

    # --- background loops ------------------------------------------------------

    async def start(self) -> None:
        """First scan (so the set is ready when this returns, if Redis is up), then background loops."""
        await self.refresh()
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._scan_loop(), name="registry-scan"),
            asyncio.create_task(self._events_loop(), name="registry-events"),
        ]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel the loops and close the client; a loop that does not end within timeout_s (a
        Redis call that swallows its cancellation) is left behind rather than awaited forever:
        a stopping process must not hang on it."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: a loop that failed while stopping is not news
            if pending:
                log.warning("registry watcher: %d loop(s) still running %gs after being cancelled", len(pending),
                            timeout_s)
        self._tasks = []
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await asyncio.wait_for(client.aclose(), timeout_s)
            except (asyncio.TimeoutError, OSError, ConnectionError) as exc:
                log.warning("registry watcher: closing the Redis client: %s", exc or type(exc).__name__)

    async def __aenter__(self) -> "WorkerWatcher":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def wait_for(self, predicate: Callable[["WorkerWatcher"], bool], timeout: float) -> bool:
        """Wait until predicate(self) holds (checked after every change/scan)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _scan_loop(self) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.scan_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.refresh()

    async def _events_loop(self) -> None:
        """Follow join/leave announcements; reconnect with backoff when Redis drops."""
        backoff = 0.1
        while not self._stopping:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.events_channel)
                backoff = 0.1
                if self._outage:  # Redis answers again: read the set now, not at the next interval
                    self._wake.set()
                while not self._stopping:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        await self._handle_event(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("registry event subscription dropped: %s", exc)
                self._note_outage()  # Redis may restart between two scans
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.scan_interval_s)

    async def _handle_event(self, data) -> None:
        try:
            event = json.loads(data)
            worker_id = event["worker_id"]
        except (TypeError, ValueError, KeyError):
            return
        if event.get("event") in ("join", "role"):  # a role switch is seen at once, as a join
            await self.refresh_one(worker_id)
        elif event.get("event") == "leave" and worker_id in self._workers:
            current = self._workers[worker_id]
            if current.instance_nonce == event.get("instance_nonce"):
                self._replace({k: v for k, v in self._workers.items() if k != worker_id})
