"""One ordered lane of KV page copies between the device pool and the host tier: copies run
in the order they were submitted, and the engine learns that one landed by polling, never by
waiting for it.

Each copy gets a ticket, a sequence number; `landed` is the highest ticket whose copy (and
every earlier one) is done. On a GPU the lane is a CUDA stream of the tier's own: a copy first
waits, on that stream, for the work already launched on the compute stream (the pages' last
writer may still be in flight), and a recorded event tells when it is done. On the CPU the
copies wait in a queue and run when the engine next polls (`pump`): the same order, and the
same rule that nothing may count on a copy before a poll saw it land, so the CPU tests run the
ordering logic the GPU runs. A lane whose copies take as long as a test likes (a worker thread
held back by the test) plugs in with the same three methods: `submit`, `pump`, `landed`."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch


def page_runs(src: Sequence[int], dst: Sequence[int], split: int = 0) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists go up by one; with `split`,
    a run also starts at every multiple of it on either side (a host buffer page-locked in
    chunks of that many pages: one copy never spans two registrations)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d \
                and not (split and (s % split == 0 or d % split == 0)):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_pages_between(src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor,
                       dst_pages: Sequence[int], split: int = 0) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]], one copy per run of consecutive pages (split as
    page_runs says): each pinned host<->device copy pays a fixed cost, so a run of megabytes
    copies at several times the speed of a page's quarter megabyte."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    for s, d, n in page_runs(src_pages, dst_pages, split):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


class CudaCopyLane:
    """Copies on a CUDA stream of their own; the compute stream never waits for them."""

    def __init__(self, device: torch.device, split: int = 0):
        self.device = device
        self.split = split  # pages per page-locked chunk of the host buffer (page_runs)
        self.stream = torch.cuda.Stream(device)
        self._events: deque[tuple[int, torch.cuda.Event]] = deque()
        self._next = 0
        self.landed = 0

    def submit(self, src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor,
               dst_pages: Sequence[int]) -> int:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy_pages_between(src, src_pages, dst, dst_pages, self.split)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._next += 1
        self._events.append((self._next, event))
        return self._next

    def pump(self) -> int:
        """Move `landed` past every copy the device has finished (events complete in order)."""
        while self._events and self._events[0][1].query():
            self.landed = self._events.popleft()[0]
        return self.landed

    def event_of(self, ticket: int):
        """The event of a copy not yet seen landed (None once it has): a tensor-parallel
        follower's compute stream waits for it before the pages are used again."""
        for t, event in self._events:
            if t == ticket:
                return event
        return None

    def wait_all(self) -> None:
        """Block until every copy is done (reset, drain and tests only; never in a step)."""
        self.stream.synchronize()
        self.pump()


class DeferredCopyLane:
    """The CPU's lane: a copy runs at the first poll after it was submitted."""

    def __init__(self):
        self._queue: deque[tuple[int, tuple]] = deque()
        self._next = 0
        self.landed = 0

    def submit(self, src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor,
               dst_pages: Sequence[int]) -> int:
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        self._next += 1
        self._queue.append((self._next, (src, list(src_pages), dst, list(dst_pages))))
        return self._next

    def pump(self) -> int:
        while self._queue:
            ticket, args = self._queue.popleft()
            copy_pages_between(*args)
            self.landed = ticket
        return self.landed

    def event_of(self, ticket: int):
        return None

    def wait_all(self) -> None:
        self.pump()
