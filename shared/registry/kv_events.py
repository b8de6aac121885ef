"""Which prefix pages a worker holds, published as Redis sets of page hashes.

The engine's radix cache reports each step of a page's life (from any thread): `stored`
(it entered the cache, on the device), `offloaded` (it left the device for the host tier),
`loaded` (back on the device), `removed` (gone from every tier). The registry heartbeat
drains the changes into `<p>:worker:<id>:pages` (held in any tier) and
`<p>:worker:<id>:pages:host` (held in the host tier only) with SADD/SREM + EXPIRE in its
transaction, and re-sends both sets after a re-registration. Routers ask
`cached_prefix_pages()`: how many leading prompt pages each worker holds.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class _TrackedSet:
    """A set plus the changes not yet published (hash -> True added / False removed)."""

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.pending: dict[int, bool] = {}

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.members.add(h)
            self.pending[h] = True

    def discard(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.members.discard(h)
            self.pending[h] = False

    def drain(self) -> tuple[list[int], list[int]]:
        pending, self.pending = self.pending, {}
        return [h for h, p in pending.items() if p], [h for h, p in pending.items() if not p]

    def restore(self, added: Sequence[int], removed: Sequence[int]) -> None:
        for h in added:
            self.pending.setdefault(h, True)
        for h in removed:
            self.pending.setdefault(h, False)

    def snapshot(self) -> list[int]:
        self.pending = {}
        return list(self.members)


class KvEventBuffer:
    """Thread-safe record of held page hashes (any tier, and host-only) plus the changes not
    yet published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = _TrackedSet()  # in any tier
        self._host = _TrackedSet()  # in the host tier only (not on the device)

    # -- the radix cache's events -------------------------------------------------------
    def stored(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        with self._lock:
            self._held.add(hashes)
            self._host.discard(h for h in hashes if h in self._host.members)

    def offloaded(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._host.add(hashes)

    def loaded(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._host.discard(h for h in hashes if h in self._host.members)

    def removed(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        with self._lock:
            self._held.discard(hashes)
            self._host.discard(h for h in hashes if h in self._host.members)

    # -- the publisher's side -----------------------------------------------------------
    def drain(self) -> tuple[list[int], list[int]]:
        """(added, removed) of the held set since the last drain, net of each other."""
        with self._lock:
            return self._held.drain()

    def drain_host(self) -> tuple[list[int], list[int]]:
        """The same for the host-only set."""
        with self._lock:
            return self._host.drain()

    def restore(self, added: Sequence[int], removed: Sequence[int], host_added: Sequence[int] = (),
                host_removed: Sequence[int] = ()) -> None:
        """Put back changes whose publication failed (newer changes win)."""
        with self._lock:
            self._held.restore(added, removed)
            self._host.restore(host_added, host_removed)

    def snapshot(self) -> list[int]:
        """All held hashes; also clears pending (a full resync supersedes them)."""
        with self._lock:
            return self._held.snapshot()

    def snapshot_host(self) -> list[int]:
        with self._lock:
            return self._host.snapshot()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held.members)

    @property
    def has_pending(self) -> bool:
        """Changes wait to be published (a cheap check, no lock: a race only delays them)."""
        return bool(self._held.pending or self._host.pending)

    @property
    def num_host_only(self) -> int:
        with self._lock:
            return len(self._host.members)


def leading_matches(flags: Sequence[int | bool]) -> int:
    """Number of leading truthy flags (SMISMEMBER output -> cached leading pages)."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


async def cached_prefix_pages(client, pages_keys: dict[str, str], page_hashes: Sequence[int]) -> dict[str, int]:
    """For each worker id -> pages key, how many leading pages of the prompt it holds.

    One pipelined SMISMEMBER per worker (async redis client)."""
    if not page_hashes or not pages_keys:
        return {worker_id: 0 for worker_id in pages_keys}
    members = [str(h) for h in page_hashes]
    pipe = client.pipeline(transaction=False)
    for key in pages_keys.values():
        pipe.smismember(key, members)
    results = await pipe.execute()
    return {worker_id: leading_matches(flags) for worker_id, flags in zip(pages_keys, results)}
