"""Page ownership for requests: prefix matching (loading pages back from the host tier),
growth, release into the prefix cache, reservations for incoming transfers, and the
accounting the metrics report."""
from __future__ import annotations

from dataclasses import dataclass

from .kv_pool import PageAllocator
from .radix_cache import PrefixMatch, RadixCache, RadixNode
from .request import Req


@dataclass
class KVReservation:
    """Decode side of a transfer: the leading pages this worker already holds (tree pages,
    locked by `node` for the request's life) and the fresh pages a prefill worker writes."""

    held_pages: list[int]
    fresh_pages: list[int]
    node: RadixNode | None
    host_loaded_pages: int = 0  # of held_pages, the ones loaded back from the host tier
    load_event: object = None  # CUDA event of that load (None: nothing in flight)

    @property
    def page_ids(self) -> list[int]:
        return self.held_pages + self.fresh_pages


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool, kv_events=None,
                 host_tier=None):
        """host_tier: kv_host_tier.HostKVTier under the device pool, or None."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache, events=kv_events,
                                host=host_tier)
        self.reserved: dict[str, KVReservation] = {}  # reservation id -> its pages (decode side)

    # -- capacity -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def available(self) -> int:
        """Pages obtainable now: free plus evictable cached pages."""
        return self.allocator.num_free + self.cache.num_evictable_pages

    @property
    def used_by_live_work(self) -> int:
        """Pages held by running/held requests and reservations (cache-only pages excluded)."""
        return self.capacity - self.available

    @property
    def usage_ratio(self) -> float:
        return self.used_by_live_work / self.capacity

    @property
    def host_tier(self):
        return self.cache.host

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        if self.allocator.num_free < n:
            return None
        return self.allocator.allocate(n)

    # -- prefix matching ------------------------------------------------------------------
    def match_and_lock(self, tokens: list[int]) -> tuple[PrefixMatch, object]:
        """The longest prefix of `tokens` held in any tier, brought onto the device (host
        pages are loaded back as far as device pages can be had) and locked: returns the
        match (its pages, its deepest locked node) and the load's event (None: no copy in
        flight, or on the CPU)."""
        m = self.cache.match(tokens)
        stats = self.cache.stats
        stats.device_hit_pages += len(m.pages)
        event = None
        if m.host_nodes and self.cache.host is not None:
            self.cache.lock(m.deepest)  # nothing on the path may be evicted while we allocate
            wanted, before = m.deepest, stats.loaded_pages
            self.cache.load_back(m, self.allocate)
            stats.host_hit_pages += stats.loaded_pages - before
            if stats.loaded_pages > before and self.cache.host.stream is not None:
                event = self._last_load_event()
            self.cache.lock(m.node)
            self.cache.unlock(wanted)
        else:
            self.cache.lock(m.node)
        return m, event

    def _last_load_event(self):
        """An event after every load queued so far on the host tier's stream."""
        import torch
        event = torch.cuda.Event()
        event.record(self.cache.host.stream)
        return event

    def match_prefix(self, req: Req) -> None:
        """Attach the longest cached prefix (leaving at least one token to compute)."""
        if req.page_ids or req.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed (as vLLM does)
        before = self.cache.stats.loaded_pages
        m, event = self.match_and_lock(req.token_ids[: len(req.token_ids) - 1])
        req.prefix_node = m.node
        req.page_ids = list(m.pages)
        req.num_tree_pages = len(m.pages)
        req.num_computed = len(m.pages) * self.page_size
        req.num_host_loaded_tokens = (self.cache.stats.loaded_pages - before) * self.page_size
        req.kv_load_event = event
        req.host_pages_waiting = m.num_host_pages  # what load_back could not bring over now

    def drop_prefix(self, req: Req) -> None:
        """Undo match_prefix for a request that could not be admitted after all (pages
        loaded back from the host stay on the device, in the tree)."""
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = None
        req.page_ids, req.num_tree_pages, req.num_computed = [], 0, 0
        req.host_pages_waiting = 0

    def grow(self, req: Req, upto_tokens: int) -> bool:
        """Make sure pages cover positions [0, upto_tokens); False if out of pages."""
        need = self.pages_for(upto_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        pages = self.allocate(need)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def release(self, req: Req, cache: bool = True) -> None:
        """Return a request's pages: full computed pages go to the prefix cache, the rest
        are freed; its prefix lock is dropped."""
        own = req.page_ids[req.num_tree_pages:]
        if cache and self.cache.enabled and req.num_computed >= self.page_size:
            full = req.num_computed // self.page_size
            dup, node = self.cache.insert(req.token_ids[: full * self.page_size], req.page_ids[:full])
            tail = req.page_ids[full:]
            to_free = dup + tail
            # the new path is owned by the tree now; nothing of it stays locked for us
        else:
            to_free = own
        self.allocator.free(to_free)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = None
        req.page_ids, req.num_tree_pages = [], 0

    # -- reservations (decode side of a KV transfer) ------------------------------------
    def reserve(self, reservation_id: str, num_tokens: int, prompt_ids: list[int] | None = None,
                ) -> KVReservation | None:
        """Pages for a prompt of num_tokens whose KV another worker writes. With the prompt's
        token ids, the leading full pages this worker holds (any tier) are reused and locked:
        only the rest is fresh. None when the pages cannot be had now."""
        held, node, loaded, event = [], None, 0, None
        if prompt_ids is not None and self.cache.enabled:
            full = (min(len(prompt_ids), num_tokens) // self.page_size) * self.page_size
            before = self.cache.stats.loaded_pages
            m, event = self.match_and_lock(list(prompt_ids[:full]))
            held, node = list(m.pages), m.node
            loaded = self.cache.stats.loaded_pages - before
        fresh = self.allocate(self.pages_for(num_tokens) - len(held))
        if fresh is None:
            if node is not None:
                self.cache.unlock(node)
            return None
        res = KVReservation(held, fresh, node, loaded, event)
        self.reserved[reservation_id] = res
        return res

    def take_reservation(self, reservation_id: str) -> KVReservation:
        return self.reserved.pop(reservation_id)

    def cancel_reservation(self, reservation_id: str) -> bool:
        res = self.reserved.pop(reservation_id, None)
        if res is None:
            return False
        self.allocator.free(res.fresh_pages)
        if res.node is not None:
            self.cache.unlock(res.node)
        return True

    def check_idle(self) -> None:
        """Invariant for tests and drains: with no live work every page of every tier is
        free or cached, and nothing is locked."""
        total = self.allocator.num_free + self.cache.num_cached_pages
        assert total == self.capacity, f"page leak: {self.capacity - total} pages unaccounted"
        assert self.cache.num_locked_pages == 0, "cached pages still locked with no live work"
        assert not self.reserved, f"reservations still open: {list(self.reserved)}"
        host = self.cache.host
        if host is not None:
            total = host.allocator.num_free + self.cache.num_host_pages
            assert total == host.capacity, f"host page leak: {host.capacity - total} pages unaccounted"
