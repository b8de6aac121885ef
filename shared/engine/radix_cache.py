"""Radix tree over whole KV pages, keyed by token ids, so requests that share a prompt
prefix reuse its pages (SGLang's RadixAttention idea at page granularity), with a lower
tier under the device for pages the device had to give up.

Each node holds a run of tokens whose length is a multiple of the page size and where
their KV lives: `pages` on the device (what attention reads; empty once evicted from it)
and `host_pages` in the lower tier (kv_host_tier.py: pinned host memory; empty when it has
no copy). Both residencies are closed under prefixes: a node on the device has every
ancestor on the device, and a node held anywhere has every ancestor held somewhere.

Nodes on a live request's path are locked (lock_ref > 0): never evicted from any tier.
Eviction walks device -> host -> gone, least recently used first: an unlocked device leaf
(no child on the device) whose host copy has landed leaves the device at once and stays in
the host tier; one the write policy does not want leaves the tree; one it wants whose copy
has not landed is passed over while anything else can be freed, and dropped only when nothing
else is left: those never queued for a copy first, then those whose copy is in flight (given up;
kv_write_back.py writes the wanted pages ahead, and a prefill chunk takes no such page, so that
is a decode row's need). No eviction ever waits for a copy. Host-only leaves leave the tree when
the host tier needs room. A match that runs into host-only nodes can load them back (`load_back`).
Each node counts the requests whose match found it (`hits`) and knows whether a request that
continued an earlier sequence inserted it (`conversation`): what the write policy reads.
Every step publishes a KV event when an event sink is set: stored (entered the tree),
offloaded (device -> host), loaded (host -> device), removed (gone from every tier).

The tree is partitioned by cache key (cache_scope.py: the cache namespace, mixed with the LoRA
adapter's name when a request runs one): a top-level node's key in the root's children starts
with it (SGLang's `extra_key`), so a request matches only pages inserted under its own key (no
tenant another's, no adapter the base model's), and the page hashes a node publishes are seeded
with it. Each node remembers the tenant that inserted it: `device_pages_by_tenant` counts the
device pages each tenant's nodes hold, and eviction can take from chosen tenants first
(`evict(over_share=...)`, tenant_quota.py)."""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .cache_scope import DEFAULT_SCOPE, CacheScope
from .kv_pool import PageAllocator
from .kv_write_back import HostWriter, WriteBackConfig


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)  # device pages ([] when not on the device)
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    hashes: list[int] = field(default_factory=list)  # chained page hashes, when published
    host_pages: list[int] = field(default_factory=list)  # lower-tier copy ([] when none)
    namespace: int = 0  # the cache key it was inserted under (CacheScope.cache_key; its whole path shares it)
    tenant: int = 0  # who inserted it: its device pages count against that tenant
    hits: int = 0  # requests whose match found it (the one that inserted it is not one)
    conversation: bool = False  # inserted by a request that continued a sequence held here
    seq_end: bool = False  # the last node a finished sequence inserted (its next turn extends it)
    write_batch: object = None  # kv_write_back.WriteBatch while its host copy is in flight
    write_reason: str = ""  # why the write policy wanted its host copy
    load_ticket: int | None = None  # host tier's ticket of the load writing its device pages, until seen landed

    def __lt__(self, other: "RadixNode") -> bool:
        return self.last_access < other.last_access

    @property
    def on_device(self) -> bool:
        return bool(self.pages)

    @property
    def host_ready(self) -> bool:
        """It has a host copy that has landed (one in flight is not yet a copy)."""
        return bool(self.host_pages) and self.write_batch is None


@dataclass
class PrefixMatch:
    """The longest held prefix: its device pages, then the host-only nodes that continue it."""

    pages: list[int]  # device pages of the leading, device-resident part
    node: RadixNode  # deepest device-resident node (the root when none)
    host_nodes: list[RadixNode]  # host-only nodes after `node`, in path order
    continues: bool = False  # the tokens extend a finished sequence held here (a conversation's next turn)
    load_ticket: int | None = None  # the host tier's ticket of the last load_back copy (None: none)

    @property
    def num_host_pages(self) -> int:
        return sum(len(n.host_pages) for n in self.host_nodes)

    @property
    def deepest(self) -> RadixNode:
        return self.host_nodes[-1] if self.host_nodes else self.node


