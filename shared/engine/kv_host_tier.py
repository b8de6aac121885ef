"""The host-memory tier under the device KV pool: pages the device gives up are kept here
(pinned host memory on a GPU) and copied back when a request reuses them.

Same page layout as the device pool ([pages, kv_heads, layers, 2, page_size, head_dim],
page-major), so a page is one contiguous byte range on both sides and a run of consecutive
pages is one copy.

Every copy goes through one ordered lane (kv_copy_lane.py: a CUDA stream of its own on a GPU,
a queue run at the next poll on the CPU) and is answered with a ticket; `poll()` says which
have landed, and nothing waits for one. A save (device -> host, write-back: which pages and
when is kv_write_back.py's) leaves its device pages with the tree until the copy is seen to
land, so no step ever reuses a page a copy still reads. A load (host -> device) also runs
after the work already launched (the fresh device pages may still be touched by an in-flight
step); the scheduler runs the request only once its ticket has landed, so other requests'
steps go on meanwhile and no step waits for it. On the CPU a load is a plain copy at once (the
pages it writes are fresh and the host pages it reads are a landed copy's, so no queued copy
touches either).

On a GPU the buffer is page-locked in the background (pinned_memory.BackgroundPinner): the
worker registers at once and the tier grows as chunks are locked (`poll` hands their pages to
the allocator; under TP only what every rank has locked), since a copy through pageable
memory would make the step that queued it wait.

Tensor parallelism: rank 0 decides and every other rank copies the same pages of its own
shard (`mirror`, set by the engine). When rank 0 sees copies land it tells the followers
(`landed_hook`), whose compute streams then wait for their own copies before any later
forward can reuse the pages.

A third tier (local NVMe, a store shared by workers) plugs in the same way: an allocator
of its own page ids plus save/load between it and the device, and the radix tree keeps its
page list per node as it keeps `host_pages` (radix_cache.py)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .kv_copy_lane import CudaCopyLane, DeferredCopyLane, copy_pages_between, page_runs
from .kv_pool import KVLayout, PageAllocator
from .pinned_memory import CHUNK_BYTES, BackgroundPinner, aligned_empty

__all__ = ["HostKVTier", "page_runs", "follower_copy", "follower_landed", "follower_pinned"]

PINNED_POLL_S = 0.25  # under TP, how often rank 0 asks the followers how far they have locked


class HostKVTier:
    """Host copies of KV pages for one rank's device pool."""

    def __init__(self, device_buffer: torch.Tensor, layout: KVLayout, num_pages: int, lane=None,
                 pin_chunk_bytes: int = CHUNK_BYTES, may_pin=None):
        if num_pages < 1:
            raise ValueError(f"a host KV tier needs at least one page, got {num_pages}")
        self.device_buffer = device_buffer
        self.layout = layout
        self.device = device_buffer.device
        on_gpu = self.device.type == "cuda"
        shape = (num_pages,) + tuple(layout.shape[1:])
        self.buffer = aligned_empty(shape, layout.dtype) if on_gpu else torch.empty(shape, dtype=layout.dtype)
        self.allocator = PageAllocator(num_pages, reserve_first=False)
        self.num_pages = num_pages
        self.pinner = None
        chunk_pages = 0
        if on_gpu:  # pages join the allocator as they are locked (poll)
            self.pinner = BackgroundPinner(self.buffer, self.device, layout.bytes_per_page, pin_chunk_bytes,
                                           may_pin=may_pin)
            chunk_pages = self.pinner.chunk_bytes // layout.bytes_per_page
            self.allocator.allocate(num_pages)
        self.usable_pages = 0 if on_gpu else num_pages  # the first pages, locked on every rank
        self.lane = lane if lane is not None else (CudaCopyLane(self.device, chunk_pages) if on_gpu
                                                   else DeferredCopyLane())
        self.loads_on_lane = on_gpu  # CPU loads are plain copies at once (module docstring)
        self.bytes_saved = 0
        self.bytes_loaded = 0
        # tensor parallelism: rank 0 decides, every other rank copies the same pages of its
        # own shard (set by the engine: call_followers on follower_copy / follower_landed)
        self.mirror: Callable[[str, list[int], list[int], int], None] | None = None
        self.landed_hook: Callable[[int, int], None] | None = None
        self.followers_pinned: Callable[[], list[int]] | None = None  # TP: bytes each follower has locked
        self._asked = 0.0
        self._told = 0  # tickets the followers were told have landed
        self._follower_tickets: dict[int, int] = {}  # on a follower: rank 0's ticket -> this lane's

    @property
    def capacity(self) -> int:
        """Pages in use by the tier: all of them once the buffer is locked, fewer before."""
        return self.usable_pages

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_page

    @property
    def landed(self) -> int:
        """The highest ticket whose copy, and every earlier one, is known to be done."""
        return self.lane.landed

    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Device -> host, queued; returns its ticket."""
        src, dst = list(device_pages), list(host_pages)
        ticket = self.lane.submit(self.device_buffer, src, self.buffer, dst)
        if self.mirror is not None:
            self.mirror("save", src, dst, ticket)
        self.bytes_saved += len(src) * self.bytes_per_page
        return ticket

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> int | None:
        """Host -> device; returns the ticket to see land before the pages are read (None:
        done already)."""
        src, dst = list(host_pages), list(device_pages)
        ticket = None
        if self.loads_on_lane:
            ticket = self.lane.submit(self.buffer, src, self.device_buffer, dst)
        else:
            copy_pages_between(self.buffer, src, self.device_buffer, dst)
        if self.mirror is not None:
            self.mirror("load", src, dst, ticket or 0)
        self.bytes_loaded += len(dst) * self.bytes_per_page
        return ticket

    def poll(self) -> int:
        """Which copies have landed (`landed`); the followers hear of new ones first. The
        tier grows by what got page-locked since."""
        if self.usable_pages < self.num_pages and self.pinner is not None:
            self._grow()
        landed = self.lane.pump()
        if landed > self._told:
            if self.landed_hook is not None:
                self.landed_hook(self._told, landed)
            self._told = landed
        return landed

    def wait_all(self) -> None:
        """Every queued copy done and seen (reset, drain and tests; never inside a step)."""
        self.lane.wait_all()
        self.poll()

    def _grow(self) -> None:
        pinned = self.pinner.pinned_bytes
        if self.followers_pinned is not None:
            now = time.monotonic()
            if now - self._asked < PINNED_POLL_S:
                return
            self._asked = now
            pinned = min([pinned, *self.followers_pinned()])
        ready = min(self.num_pages, pinned // self.bytes_per_page)
        if ready > self.usable_pages:
            self.allocator.free(range(self.usable_pages, ready))
            self.usable_pages = ready
        if self.pinner.done.is_set() and self.usable_pages < self.num_pages and self.followers_pinned is None:
            self.num_pages = self.usable_pages  # locking stopped short: the rest is never used

    def close(self) -> None:
        """Stop the background page-locking (the engine closed)."""
        if self.pinner is not None:
            self.pinner.stop()


def follower_copy(engine, kind: str, src_pages: list[int], dst_pages: list[int], ticket: int) -> None:
    """A tensor-parallel follower's share of a save or load, on its own lane."""
    tier = engine.kv.cache.host
    if kind == "save":
        tier._follower_tickets[ticket] = tier.lane.submit(tier.device_buffer, src_pages, tier.buffer, dst_pages)
    elif tier.loads_on_lane:
        tier._follower_tickets[ticket] = tier.lane.submit(tier.buffer, src_pages, tier.device_buffer, dst_pages)
    else:
        copy_pages_between(tier.buffer, src_pages, tier.device_buffer, dst_pages)


def follower_pinned(engine) -> int:
    """Bytes of this rank's host buffer page-locked so far."""
    pinner = engine.kv.cache.host.pinner
    return pinner.pinned_bytes if pinner is not None else engine.kv.cache.host.buffer.nbytes


def follower_landed(engine, after: int, upto: int) -> None:
    """Rank 0 saw tickets (after, upto] land: this rank's copies of them run before any later
    forward here (a device-side wait, normally long met; on the CPU the queued copies run now)."""
    tier = engine.kv.cache.host
    tier.lane.pump()
    compute = torch.cuda.current_stream(engine.device) if engine.device.type == "cuda" else None
    for ticket in range(after + 1, upto + 1):
        own = tier._follower_tickets.pop(ticket, None)
        if own is None or compute is None:
            continue
        event = tier.lane.event_of(own)
        if event is not None:
            compute.wait_event(event)
