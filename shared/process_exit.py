"""Ending a service process without the interpreter's teardown.

Once a worker, router, gateway, planner or `duet up` has drained and returned its exit status,
nothing is left that the OS does not take back (sockets, memory, file descriptors, child
processes already stopped), yet Python's finalization still tears down every module: torch,
transformers, gRPC and NIXL hold large object graphs, and on a busy 2-core machine a worker
spent 1.5 to 8 s of CPU there after its drain, while `duet up` and a test waited for it.

`FastExit.install()` registers an exit handler first, so it runs last: after Python joined the
non-daemon threads (a stuck one is still the exit watchdog's business,
services/worker_runtime/exit_watchdog.py) and after every other exit handler (weakref
finalizers, a TP worker's ranks told to stop, telemetry flushes). Then it shuts logging down,
flushes stdout and stderr, and ends the process with the status the command returned. An
exception that escaped the command leaves `code` unset: the ordinary teardown runs, and the
traceback is printed as always."""
from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass


@dataclass
class FastExit:
    code: int | None = None  # the command's exit status; None: the interpreter's ordinary exit

    @classmethod
    def install(cls) -> "FastExit":
        """Call before the command imports anything heavy: handlers registered earlier run
        after this one (atexit runs last-in first-out), and logging's is the one expected."""
        fast = cls()
        atexit.register(fast._exit)
        return fast

    def _exit(self) -> None:
        if self.code is None:
            return
        logging.shutdown()  # registered before us (the command's first import): flush its handlers now
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # closed, or its reader is gone
                pass
        os._exit(self.code)
