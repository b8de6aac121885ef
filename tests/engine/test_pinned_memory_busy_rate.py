"""Under load that never pauses (the engine's gate, Engine._may_pin, stays shut), the host tier's
page-locking still grows, by a chunk whenever that keeps its registrations at BUSY_SHARE of the
time (shared/engine/pinned_memory.py): a registration that takes longer waits longer for the
next. The registration is a stand-in of a set duration; the pinner's loop is the real one."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from shared.engine.pinned_memory import BUSY_SHARE, BackgroundPinner, aligned_empty, busy_hold_s


class TimedRegistration:
    def __init__(self, seconds: float):
        self.seconds, self.began = seconds, []
        self.lock = threading.Lock()

    def register(self, ptr: int, size: int, flags: int) -> int:
        with self.lock:
            self.began.append(time.monotonic())
        time.sleep(self.seconds)
        return 0

    def unregister(self, ptr: int) -> int:
        return 0


def test_the_hold_is_the_registration_over_its_share():
    assert busy_hold_s(0.015) == pytest.approx(0.5)
    assert busy_hold_s(0.005) == pytest.approx(0.005 / BUSY_SHARE)
    assert busy_hold_s(0.005) < busy_hold_s(0.015)


@pytest.mark.parametrize("registration_s", [0.004, 0.012])
def test_a_gate_that_stays_shut_gets_a_chunk_per_hold(registration_s):
    fake = TimedRegistration(registration_s)
    busy = threading.Event()  # open for the first chunk (an idle moment after start-up), then never
    pinner = BackgroundPinner(aligned_empty((64 << 20,), torch.uint8), torch.device("cpu"), 4096,
                              chunk_bytes=1 << 20, may_pin=lambda: not busy.is_set(),
                              register=(fake.register, fake.unregister))
    try:
        deadline = time.monotonic() + 10
        while not fake.began and time.monotonic() < deadline:
            time.sleep(0.001)
        busy.set()
        while len(fake.began) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pinner.stop()
    assert len(fake.began) >= 4, "the locking stopped growing under load"
    gaps = [b - a for a, b in zip(fake.began[1:], fake.began[2:])]  # between chunks taken while shut
    hold = busy_hold_s(registration_s)
    # never sooner than the hold (the registration's own time, slept here, can only add to it)
    assert min(gaps) >= hold, (gaps, hold)
    assert max(gaps) < hold + 1.0, (gaps, hold)