@dataclass
class TierStats:
    """Page counts since start, per tier; the worker turns them into Prometheus counters."""

    device_hit_pages: int = 0  # pages a match found on the device
    host_hit_pages: int = 0  # pages a match found in the host tier only (then loaded back)
    offloaded_pages: int = 0  # pages that left the device kept by their landed host copy
    loaded_pages: int = 0  # host -> device copies
    device_evicted_pages: int = 0  # pages that left the device (kept on host or dropped)
    host_evicted_pages: int = 0  # host copies dropped to make room
    dropped_pages: int = 0  # pages that left the tree (no tier kept them)
    quota_evicted_pages: int = 0  # of device_evicted_pages, taken from tenants over their cache share


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True, events=None,
                 host=None, write_back: WriteBackConfig | None = None):
        """events: optional sink with stored / offloaded / loaded / removed(hashes) (KV events
        that tell routers which prompt pages this worker holds). host: optional lower tier
        (kv_host_tier.HostKVTier): its `allocator`, `save(device_pages, host_pages)`,
        `load(host_pages, device_pages)` and `poll()`; write_back: what is written to it, how
        fast, how far ahead (kv_write_back.py; default: the `reused` policy, unbounded)."""
        self.events = events
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.host = host if enabled else None
        # with a host tier: what is written back to it, and when (kv_write_back.py)
        self.writer = HostWriter(self, self.host, write_back or WriteBackConfig()) if self.host is not None else None
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self.num_cached_pages = 0  # device pages owned by the tree
        self.num_locked_pages = 0  # device pages of the tree on some live request's path
        self.num_host_pages = 0  # host pages owned by the tree
        self.device_pages_by_tenant: dict[int, int] = {}  # of num_cached_pages, per inserting tenant
        # bumped by every change that can change what write-back would copy (its walk is skipped
        # while nothing did): device pages, hits, locks released, host copies dropped
        self.version = 0
        self.stats = TierStats()

    # -- lookup -------------------------------------------------------------------------
    def _slot(self, parent: RadixNode, namespace: int, first_page) -> tuple:
        """A child's key in parent.children: its first page, led by its namespace at the top."""
        page = tuple(first_page)
        return (namespace, *page) if parent is self.root else page

    def _slot_of(self, node: RadixNode) -> tuple:
        return self._slot(node.parent, node.namespace, node.key[:self.page_size])

    def match(self, tokens: list[int], namespace: int = 0, count_hit: bool = False) -> PrefixMatch:
        """Longest held prefix of `tokens` in whole pages, on the device and below it, among
        the pages inserted under `namespace`. count_hit: a request's match (not the tree's own
        bookkeeping): every node found counts a hit."""
        node, pages, pos, host_nodes, load_ticket = self.root, [], 0, [], None
        if not self.enabled:
            return PrefixMatch(pages, node, host_nodes)
        now = time.monotonic()
        ps = self.page_size
        deepest_device = self.root
        while pos + ps <= len(tokens):
            child = node.children.get(self._slot(node, namespace, tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._matching_pages(child, tokens, pos)
            if n < len(child.key) // ps:
                child = self._split(child, n)
            child.last_access = now
            child.hits += count_hit
            self.version += count_hit
            if child.on_device:
                pages.extend(child.pages)
                deepest_device = child
                if self._loading(child):  # whoever reads these pages waits for the load to land
                    load_ticket = max(load_ticket or 0, child.load_ticket)
            else:
                host_nodes.append(child)
            pos += len(child.key)
            node = child
        return PrefixMatch(pages, deepest_device, host_nodes, continues=self._extends_a_sequence(node),
                           load_ticket=load_ticket)

    def _loading(self, node: RadixNode) -> bool:
        """A load into its device pages is queued and not yet seen landed."""
        if node.load_ticket is not None and node.load_ticket <= self.host.landed:
            node.load_ticket = None
        return node.load_ticket is not None

    def _extends_a_sequence(self, node: RadixNode) -> bool:
        """The match ends where a finished sequence ended, or within its last page (the
        next turn's tokenization may differ there): the tokens continue it."""
        if node is self.root:
            return False
        if node.seq_end:
            return True
        rest = list(node.children.values())
        return len(rest) == 1 and rest[0].seq_end and not rest[0].children and len(rest[0].key) <= self.page_size

    def match_prefix(self, tokens: list[int], namespace: int = 0) -> tuple[list[int], RadixNode]:
        """Longest prefix of `tokens` on the device, in whole pages: (pages, deepest node)."""
        m = self.match(tokens, namespace)
        return m.pages, m.node

    def _matching_pages(self, child: RadixNode, tokens, pos: int) -> int:
        """How many whole pages of child's key equal tokens[pos:]."""
        ps, key, n = self.page_size, child.key, 0
        while (n + 1) * ps <= len(key) and pos + (n + 1) * ps <= len(tokens) and \
                tuple(tokens[pos + n * ps: pos + (n + 1) * ps]) == key[n * ps:(n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Split `node` after n_pages; returns the new upper node."""
        cut = n_pages * self.page_size
        upper = RadixNode(key=node.key[:cut], pages=node.pages[:n_pages], parent=node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access,
                          hashes=node.hashes[:n_pages], host_pages=node.host_pages[:n_pages],
                          namespace=node.namespace, tenant=node.tenant, hits=node.hits,
                          conversation=node.conversation, write_batch=node.write_batch,
                          write_reason=node.write_reason, load_ticket=node.load_ticket)
        if node.write_batch is not None:  # the copy in flight writes both halves
            node.write_batch.nodes.append(upper)
        node.hashes = node.hashes[n_pages:]
        node.parent.children[self._slot_of(upper)] = upper
        node.key, node.pages, node.host_pages = node.key[cut:], node.pages[n_pages:], node.host_pages[n_pages:]
        node.parent = upper
        upper.children[self._slot_of(node)] = node
        return upper

    # -- locking ------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix lock underflow"
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
                self.version += 1
            node = node.parent

    # -- loading back from the host tier -------------------------------------------------
    def load_back(self, match: PrefixMatch, allocate: Callable[[int], list[int] | None]) -> int:
        """Copy the match's host-only nodes back to the device, in path order, as far as
        device pages can be had. The caller has locked match.deepest (so nothing on the path
        is evicted meanwhile). Returns how many host nodes are on the device now; their
        pages are appended to match.pages and match.node moves down."""
        loaded = 0
        for node in match.host_nodes:
            dev = allocate(len(node.host_pages))
            if dev is None:
                break
            ticket = self.host.load(node.host_pages, dev)
            if ticket is not None:
                match.load_ticket = node.load_ticket = ticket
            node.pages = dev
            self._device_pages_changed(node, len(dev))
            self.stats.loaded_pages += len(dev)
            self._event("loaded", node)
            match.pages.extend(dev)
            match.node = node
            loaded += 1
        match.host_nodes = match.host_nodes[loaded:]
        return loaded

    # -- insert -------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], scope: CacheScope = DEFAULT_SCOPE,
               conversation: bool = False, seq_end: bool = False) -> tuple[list[int], RadixNode]:
        """Give the tree ownership of `pages` (KV of tokens[:len(pages)*page_size]), under
        scope's namespace; new nodes count against scope's tenant. conversation: the inserting
        request continued a sequence held here (the write policy keeps its pages); seq_end: a
        finished sequence, whose last node a next turn may extend.

        Returns (pages the caller must free because the tree already held that prefix on
        the device, deepest node). Pages that are already the tree's own (a matched prefix)
        are recognised and not returned. A host-only node on the path takes the caller's
        pages as its device copy."""
        ps = self.page_size
        n_pages = min(len(pages), len(tokens) // ps)
        tokens = tokens[: n_pages * ps]
        pages = pages[:n_pages]
        if not self.enabled:
            return list(pages), self.root
        self.version += 1
        node, pos, duplicates = self.root, 0, []
        now = time.monotonic()
        namespace = scope.cache_key
        while pos < len(tokens):
            child = node.children.get(self._slot(node, namespace, tokens[pos:pos + ps]))
            if child is None:
                new = RadixNode(key=tuple(tokens[pos:]), pages=list(pages[pos // ps:]),
                                parent=node, last_access=now, namespace=namespace, tenant=scope.tenant,
                                conversation=conversation, seq_end=seq_end)
                node.children[self._slot_of(new)] = new
                self._device_pages_changed(new, len(new.pages))
                if self.events is not None:
                    from shared.registry.prefix_hashes import chained_page_hashes
                    new.hashes = chained_page_hashes(tokens, ps, seed=namespace)[pos // ps:]
                    self.events.stored(new.hashes)
                return duplicates, new
            n = self._matching_pages(child, tokens, pos)
            if n < len(child.key) // ps:
                child = self._split(child, n)
            mine = pages[pos // ps: pos // ps + len(child.key) // ps]
            if child.on_device:
                duplicates.extend(m for m, p in zip(mine, child.pages) if m != p)
            else:  # held below the device only: our copy becomes its device copy
                child.pages = list(mine)
                self._device_pages_changed(child, len(mine))
                self._event("loaded", child)
            child.last_access = now
            child.conversation = child.conversation or conversation
            pos += len(child.key)
            node = child
        node.seq_end = node.seq_end or (seq_end and node is not self.root)
        return duplicates, node

    # -- eviction -----------------------------------------------------------------------
    @property
    def num_evictable_pages(self) -> int:
        return self.num_cached_pages - self.num_locked_pages

    def evict(self, num_pages: int, over_share: Callable[[int], bool] | None = None, keep_copies: bool = False) -> int:
        """Free at least num_pages unlocked device pages (LRU device leaves first); returns
        pages freed, never waiting for a copy (module docstring). over_share(tenant): while it
        says a tenant is over its share, that tenant's pages go first (LRU among them).
        keep_copies: never give up a write-back copy in flight (fewer pages freed instead: a
        prefill chunk can wait a step for it to land, a decode row cannot)."""
        if self.writer is not None:  # copies that landed since the step began go at once
            self.writer.poll()
        freed = 0
        if over_share is not None:
            freed = self._evict_leaves(num_pages, lambda node: over_share(node.tenant), keep_copies)
            self.stats.quota_evicted_pages += freed
        if freed < num_pages:
            freed += self._evict_leaves(num_pages - freed, keep_copies=keep_copies)
        return freed

    def _evict_leaves(self, num_pages: int, chosen: Callable[[RadixNode], bool] | None = None,
                      keep_copies: bool = False) -> int:
        """LRU leaves that can go at once first; leaves waiting for their host copy (passed
        over) only when nothing else is left, and with keep_copies not those whose copy is in flight."""
        def evictable(node: RadixNode) -> bool:
            return self._device_evictable(node) and (chosen is None or chosen(node))
        ready = [n for n in self._device_nodes() if evictable(n)]
        heapq.heapify(ready)
        # wanted, copy not landed: when nothing else is left, those whose copy was never queued
        # go first, so the copies in flight (the least recently used, queued for this) are not
        # given up while the write-back catches up (least recently used first within each)
        passed_over: list[tuple[bool, RadixNode]] = []
        freed = 0
        while freed < num_pages and (ready or passed_over):
            forced = not ready
            if forced and keep_copies and passed_over[0][0]:
                break  # what is left all has a copy in flight
            leaf = heapq.heappop(passed_over)[1] if forced else heapq.heappop(ready)
            if not evictable(leaf):  # changed since it was queued
                continue
            parent = leaf.parent
            n = self._evict_from_device(leaf, force=forced)
            if n == 0:
                heapq.heappush(passed_over, (leaf.write_batch is not None, leaf))
                continue
            freed += n
            if evictable(parent):
                heapq.heappush(ready, parent)
        return freed

    def _device_evictable(self, node: RadixNode) -> bool:
        return (node is not self.root and node.on_device and node.lock_ref == 0
                and not any(c.on_device for c in node.children.values()) and not self._loading(node))

    def _evict_from_device(self, node: RadixNode, force: bool = True) -> int:
        """Take an unlocked device leaf off the device: kept in the host tier if its copy has
        landed, else dropped. Returns the pages freed; 0 (not force) when the write policy
        wants it and its copy has not landed yet."""
        n = len(node.pages)
        if self.writer is not None and not node.host_ready:
            wanted = self.writer.wanted(node)
            if wanted is not None and not force:
                return 0
            self.writer.dropped(node, wanted)
        self.allocator.free(node.pages)
        self._device_pages_changed(node, -n)
        node.pages = []
        self.stats.device_evicted_pages += n
        if node.host_pages:
            self.stats.offloaded_pages += n
            self._event("offloaded", node)
        else:
            self._drop(node)
        return n

    def eviction_order(self) -> list[RadixNode]:
        """Unlocked device nodes, least recently used first: roughly the order eviction takes
        them (a node's ancestors are touched whenever it is, so they come after it)."""
        return sorted((x for x in self._device_nodes() if x.lock_ref == 0), key=lambda x: x.last_access)

    def host_room(self, n: int) -> int:
        """Free host pages, after dropping LRU host copies to make room for n (fewer when the
        rest is locked or in flight)."""
        alloc = self.host.allocator
        if alloc.num_free < n:
            self._evict_host(n - alloc.num_free)
        return alloc.num_free

    def _evict_host(self, num_pages: int) -> int:
        freed = 0
        leaves = [x for x in self._all_nodes() if self._host_leaf(x)]
        heapq.heapify(leaves)
        while freed < num_pages and leaves:
            leaf = heapq.heappop(leaves)
            if not self._host_leaf(leaf):
                continue
            parent = leaf.parent
            freed += len(leaf.host_pages)
            self._drop(leaf)
            if self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        if freed < num_pages:  # then landed copies of pages the device still holds
            backups = sorted((x for x in self._device_nodes() if x.host_ready), key=lambda x: x.last_access)
            for node in backups:
                if freed >= num_pages:
                    break
                freed += self._free_host_copy(node)
        return freed

    def _host_leaf(self, node: RadixNode) -> bool:
        return (node is not self.root and not node.on_device and bool(node.host_pages)
                and node.lock_ref == 0 and not node.children)

    def _free_host_copy(self, node: RadixNode) -> int:
        n = len(node.host_pages)
        self.version += 1
        if node.write_batch is not None:  # in flight: its host pages are freed when it lands
            self.writer.discard(node)
        else:
            self.host.allocator.free(node.host_pages)
            node.host_pages = []
            self.num_host_pages -= n
        self.stats.host_evicted_pages += n
        return n

    def _drop(self, node: RadixNode) -> None:
        """Take a node that holds no device pages out of the tree, with its subtree (held
        below the device only, by closure); their lower-tier copies are freed."""
        for child in list(node.children.values()):
            self._drop(child)
        if node.host_pages:
            self._free_host_copy(node)
        self.stats.dropped_pages += len(node.key) // self.page_size
        self._event("removed", node)
        parent = node.parent
        if parent is not None and parent.children.get(self._slot_of(node)) is node:
            del parent.children[self._slot_of(node)]
        node.parent = None

    def _device_pages_changed(self, node: RadixNode, delta: int) -> None:
        """node gained (or lost) delta device pages: the tree's counters follow."""
        self.version += 1
        self.num_cached_pages += delta
        if node.lock_ref > 0:
            self.num_locked_pages += delta
        count = self.device_pages_by_tenant.get(node.tenant, 0) + delta
        if count:
            self.device_pages_by_tenant[node.tenant] = count
        else:
            self.device_pages_by_tenant.pop(node.tenant, None)

    def _event(self, kind: str, node: RadixNode) -> None:
        if self.events is not None and node.hashes:
            getattr(self.events, kind)(node.hashes)

    def _all_nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _device_nodes(self):
        """The nodes on the device (not the root), without walking the host-only subtrees
        under them (a node off the device has every descendant off it): a host tier holds
        several times the device's nodes, and eviction walks these every time it runs."""
        stack = [c for c in self.root.children.values() if c.on_device]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(c for c in n.children.values() if c.on_device)

    def reset(self) -> None:
        """Drop every unlocked cached page from every tier (warm-up, calibration, weight reload,
        tests); waits for the copies in flight. The write policy's account of finished prompts
        starts again too: a start-up's own requests say nothing of the traffic."""
        self.evict(self.num_cached_pages)
        if self.host is not None:
            self._evict_host(self.num_host_pages)
            self.writer.settle()
            self.writer.forget()
