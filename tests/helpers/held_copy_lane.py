"""A host-tier copy lane (shared/engine/kv_copy_lane.py) as slow as a test wants: its copies
run on a worker thread, in order, one page at a time, and each page only once the test lets
one more through (`release(n)`, or `open()` for all from then on). So a test can hold a
write-back copy in flight, or half done, for as many engine steps as it likes, and see what
the engine does meanwhile. Real copies of real tensors; only their pace is the test's."""
from __future__ import annotations

import queue
import threading
import time

from shared.engine.kv_copy_lane import copy_pages_between


class HeldCopyLane:
    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._gate = threading.Semaphore(0)
        self._open = threading.Event()
        self._next = 0
        self.landed = 0  # written by the worker thread (an int store: atomic)
        self.pages_copied = 0
        self.submitted_pages = 0
        threading.Thread(target=self._run, name="held-copy-lane", daemon=True).start()

    # -- the lane's interface -----------------------------------------------------------------
    def submit(self, src, src_pages, dst, dst_pages) -> int:
        self._next += 1
        self.submitted_pages += len(src_pages)
        self._jobs.put((self._next, src, list(src_pages), dst, list(dst_pages)))
        return self._next

    def pump(self) -> int:
        return self.landed

    def event_of(self, ticket: int):
        return None

    def wait_all(self) -> None:
        self.open()
        self.wait_until(lambda: self.landed == self._next)

    # -- the test's handles -------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self.landed < self._next

    def release(self, pages: int = 1) -> None:
        """Let `pages` more page copies through."""
        self._gate.release(pages)

    def open(self) -> None:
        """Let every copy through from now on."""
        self._open.set()
        self._gate.release(1 << 20)

    @staticmethod
    def wait_until(cond, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("the held copy lane did not get there")
            time.sleep(0.001)

    def _run(self) -> None:
        while True:
            ticket, src, src_pages, dst, dst_pages = self._jobs.get()
            for s, d in zip(src_pages, dst_pages):
                if not self._open.is_set():
                    self._gate.acquire()
                copy_pages_between(src, [s], dst, [d])
                self.pages_copied += 1
            self.landed = ticket
