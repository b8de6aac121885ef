"""Radix tree over whole KV pages, keyed by token ids, so requests that share a prompt
prefix reuse its pages (SGLang's RadixAttention idea at page granularity).

Each node holds a run of tokens whose length is a multiple of the page size, and the pages
holding their KV. Nodes on a live request's path are locked (lock_ref > 0); unlocked
leaves are evicted least-recently-used first when the allocator runs dry."""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from .kv_pool import PageAllocator


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    hashes: list[int] = field(default_factory=list)  # chained page hashes, when published

    def __lt__(self, other: "RadixNode") -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True, events=None):
        """events: optional object with stored(hashes) / removed(hashes) (KV events that
        tell routers which prompt pages this worker holds)."""
        self.events = events
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self.num_cached_pages = 0  # pages owned by the tree
        self.num_locked_pages = 0  # tree pages on some live request's path

    # -- lookup -------------------------------------------------------------------------
    def _child_key(self, tokens, pos) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.page_size])

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], RadixNode]:
        """Longest cached prefix of `tokens`, in whole pages: (pages, deepest node)."""
        node, pages, pos = self.root, [], 0
        if not self.enabled:
            return pages, node
        now = time.monotonic()
        ps = self.page_size
        while pos + ps <= len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            # how many whole pages of child's key match
            n = 0
            key = child.key
            while n < len(child.pages) and pos + (n + 1) * ps <= len(tokens) and \
                    tuple(tokens[pos + n * ps: pos + (n + 1) * ps]) == key[n * ps:(n + 1) * ps]:
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return pages, node

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Split `node` after n_pages; returns the new upper node."""
        cut = n_pages * self.page_size
        upper = RadixNode(key=node.key[:cut], pages=node.pages[:n_pages], parent=node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access,
                          hashes=node.hashes[:n_pages])
        node.hashes = node.hashes[n_pages:]
        node.parent.children[upper.key[:self.page_size]] = upper
        node.key, node.pages = node.key[cut:], node.pages[n_pages:]
        node.parent = upper
        upper.children[node.key[:self.page_size]] = node
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
            node = node.parent

    # -- insert -------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[int], RadixNode]:
        """Give the tree ownership of `pages` (KV of tokens[:len(pages)*page_size]).

        Returns (pages the caller must free because the tree already held that prefix,
        deepest node). Pages that are already the tree's own (a matched prefix) are
        recognised and not returned."""
        ps = self.page_size
        n_pages = min(len(pages), len(tokens) // ps)
        tokens = tokens[: n_pages * ps]
        pages = pages[:n_pages]
        if not self.enabled:
            return list(pages), self.root
        node, pos, duplicates = self.root, 0, []
        now = time.monotonic()
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                new = RadixNode(key=tuple(tokens[pos:]), pages=list(pages[pos // ps:]),
                                parent=node, last_access=now)
                node.children[new.key[:ps]] = new
                self.num_cached_pages += len(new.pages)
                if self.events is not None:
                    from shared.registry.prefix_hashes import chained_page_hashes
                    new.hashes = chained_page_hashes(tokens, ps)[pos // ps:]
                    self.events.stored(new.hashes)
                return duplicates, new
            n = 0
            while n < len(child.pages) and pos + (n + 1) * ps <= len(tokens) and \
                    tuple(tokens[pos + n * ps: pos + (n + 1) * ps]) == child.key[n * ps:(n + 1) * ps]:
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            for i, p in enumerate(child.pages):
                mine = pages[pos // ps + i]
                if mine != p:
                    duplicates.append(mine)
            child.last_access = now
            pos += len(child.key)
            node = child
        return duplicates, node

    # -- eviction -----------------------------------------------------------------------
    @property
    def num_evictable_pages(self) -> int:
        return self.num_cached_pages - self.num_locked_pages

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages unlocked pages (LRU leaves first); returns pages freed."""
        leaves = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.pages)
            if self.events is not None and leaf.hashes:
                self.events.removed(leaf.hashes)
            freed += len(leaf.pages)
            self.num_cached_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _all_nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def reset(self) -> None:
        """Drop every unlocked cached page (used by tests and on weight reload)."""
        self.evict(self.num_cached_pages)
