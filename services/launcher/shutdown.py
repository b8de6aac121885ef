"""Stopping the stack within one drain grace (DUET_DRAIN_GRACE, shared/settings/drain.py).

The gateway and every worker get SIGTERM together and drain in parallel: the gateway stops
accepting and lets open streams run for the whole grace; a worker leaves the registry,
finishes in-flight work for a shorter grace, then ends what is left. Ending it fails those
streams at the gateway, which sends each an error event; so by the end of the grace every
stream has ended with [DONE] or an error event, and none is cut by uvicorn's own timeout.
The router and Redis go last (workers deregister through Redis while they drain). What still
runs KILL_AFTER_S after its grace is killed, and said so."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.launcher.children import Child

# a worker ends its leftovers this long before the gateway would cut them (at most half the
# grace): the worker's gRPC server takes up to 1 s to cancel them, the gateway then writes
# an error event to each stream
WORKER_HEAD_START_S = 3.0
KILL_AFTER_S = 5.0  # the slack for a process to exit once its drain is over
BACK_GRACE_S = 3.0  # router and Redis hold no request: they only need to exit


@dataclass(frozen=True)
class DrainPlan:
    grace_s: float

    @property
    def gateway_grace_s(self) -> float:
        return self.grace_s

    @property
    def worker_grace_s(self) -> float:
        return self.grace_s - min(WORKER_HEAD_START_S, self.grace_s / 2)


def stop_children(children: Sequence[Child], plan: DrainPlan, say: Callable[[str], None]) -> None:
    for kinds, allowed_s in ((("gateway", "worker"), plan.grace_s + KILL_AFTER_S), (("router",), BACK_GRACE_S),
                             (("redis",), BACK_GRACE_S)):
        _stop_group([c for c in children if c.kind in kinds], allowed_s, say)


def _stop_group(group: Sequence[Child], allowed_s: float, say: Callable[[str], None]) -> None:
    for child in group:
        child.terminate()
    deadline = time.monotonic() + allowed_s
    for child in group:
        while child.running and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.running:
            say(f"{child.name} still running {allowed_s:.0f}s after SIGTERM; killing it")
            child.kill()
