"""Stopping the stack within one drain grace (DUET_DRAIN_GRACE, shared/settings/drain.py).

The gateway and every worker get SIGTERM together and drain in parallel: the gateway stops
accepting and lets open streams run for the whole grace; a worker leaves the registry,
finishes in-flight work for a shorter grace, then ends what is left. Ending it fails those
streams at the gateway, which sends each an error event; so by the end of the grace every
stream has ended with [DONE] or an error event, and none is cut by uvicorn's own timeout.
The planner stops with them (no role switch during a drain). The router stops once the
gateway is gone (only the gateway asks it anything), Redis once the workers, planner and
router are (workers deregister through it). What still runs KILL_AFTER_S
after the grace is killed, and said so."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.launcher.children import Child

# a worker ends its leftovers this long before the gateway would cut them (at most half the
# grace): its gRPC server takes up to 1 s to cancel them, the gateway then writes an error
# event to each stream
WORKER_HEAD_START_S = 3.0
# after its drain a process still has to exit: its exit handlers (a TP worker waits for its
# ranks), and the interpreter's teardown when a command does not skip it (shared/process_exit.py)
KILL_AFTER_S = 10.0


@dataclass(frozen=True)
class DrainPlan:
    grace_s: float

    @property
    def gateway_grace_s(self) -> float:
        return self.grace_s

    @property
    def worker_grace_s(self) -> float:
        return self.grace_s - min(WORKER_HEAD_START_S, self.grace_s / 2)

    @property
    def kill_after_s(self) -> float:
        return self.grace_s + KILL_AFTER_S


def stop_children(children: Sequence[Child], plan: DrainPlan, say: Callable[[str], None],
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """SIGTERM in dependency order (each group as soon as what needs it has exited), then
    SIGKILL what is still running at the deadline (a router or Redis still waiting for a stuck
    worker goes with it, unannounced: they hold nothing to lose)."""
    def of(*kinds: str) -> list[Child]:
        return [c for c in children if c.kind in kinds]

    stages = [(of("planner", "gateway", "worker"), []), (of("router"), of("gateway")),
              (of("redis"), of("planner", "gateway", "worker", "router"))]
    signalled: list[Child] = []
    deadline = clock() + plan.kill_after_s
    while any(c.running for c in children) and clock() < deadline:
        for group, after in stages:
            if group and group[0] not in signalled and not any(c.running for c in after):
                signalled += group
                for child in group:
                    child.terminate()
        sleep(0.05)
    for child in children:
        if child.running:
            if child in signalled:
                say(f"{child.name} still running {plan.kill_after_s:g}s after SIGTERM; killing it")
            child.kill()
