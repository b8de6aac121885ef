"""Page ownership for requests: prefix matching (loading pages back from the host tier),
growth, release into the prefix cache, reservations for incoming transfers, and the
accounting the metrics report. Every match and insert is under the request's cache
namespace, and eviction and admission follow the per-tenant quotas (tenant_quota.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .cache_scope import DEFAULT_SCOPE, CacheScope
from .kv_pool import PageAllocator
from .kv_write_back import WriteBackConfig
from .radix_cache import PrefixMatch, RadixCache, RadixNode
from .request import Req
from .tenant_quota import TenantQuota, first_within_share

T = TypeVar("T")
EVICT_SHARE = 256  # eviction frees at least 1/256 of the pool when it runs


@dataclass
class KVReservation:
    """Decode side of a transfer: the leading pages this worker already holds (tree pages,
    locked by `node` for the request's life) and the fresh pages a prefill worker writes."""

    held_pages: list[int]
    fresh_pages: list[int]
    node: RadixNode | None
    host_loaded_pages: int = 0  # of held_pages, the ones loaded back from the host tier
    load_ticket: int | None = None  # the host tier's ticket of that load (None: nothing in flight)
    scope: CacheScope = field(default=DEFAULT_SCOPE)  # the request's: held pages matched under it
    continues: bool = False  # the prompt extends a sequence this worker held (a conversation)

    @property
    def page_ids(self) -> list[int]:
        return self.held_pages + self.fresh_pages


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool, kv_events=None,
                 host_tier=None, quota: TenantQuota | None = None, write_back: WriteBackConfig | None = None):
        """host_tier: kv_host_tier.HostKVTier under the device pool, or None; write_back: what
        is written to it, how fast, how far ahead (kv_write_back.py)."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache, events=kv_events,
                                host=host_tier, write_back=write_back)
        self.reserved: dict[str, KVReservation] = {}  # reservation id -> its pages (decode side)
        self.quota = quota if quota is not None else TenantQuota()
        # the live requests, whose own pages count against their tenants (the engine sets it)
        self.live_requests: Callable[[], Iterable[Req]] = tuple

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

    # -- the host tier's copies ---------------------------------------------------------------
    def tick_tiers(self, waiting_tokens: int = 0) -> bool:
        """Each step: settle the copies that landed and write back ahead of need (never
        waits); waiting_tokens: what the queued requests will need pages for. True while
        copies are in flight (an idle loop keeps polling)."""
        writer = self.cache.writer
        if writer is None:
            return False
        writer.tick(self.allocator.num_free, self.pages_for(waiting_tokens))
        return writer.busy

    @property
    def writing_back(self) -> bool:
        """Write-back copies are in flight (pages they hold free up once they land)."""
        return self.cache.writer is not None and self.cache.writer.busy

    def copy_landed(self, ticket: int | None) -> bool:
        """Whether a load's ticket has landed (None: nothing was in flight)."""
        return ticket is None or ticket <= self.cache.host.landed

    def allocate(self, n: int, keep_copies: bool = False) -> list[int] | None:
        """n free device pages, evicting cached ones as needed (None: not that many);
        keep_copies: give up no write-back copy in flight for them (RadixCache.evict)."""
        if n <= 0:
            return []
        if self.allocator.num_free < n:
            # at least EVICT_SHARE of the pool at a time: eviction walks the tree, and a full
            # pool would otherwise walk it for every decode row that crosses a page
            short = n - self.allocator.num_free
            self.cache.evict(max(short, self.capacity // EVICT_SHARE), self._over_cache_share(), keep_copies)
        if self.allocator.num_free < n:
            return None
        return self.allocator.allocate(n)

    # -- tenants ----------------------------------------------------------------------------
    def live_pages_by_tenant(self) -> dict[int, int]:
        """Pages live work holds, per tenant: each request's own pages (not the tree's) and
        each reservation's fresh pages. Counted from the requests themselves, so it cannot
        drift from them."""
        out: dict[int, int] = {}
        for req in self.live_requests():
            own = len(req.page_ids) - req.num_tree_pages
            if own:
                out[req.scope.tenant] = out.get(req.scope.tenant, 0) + own
        for res in self.reserved.values():
            if res.fresh_pages:
                out[res.scope.tenant] = out.get(res.scope.tenant, 0) + len(res.fresh_pages)
        return out

    def _over_cache_share(self) -> Callable[[int], bool] | None:
        """Whether a tenant's live and cached pages are past its cache share now (None: no quota)."""
        if not self.quota.limits_cache or len(self.cache.device_pages_by_tenant) < 2:
            return None  # one tenant's pages (or none): its LRU is everyone's
        live, cached, capacity = self.live_pages_by_tenant(), self.cache.device_pages_by_tenant, self.capacity
        return lambda tenant: self.quota.over_cache_share(live.get(tenant, 0), cached.get(tenant, 0), capacity)

    def over_live_share(self) -> Callable[[int], bool] | None:
        """Whether a tenant's live work holds its share of the pool now (None: no live quota)."""
        if not self.quota.limits_live:
            return None
        live, capacity = self.live_pages_by_tenant(), self.capacity
        return lambda tenant: self.quota.over_live_share(live.get(tenant, 0), capacity)

    def next_in_turn(self, waiting: Sequence[T], tenant_of: Callable[[T], int]) -> T:
        """Which waiting item goes next: the first, unless its tenant's live work holds its
        share of the pool and another tenant's item, within its share, waits: then the
        first such (the scheduler's admissions; decode's Reserve queue passes over the same
        tenants with over_live_share)."""
        head = waiting[0]
        over = self.over_live_share() if len(waiting) > 1 else None
        if over is None or not over(tenant_of(head)):
            return head
        return first_within_share(waiting, tenant_of, over) or head

    # -- prefix matching ------------------------------------------------------------------
    def match_and_lock(self, tokens: list[int], namespace: int = 0,
                       extends_finished: bool | None = None) -> PrefixMatch:
        """A request's longest prefix of `tokens` held in any tier under `namespace`, brought
        onto the device (host pages are loaded back as far as device pages can be had) and
        locked: the match (its pages, its deepest locked node, `load_ticket` of the load in
        flight, whether the tokens continue a sequence held here or one that left; extends_finished:
        whether they hold a finished prompt, when the caller knows)."""
        m = self.cache.match(tokens, namespace, count_hit=True)
        if extends_finished is None:
            extends_finished = self.extends_finished(tokens, namespace)
        m.continues = m.continues or extends_finished
        stats = self.cache.stats
        stats.device_hit_pages += len(m.pages)
        if m.host_nodes and self.cache.host is not None:
            self.cache.lock(m.deepest)  # nothing on the path may be evicted while we allocate
            wanted, before = m.deepest, stats.loaded_pages
            self.cache.load_back(m, self.allocate)
            stats.host_hit_pages += stats.loaded_pages - before
            self.cache.lock(m.node)
            self.cache.unlock(wanted)
        else:
            self.cache.lock(m.node)
        return m

    def extends_finished(self, tokens: list[int], namespace: int = 0) -> bool:
        """Whether `tokens` hold the whole prompt of a request that finished here (the write
        policy's sign of a conversation, kv_write_policy.FinishedPrompts)."""
        writer = self.cache.writer
        return writer is not None and writer.continued(tokens, namespace)

    def held_prefix_tokens(self, tokens: list[int], namespace: int = 0) -> int:
        """Leading tokens of `tokens` held in any tier under `namespace`, in whole pages: nothing
        locked, loaded or counted as a hit (the path's recency is refreshed, as the request's own
        match right after does), e.g. for what a request will not prefill."""
        m = self.cache.match(tokens, namespace)
        return (len(m.pages) + m.num_host_pages) * self.page_size

    def match_prefix(self, req: Req) -> None:
        """Attach the longest cached prefix (leaving at least one token to compute)."""
        if req.page_ids or req.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed (as vLLM does)
        before = self.cache.stats.loaded_pages
        tokens = req.token_ids[: len(req.token_ids) - 1]
        if req.extends_finished is None:  # asked once: a request held back is matched again each step
            req.extends_finished = self.extends_finished(tokens, req.scope.cache_key)
        m = self.match_and_lock(tokens, req.scope.cache_key, req.extends_finished)
        req.prefix_node = m.node
        req.page_ids = list(m.pages)
        req.num_tree_pages = len(m.pages)
        req.num_computed = len(m.pages) * self.page_size
        req.num_host_loaded_tokens = (self.cache.stats.loaded_pages - before) * self.page_size
        req.kv_load_ticket = m.load_ticket
        req.continues = m.continues
        req.host_pages_waiting = m.num_host_pages  # what load_back could not bring over now

    def drop_prefix(self, req: Req) -> None:
        """Undo match_prefix for a request that could not be admitted after all (pages
        loaded back from the host stay on the device, in the tree)."""
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = None
        req.page_ids, req.num_tree_pages, req.num_computed = [], 0, 0
        req.host_pages_waiting = 0

    def grow(self, req: Req, upto_tokens: int, keep_copies: bool = False) -> bool:
        """Make sure pages cover positions [0, upto_tokens); False if out of pages."""
        need = self.pages_for(upto_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        pages = self.allocate(need, keep_copies)
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
            dup, node = self.cache.insert(req.token_ids[: full * self.page_size], req.page_ids[:full], req.scope,
                                          conversation=req.continues, seq_end=True)
            if self.cache.writer is not None:  # its next turn, extending this prompt, is a conversation's
                self.cache.writer.finished(req.prompt_ids, req.scope.cache_key, req.continues)
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
                scope: CacheScope = DEFAULT_SCOPE) -> KVReservation | None:
        """Pages for a prompt of num_tokens whose KV another worker writes. With the prompt's
        token ids, the leading full pages this worker holds (any tier, under scope's
        namespace) are reused and locked: only the rest is fresh. None when the pages cannot
        be had now."""
        held, node, loaded, ticket, continues = [], None, 0, None, False
        if prompt_ids is not None and self.cache.enabled:
            full = (min(len(prompt_ids), num_tokens) // self.page_size) * self.page_size
            before = self.cache.stats.loaded_pages
            m = self.match_and_lock(list(prompt_ids[:full]), scope.cache_key)
            held, node, ticket, continues = list(m.pages), m.node, m.load_ticket, m.continues
            loaded = self.cache.stats.loaded_pages - before
        fresh = self.allocate(self.pages_for(num_tokens) - len(held))
        if fresh is None:
            if node is not None:
                self.cache.unlock(node)
            return None
        res = KVReservation(held, fresh, node, loaded, ticket, scope, continues)
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
        by_tenant = self.cache.device_pages_by_tenant
        assert sum(by_tenant.values()) == self.cache.num_cached_pages and min(by_tenant.values(), default=1) > 0, \
            f"cached pages per tenant {by_tenant} do not add up to {self.cache.num_cached_pages}"
        assert not self.live_pages_by_tenant(), f"pages still held per tenant: {self.live_pages_by_tenant()}"
        host = self.cache.host
        if host is not None:  # free, the tree's copies (landed or in flight), given-up copies in flight
            total = host.allocator.num_free + self.cache.num_host_pages + self.cache.writer.orphan_pages
            assert total == host.capacity, f"host page leak: {host.capacity - total} pages unaccounted"
