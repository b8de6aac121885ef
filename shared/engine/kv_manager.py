"""Page ownership for requests: prefix matching, growth, release into the prefix cache,
reservations for incoming transfers, and the accounting the metrics report."""
from __future__ import annotations

from .kv_pool import PageAllocator
from .radix_cache import RadixCache
from .request import Req


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool, kv_events=None):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache, events=kv_events)
        self.reserved: dict[str, list[int]] = {}  # reservation id -> pages (decode side)

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

    # -- requests -----------------------------------------------------------------------
    def match_prefix(self, req: Req) -> None:
        """Attach the longest cached prefix (leaving at least one token to compute)."""
        if req.page_ids or req.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed (as vLLM does)
        pages, node = self.cache.match_prefix(req.token_ids[: len(req.token_ids) - 1])
        self.cache.lock(node)
        req.prefix_node = node
        req.page_ids = list(pages)
        req.num_tree_pages = len(pages)
        req.num_computed = len(pages) * self.page_size

    def drop_prefix(self, req: Req) -> None:
        """Undo match_prefix for a request that could not be admitted after all."""
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = None
        req.page_ids, req.num_tree_pages, req.num_computed = [], 0, 0

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
    def reserve(self, reservation_id: str, num_tokens: int) -> list[int] | None:
        pages = self.allocate(self.pages_for(num_tokens))
        if pages is not None:
            self.reserved[reservation_id] = pages
        return pages

    def take_reservation(self, reservation_id: str) -> list[int]:
        return self.reserved.pop(reservation_id)

    def cancel_reservation(self, reservation_id: str) -> bool:
        pages = self.reserved.pop(reservation_id, None)
        if pages is None:
            return False
        self.allocator.free(pages)
        return True

    def check_idle(self) -> None:
        """Invariant for tests and drains: with no live work every page is free or cached."""
        total = self.allocator.num_free + self.cache.num_cached_pages
        assert total == self.capacity, f"page leak: {self.capacity - total} pages unaccounted"
        assert self.cache.num_locked_pages == 0, "cached pages still locked with no live work"
        assert not self.reserved, f"reservations still open: {list(self.reserved)}"
