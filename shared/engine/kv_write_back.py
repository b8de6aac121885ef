"""Write-back to the host tier, asynchronous and bounded: the pages the policy wants kept
(kv_write_policy.py) are copied to host memory ahead of their eviction, so that when the
device needs them they leave at no cost, and no step ever waits for a copy.

Each engine step (`tick`) first sees which copies landed (kv_host_tier.HostKVTier.poll): their
nodes' host copies become usable, and host pages given up meanwhile are freed. Then (spaced by
WALK_SPACING times the last walk's time, unless the pool ran shorter since), when the device
pool runs short (free pages under `ahead_pages`, a sixteenth of the pool or four steps' worth of
pages, plus what the waiting requests will take), it walks the unlocked device nodes
least recently used first, the order eviction takes them, over the pages the device will give
up next (that many less the free ones), and queues one copy for the nodes among them the policy wants and that have no host
copy yet: host pages are handed out in the order of the device pages, so consecutive device
pages become one run of a copy (a pinned copy moves megabyte pieces at several times the rate
of a page's quarter megabyte). Copies are bounded: at most `bandwidth` bytes a second (a token
bucket; 0: unbounded) and a quarter of a second of that queued at once (`IN_FLIGHT_S`), since
loads share the lane and wait behind them.

Eviction (radix_cache.RadixCache.evict) frees at once what needs no copy (a landed copy, or a
page the policy does not want) and passes over the pages the policy wants whose copy has not
landed; only when nothing else is left does it take them, those never queued first (`not_copied`),
then those whose copy is in flight, which is given up (`copy_in_flight`): the host pages it was
copied into are freed only once that copy lands. A half-written copy is never read: a node's host
copy counts only from the poll that saw it land, and a node leaves the device only with a
landed copy.

`stats` counts pages by decision (written, dropped) and reason; the worker publishes them as
`duet_kv_host_writeback_pages_total` and `..._bytes_total`."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_write_policy import POLICIES, ContinuedShare, FinishedPrompts, drop_reason, keep_reason

# queued write-back at most (a load waits behind it in the lane): IN_FLIGHT_S of the bandwidth
# bound (16 GiB/s: 4 GiB, ~80 ms at the ~50 GB/s a pinned copy moves), at least
# MIN_IN_FLIGHT_BYTES, as much with no bound (UNBOUNDED_IN_FLIGHT_BYTES). Copies are queued once a
# step and land about a step later, so a few steps' evictions are in flight at once: a 256 MiB
# cap let ~110 pages of an 8B model out a step while a prefill step of 8k tokens takes 512.
IN_FLIGHT_S = 0.25
MIN_IN_FLIGHT_BYTES = 256 << 20
UNBOUNDED_IN_FLIGHT_BYTES = 4 << 30
# the walk over the unlocked device nodes runs on the step's thread and grows with the tree (a
# full pool of short requests' nodes: ~1 ms a thousand nodes on a small CPU, every step while
# the pool is short), so after a walk the next waits this many times as long as it took, unless
# the pool runs shorter than that walk looked ahead for: the walks take at most about a tenth
# of the thread's time, and a small tree is still walked every step
WALK_SPACING = 10
BURST_S = 0.25  # the bandwidth bucket holds this many seconds of copies: a long step's, as it refills once a step


@dataclass(frozen=True)
class WriteBackConfig:
    policy: str = "reused"  # kv_write_policy.POLICIES
    bandwidth: int = 0  # bytes a second at most (0: unbounded)
    ahead_pages: int = 0  # write while the device's free pages are under this many


@dataclass(eq=False)
class WriteBatch:
    """One queued copy of several nodes' pages."""

    ticket: int
    nodes: list = field(default_factory=list)  # RadixNodes it writes (a node split meanwhile: both halves)
    num_bytes: int = 0
    orphans: list[int] = field(default_factory=list)  # host pages of nodes that gave their copy up meanwhile


