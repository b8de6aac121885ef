"""The host-memory tier under the device KV pool: pages the device gives up are kept here
(pinned host memory on a GPU) and copied back when a request reuses them.

Same page layout as the device pool ([pages, kv_heads, layers, 2, page_size, head_dim],
page-major), so a page is one contiguous byte range on both sides and a run of consecutive
pages is one copy: each pinned host<->device copy pays a fixed cost, so megabyte pieces copy
at several times the speed of a page's quarter megabyte.

On a GPU the copies run on a stream of their own. A save (device -> host, write-back on
eviction) first waits for the work already launched (the pages' last writer may still be
in flight) and the compute stream then waits for the save before anything it launches can
reuse the freed pages. A load (host -> device) also waits for launched work (the fresh
device pages may still be touched by an in-flight step) and hands back an event; the
request's first forward waits for it on the device (model_runner), so other requests'
steps go on meanwhile. On the CPU both are plain copies.

A third tier (local NVMe, a store shared by workers) plugs in the same way: an allocator
of its own page ids plus save/load between it and the device, and the radix tree keeps its
page list per node as it keeps `host_pages` (radix_cache.py)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .kv_pool import KVLayout, PageAllocator
from .pinned_memory import pinned_empty


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_pages_between(src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor,
                       dst_pages: Sequence[int]) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]], one copy per run of consecutive pages."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    for s, d, n in page_runs(src_pages, dst_pages):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


class HostKVTier:
    """Host copies of KV pages for one rank's device pool."""

    def __init__(self, device_buffer: torch.Tensor, layout: KVLayout, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a host KV tier needs at least one page, got {num_pages}")
        self.device_buffer = device_buffer
        self.layout = layout
        self.device = device_buffer.device
        on_gpu = self.device.type == "cuda"
        shape = (num_pages,) + tuple(layout.shape[1:])
        self.buffer = pinned_empty(shape, layout.dtype) if on_gpu else torch.empty(shape, dtype=layout.dtype)
        self.allocator = PageAllocator(num_pages, reserve_first=False)
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.bytes_saved = 0
        self.bytes_loaded = 0
        # tensor parallelism: rank 0 decides, every other rank copies the same pages of its
        # own shard (set by the engine: call_followers on kv_host_tier.follower_copy)
        self.mirror: Callable[[str, list[int], list[int]], None] | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_page

    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Device -> host (write-back of pages leaving the device)."""
        self._copy("save", list(device_pages), list(host_pages))
        self.bytes_saved += len(device_pages) * self.bytes_per_page

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]):
        """Host -> device; returns an event to wait on before reading the pages (None on CPU)."""
        event = self._copy("load", list(host_pages), list(device_pages))
        self.bytes_loaded += len(device_pages) * self.bytes_per_page
        return event

    def _copy(self, kind: str, src_pages: list[int], dst_pages: list[int]):
        if self.mirror is not None:
            self.mirror(kind, src_pages, dst_pages)
        return apply_copy(self, kind, src_pages, dst_pages)


def apply_copy(tier: HostKVTier, kind: str, src_pages: list[int], dst_pages: list[int]):
    """One save or load on this rank, ordered as the module docstring says."""
    src, dst = (tier.device_buffer, tier.buffer) if kind == "save" else (tier.buffer, tier.device_buffer)
    if tier.stream is None:
        copy_pages_between(src, src_pages, dst, dst_pages)
        return None
    compute = torch.cuda.current_stream(tier.device)
    tier.stream.wait_stream(compute)
    with torch.cuda.stream(tier.stream):
        copy_pages_between(src, src_pages, dst, dst_pages)
        event = torch.cuda.Event()
        event.record(tier.stream)
    if kind == "save":  # the freed device pages may be handed out by the next launch
        compute.wait_event(event)
        return None
    return event


def follower_copy(engine, kind: str, src_pages: list[int], dst_pages: list[int]) -> None:
    """A tensor-parallel follower's share of a save or load: the compute stream waits for
    it at once (the follower has no per-request view; its next forward comes after)."""
    event = apply_copy(engine.kv.cache.host, kind, src_pages, dst_pages)
    if event is not None:
        torch.cuda.current_stream(engine.device).wait_event(event)
