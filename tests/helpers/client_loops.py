"""Clients that keep sending requests from threads until stopped, for tests that change the stack
under load: each thread calls `work(k, i)` (thread k, its i-th request) round after round; what
each call returns and every exception it raised are kept, for the test to check."""
from __future__ import annotations

import threading
from collections.abc import Callable


class ClientLoops:
    def __init__(self, work: Callable[[int, int], object], count: int):
        self.work = work
        self.stop = threading.Event()
        self.done: list[object] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                self.done.append(self.work(k, i))
            except BaseException as exc:  # noqa: BLE001 - every failure is the test's finding
                self.errors.append(exc)
            i += 1

    def finish(self, timeout_s: float = 180.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)

    def __enter__(self) -> "ClientLoops":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