@dataclass
class WriteBackStats:
    """Pages by (decision, reason): written (their copy landed) or dropped (left the device
    without one)."""

    pages: dict[tuple[str, str], int] = field(default_factory=dict)
    copies: int = 0  # copy batches queued

    def count(self, decision: str, reason: str, n: int) -> None:
        if n:
            self.pages[(decision, reason)] = self.pages.get((decision, reason), 0) + n

    def total(self, decision: str) -> int:
        return sum(n for (d, _), n in self.pages.items() if d == decision)


class HostWriter:
    def __init__(self, cache, tier, config: WriteBackConfig, clock: Callable[[], float] = time.monotonic):
        """cache: radix_cache.RadixCache; tier: kv_host_tier.HostKVTier."""
        if config.policy not in POLICIES:
            raise ValueError(f"host tier write policy must be one of {POLICIES}, got {config.policy!r}")
        self.cache = cache
        self.tier = tier
        self.policy = config.policy
        self.bandwidth = config.bandwidth
        self.ahead_pages = config.ahead_pages
        self.clock = clock
        self.in_flight: deque[WriteBatch] = deque()
        self.in_flight_bytes = 0
        self.max_in_flight_bytes = max(MIN_IN_FLIGHT_BYTES, int(config.bandwidth * IN_FLIGHT_S)) \
            if config.bandwidth else UNBOUNDED_IN_FLIGHT_BYTES
        self.orphan_pages = 0  # host pages waiting for a given-up copy to land
        self.stats = WriteBackStats()
        self.prompts = FinishedPrompts(cache.page_size) if config.policy == "reused" else None
        self.continued_share = ContinuedShare()  # of finished requests: is the traffic chats
        self._allowance = 0.0
        self._last = clock()
        self._nothing_at: tuple | None = None  # ((cache version, first turns kept), window) of a walk that found nothing
        self._walked_window, self._next_walk = 0, 0.0  # the last walk's window; the next one not before (WALK_SPACING)
        self._walk_s = 0.0  # how long the last walk over the nodes took

    # -- what eviction asks ---------------------------------------------------------------
    def wanted(self, node) -> str | None:
        return keep_reason(self.policy, node, self.continued_share.keeps_first_turns)

    def dropped(self, node, wanted: str | None) -> None:
        """`node` leaves the device without a copy (`wanted`: the policy's reason to keep it)."""
        self.stats.count("dropped", drop_reason(self.policy, wanted, node.write_batch is not None), len(node.pages))
        if node.write_batch is not None:
            self.discard(node)

    def discard(self, node) -> None:
        """Give up the copy in flight of `node`: its host pages are freed when the copy lands."""
        batch, pages = node.write_batch, node.host_pages
        batch.orphans.extend(pages)
        self.orphan_pages += len(pages)
        self.cache.num_host_pages -= len(pages)
        node.host_pages, node.write_batch = [], None

    def finished(self, prompt: list[int], namespace: int, continued: bool = False) -> None:
        """A request of `prompt` finished (continued: it extended an earlier one): a later prompt
        that extends it is a conversation's turn."""
        if self.prompts is not None and self.prompts.remember(prompt, namespace):
            self.continued_share.count(continued)  # once a prompt: n > 1 sequences, repeats

    def forget(self) -> None:
        """No finished prompt is remembered, and the continued share starts again (a reset cache:
        warm-up's and calibration's requests are not the traffic)."""
        if self.prompts is not None:
            self.prompts = FinishedPrompts(self.cache.page_size)
        self.continued_share = ContinuedShare()

    def continued(self, tokens: list[int], namespace: int) -> bool:
        return self.prompts is not None and self.prompts.continued_by(tokens, namespace)

    # -- each step --------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def tick(self, free_pages: int, waiting_pages: int = 0) -> None:
        """free_pages: the device pool's free pages; waiting_pages: what the queued requests
        will take (their pages displace the next ones eviction takes)."""
        self.poll()
        window = self.ahead_pages + waiting_pages - free_pages
        if self.policy == "off" or window <= 0:
            return
        now = time.perf_counter()
        if now < self._next_walk and window <= self._walked_window:
            return
        self._walk_s = 0.0
        self.write_ahead(window)
        self._walked_window, self._next_walk = window, now + WALK_SPACING * self._walk_s

    def poll(self) -> None:
        """Settle every copy the lane has seen land."""
        landed = self.tier.poll()
        while self.in_flight and self.in_flight[0].ticket <= landed:
            self._landed(self.in_flight.popleft())

    def settle(self) -> None:
        """Wait for every copy (reset, drain and tests only: it blocks)."""
        self.tier.wait_all()
        self.poll()

    def _landed(self, batch: WriteBatch) -> None:
        self.in_flight_bytes -= batch.num_bytes
        for node in batch.nodes:
            if node.write_batch is batch:
                node.write_batch = None
                self.stats.count("written", node.write_reason, len(node.host_pages))
        if batch.orphans:
            self.tier.allocator.free(batch.orphans)
            self.orphan_pages -= len(batch.orphans)

    def _refill(self) -> float:
        """Bytes the bandwidth bound lets out now (inf: unbounded)."""
        if not self.bandwidth:
            return float("inf")
        now = self.clock()
        self._allowance = min(self.bandwidth * BURST_S, self._allowance + (now - self._last) * self.bandwidth)
        self._last = now
        return self._allowance

    def write_ahead(self, window: int) -> None:
        """Queue copies of the wanted nodes among the next `window` pages eviction would take
        (least recently used first), within the bandwidth and in-flight bounds."""
        first_turns = self.continued_share.keeps_first_turns
        if self._nothing_at is not None and self._nothing_at[0] == (self.cache.version, first_turns) \
                and window <= self._nothing_at[1]:
            return  # nothing changed since a walk as wide found nothing to copy
        allowance = self._refill()
        room = self.max_in_flight_bytes - self.in_flight_bytes
        if allowance <= 0 or room <= 0:
            return
        page_bytes = self.tier.bytes_per_page
        budget = min(allowance, room)
        picks, seen, planned = [], 0, 0
        t0 = time.perf_counter()
        for node in self.cache.eviction_order():
            if seen >= window or planned >= budget:
                break
            seen += len(node.pages)
            if node.host_pages:
                continue
            reason = self.wanted(node)
            if reason is not None:
                picks.append((node, reason))
                planned += len(node.pages) * page_bytes
        self._walk_s = time.perf_counter() - t0  # the walk alone: a copy's launch is not its cost
        if picks:
            self._nothing_at = None
            self._launch(picks)
        else:
            self._nothing_at = ((self.cache.version, first_turns), window)

    def _launch(self, picks: list) -> None:
        free = self.cache.host_room(sum(len(n.pages) for n, _ in picks))
        kept, total = [], 0
        for node, reason in picks:
            if total + len(node.pages) > free:
                break
            kept.append((node, reason))
            total += len(node.pages)
        if not kept:
            return
        # host pages in the order of the device pages: consecutive on both sides, one run
        slots = sorted((dev, node, i) for node, _ in kept for i, dev in enumerate(node.pages))
        host = self.tier.allocator.allocate(total)
        for node, _ in kept:
            node.host_pages = [0] * len(node.pages)
        for (dev, node, i), page in zip(slots, host):
            node.host_pages[i] = page
        ticket = self.tier.save([dev for dev, _, _ in slots], host)
        batch = WriteBatch(ticket, [node for node, _ in kept], total * self.tier.bytes_per_page)
        for node, reason in kept:
            node.write_batch, node.write_reason = batch, reason
        self.cache.num_host_pages += total
        self.in_flight.append(batch)
        self.in_flight_bytes += batch.num_bytes
        self.stats.copies += 1
        if self.bandwidth:
            self._allowance -= batch.num_bytes
