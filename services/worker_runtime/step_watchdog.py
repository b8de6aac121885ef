"""A bound on one engine-loop iteration while the worker serves (SGLang's watchdog, ours).

A step that never returns (a GPU call or a collective waiting on a dead tensor-parallel rank, a
deadlock) leaves the worker looking alive: its asyncio thread keeps heartbeating the registry
and answering gRPC pings, so neither the registry's TTL nor the gateway's keepalive sees it,
while every stream on it waits forever. Past `--step-timeout` in one iteration (the step and
what follows it: delivery, the roles' ticks, the load gauges) this says so, writes every
thread's stack to stderr and ends the process with status 1: its connections reset, the
gateways move its streams on, and its supervisor (`duet up`, the pod's restart policy) starts
it again. The exit watchdog (exit_watchdog.py) bounds a stopping worker the same way."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("duet.worker")


@dataclass
class StepWatchdog:
    loop: object  # EngineLoop: its `iteration_began` (perf_counter) while an iteration runs, else None
    bound_s: float  # 0: no watchdog
    exit: Callable[[int], None] = os._exit
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        if self.bound_s > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        every = min(1.0, self.bound_s / 4)
        while not self._stop.wait(every):
            began = self.loop.iteration_began
            took = time.perf_counter() - began if began is not None else 0.0
            if took > self.bound_s:
                log.error("engine step has run for %.0fs (--step-timeout %gs): exiting for a restart", took,
                          self.bound_s)
                print(f"duet worker: one engine-loop iteration has run for {took:.0f}s (bound {self.bound_s:g}s, "
                      "--step-timeout). Every thread's stack follows; exiting with status 1.",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                self.exit(1)
                return
