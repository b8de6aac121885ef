"""An engine that closes stops its host tier's background page-locking: the thread would keep the
buffer (tens of GiB on a GPU host) alive and go on locking it while the next engine of the
process (`duet bench` runs several in turn) starts. The registration itself is CUDA's
(cudaHostRegister); here it is a stand-in that takes as long as a 1 MiB chunk does, so the
pinner's own loop and its stop run on the CPU."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import torch

from shared.engine.pinned_memory import BackgroundPinner


class SlowRegistration:
    """cudaHostRegister's place: 2 ms a chunk, every call recorded; unregister counted."""

    def __init__(self):
        self.calls, self.unregistered, self.lock = [], 0, threading.Lock()

    def register(self, ptr: int, size: int, flags: int) -> int:
        time.sleep(0.002)
        with self.lock:
            self.calls.append((ptr, size))
        return 0

    def unregister(self, ptr: int) -> int:
        self.unregistered += 1
        return 0


def test_stop_ends_the_locking_between_chunks_and_keeps_what_was_locked():
    fake = SlowRegistration()
    buf = torch.empty(256 << 20, dtype=torch.uint8)  # 256 chunks of 1 MiB: ~1 s of locking
    pinner = BackgroundPinner(buf, torch.device("cpu"), 4096, chunk_bytes=1 << 20,
                              register=(fake.register, fake.unregister))
    deadline = time.monotonic() + 5
    while len(fake.calls) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    pinner.stop()
    assert pinner.wait(2.0), "the pinner thread did not stop"
    calls = len(fake.calls)
    assert 5 <= calls < 256 and pinner.pinned_bytes == calls << 20
    assert pinner.failed.startswith("stopped")
    time.sleep(0.05)
    assert len(fake.calls) == calls  # nothing locked after it stopped
    offsets = [ptr - buf.data_ptr() for ptr, _ in fake.calls]
    assert offsets == [i << 20 for i in range(calls)]  # chunk after chunk, none twice


def test_a_pinner_held_back_by_its_engine_stops_too():
    fake = SlowRegistration()
    pinner = BackgroundPinner(torch.empty(8 << 20, dtype=torch.uint8), torch.device("cpu"), 4096,
                              chunk_bytes=1 << 20, may_pin=lambda: False, register=(fake.register, fake.unregister))
    time.sleep(0.05)  # waiting for its first turn, which never comes
    pinner.stop()
    assert pinner.wait(1.0) and fake.calls == [] and pinner.pinned_bytes == 0


def test_once_stop_returns_the_thread_has_let_go_of_its_engine():
    """The thread holds may_pin (a bound method of its engine) until it ends; Engine.close() stops
    it and `duet bench` collects the engine and empties the CUDA cache right after. Had stop()
    returned with the thread still in a registration, the engine's GPU memory stayed cached in
    that process and the `duet up` worker the bench started next found no room for its KV cache."""

    class Engine:  # the cycle a real one makes: engine -> tier -> pinner -> may_pin -> engine
        def may_pin(self) -> bool:
            return True

    fake = SlowRegistration()
    engine = Engine()
    engine.pinner = BackgroundPinner(torch.empty(256 << 20, dtype=torch.uint8), torch.device("cpu"), 4096,
                                     chunk_bytes=1 << 20, may_pin=engine.may_pin,
                                     register=(fake.register, fake.unregister))
    deadline = time.monotonic() + 5
    while len(fake.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    pinner, gone = engine.pinner, weakref.ref(engine)
    assert pinner.stop() and pinner.done.is_set()
    del engine, pinner
    gc.collect()  # what `duet bench` does after close(), before emptying the CUDA cache
    assert gone() is None, "the pinning thread still held its engine after stop()"
