"""`duet up`'s supervision loop: notices a child that died, starts it again when the restart
policy says (restart_policy.py), says so in its output, and names the child it gave up on.

The caller calls tick() every fraction of a second while the stack runs, and stops calling it
once it is stopping the stack (nothing is restarted during a drain); it sets `serving` once the
stack first answered, after which a worker past the restart limit is left down and tried again
every `policy.retry_s` while another worker runs (restart_policy.py), instead of given up on."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.launcher.children import Child, describe_exit
from services.launcher.restart_policy import RestartCounter, RestartPolicy

RESTART_TAIL_LINES = 5   # of the child's log, with each restart; more when giving up
GIVE_UP_TAIL_LINES = 20


@dataclass
class Supervisor:
    children: Sequence[Child]
    policy: RestartPolicy
    say: Callable[[str], None]  # one message for the operator (duet up's stderr)
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    serving: bool = False  # the stack has answered: a worker that keeps dying no longer stops it
    _counters: dict[str, RestartCounter] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)  # child name -> when to start it again

    def tick(self) -> Child | None:
        """Restart what is due, judge what died since the last tick; the child given up on, if any."""
        now = self.clock()
        for child in self.children:
            if child.name in self._due:
                if now >= self._due[child.name]:
                    del self._due[child.name]
                    if not self._restart(child):
                        return child
                continue
            code = child.exit_code
            if code is None:
                continue
            counter = self._counters.setdefault(child.name, RestartCounter(self.policy))
            ran_s = now - child.started_at
            verdict = counter.died(ran_s)
            if not verdict.restart and self._others_serve(child):
                self._due[child.name] = now + self.policy.retry_s
                self.say(f"{child.name} exited with {describe_exit(code)} after {ran_s:.1f}s; leaving it down: "
                         f"{self._why(verdict.attempt)}; the other workers serve; trying it again in "
                         f"{self.policy.retry_s:.0f}s (--restart-retry). Last lines of {child.log_path}:\n"
                         f"{child.tail(GIVE_UP_TAIL_LINES)}")
                continue
            if not verdict.restart:
                self.say(f"{child.name} exited with {describe_exit(code)} after {ran_s:.1f}s; giving up on it: "
                         f"{self._why(verdict.attempt)}. Last lines of {child.log_path}:\n"
                         f"{child.tail(GIVE_UP_TAIL_LINES)}")
                return child
            self._due[child.name] = now + verdict.delay_s
            self.say(f"{child.name} exited with {describe_exit(code)} after {ran_s:.1f}s; restarting it in "
                     f"{verdict.delay_s:.1f}s (restart {verdict.attempt} of at most {self.policy.limit} in a row). "
                     f"Last lines of {child.log_path}:\n{child.tail(RESTART_TAIL_LINES)}")
        return None

    def _restart(self, child: Child) -> bool:
        try:
            child.start()
        except OSError as exc:  # e.g. the executable is gone: no later try can do better
            self.say(f"could not start {child.name} again: {exc}; giving up on it")
            return False
        self.restarts += 1
        self.say(f"restarted {child.name} (pid {child.pid})")
        return True

    def _others_serve(self, child: Child) -> bool:
        """A worker of a stack that has served, with another worker still running (restarts on:
        --restart-limit 0 means never)."""
        return self.serving and self.policy.limit > 0 and child.kind == "worker" and any(
            c is not child and c.kind == "worker" and c.running for c in self.children)

    def _why(self, deaths: int) -> str:
        if self.policy.limit == 0:
            return "restarts are off (--restart-limit 0)"
        return (f"it died {deaths} times in a row, each within {self.policy.reset_after_s:.0f}s of its start "
                f"(--restart-limit {self.policy.limit})")
