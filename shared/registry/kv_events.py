"""Which prefix pages a prefill worker holds, published as a Redis set of page hashes.

The engine calls `stored(hashes)` when pages enter its prefix cache and
`removed(hashes)` when it evicts them (from any thread); the registry heartbeat
drains the changes into `<p>:worker:<id>:pages` (SADD/SREM + EXPIRE in its
transaction) and re-sends the whole set after a re-registration. Routers ask
`cached_prefix_pages()`: how many leading prompt pages each worker holds.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class KvEventBuffer:
    """Thread-safe record of held page hashes plus the changes not yet published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._pending: dict[int, bool] = {}  # hash -> True (added) / False (removed)

    def stored(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                self._held.add(h)
                self._pending[h] = True

    def removed(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                self._held.discard(h)
                self._pending[h] = False

    def drain(self) -> tuple[list[int], list[int]]:
        """(added, removed) since the last drain, net of each other."""
        with self._lock:
            pending, self._pending = self._pending, {}
        added = [h for h, present in pending.items() if present]
        removed = [h for h, present in pending.items() if not present]
        return added, removed

    def restore(self, added: Sequence[int], removed: Sequence[int]) -> None:
        """Put back changes whose publication failed (newer changes win)."""
        with self._lock:
            for h in added:
                self._pending.setdefault(h, True)
            for h in removed:
                self._pending.setdefault(h, False)

    def snapshot(self) -> list[int]:
        """All held hashes; also clears pending (a full resync supersedes them)."""
        with self._lock:
            self._pending = {}
            return list(self._held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


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
