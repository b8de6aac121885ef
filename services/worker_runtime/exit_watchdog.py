"""A bound on how long a stopping worker may take to exit.

The drain itself is bounded step by step (grace for in-flight work, 1 s for the gRPC server,
10 s for the engine thread), but a step can still wait on something that never answers (a
library call, a thread at interpreter exit). Kubernetes would SIGKILL the pod at its
termination grace and leave no word of why; this says which step the drain was in and every
thread's stack, then exits with status 1, so a stuck exit is a line in the log instead of a
silent kill. It watches until the process is gone, interpreter teardown included (a daemon
thread keeps running while Python joins the others)."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("duet.worker")

# after its drain grace a worker still stops its gRPC server (1 s), joins the engine thread
# (up to 10 s), closes its transfer agents and runs its exit handlers (a TP worker waits for its
# ranks); the interpreter's teardown is skipped (shared/process_exit.py)
EXIT_AFTER_GRACE_S = 20.0


@dataclass
class ExitWatchdog:
    bound_s: float
    phase: str = "not started"
    _started: float | None = None

    def start(self, phase: str) -> None:
        """The drain began: from now on the process has bound_s to be gone."""
        self._started = time.monotonic()
        self.enter(phase)
        threading.Thread(target=self._watch, name="exit-watchdog", daemon=True).start()

    def enter(self, phase: str) -> None:
        self.phase = phase
        log.info("stopping: %s", phase)

    def _watch(self) -> None:
        time.sleep(self.bound_s)
        took = time.monotonic() - self._started
        print(f"duet worker: still not exited {took:.0f}s after the drain began (bound {self.bound_s:g}s); "
              f"stuck in: {self.phase}. Every thread's stack follows; exiting with status 1.",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)
