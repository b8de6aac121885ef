"""Rank 0 closing its followers (shared/engine/parallel/launcher.py TPWorkers.shutdown): a
follower that does not stop when told (on a GPU: a kernel spinning on a flag no rank will
set) is killed, and closing returns instead of raising, so a worker that is stopping still
exits. Real processes and pipes; the stuck one ignores SIGTERM and never reads its pipe."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from multiprocessing import Pipe

from shared.engine.parallel.launcher import TPWorkers

STUCK = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
OBEDIENT = "import sys; sys.stdin.read()"  # exits when rank 0's end of its stdin closes


def test_a_follower_that_ignores_stop_is_killed_and_close_returns(caplog):
    stuck = subprocess.Popen([sys.executable, "-c", STUCK])
    obedient = subprocess.Popen([sys.executable, "-c", OBEDIENT], stdin=subprocess.PIPE)
    obedient.stdin.close()
    pipes = [Pipe(), Pipe()]
    workers = TPWorkers([stuck, obedient], [a for a, _ in pipes])
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="duet.engine.tp"):
        workers.shutdown(timeout=2.0)
    took = time.monotonic() - t0
    assert stuck.poll() is not None and obedient.poll() == 0
    assert took < 10, took  # bounded by the timeout, not by the stuck process
    assert "TP rank 1 did not stop" in caplog.text
    for _, b in pipes:  # the follower's end sees STOP, then end of file
        assert b.recv_bytes()
    workers.shutdown()  # a second close is a no-op
