"""When `duet up` restarts a child that died, and when it gives up.

What process managers do, kept small:
- systemd (Restart=on-failure, StartLimitBurst within StartLimitIntervalSec): a unit that
  fails too often in a window is left failed;
- supervisord (startretries, a backoff that grows each try; startsecs: how long a process must
  run to count as started): a program that keeps dying at start goes FATAL;
- Kubernetes (CrashLoopBackOff): the delay doubles from 10 s up to 5 min and resets once a
  container has run for a while.

Here: a child that dies is started again after a delay that doubles on each death in a row
(backoff, 2x backoff, 4x, ... up to MAX_BACKOFF_S); a child that ran for `reset_after_s`
before dying starts a new row (its earlier deaths are forgiven); after `limit` restarts in a
row, the next death gives up (the caller then stops the stack with a non-zero exit), except for
a worker of a stack that has served while another worker still runs: that one is left down and
tried again every `retry_s` (Kubernetes' crash-loop back-off stops growing at five minutes and
never stops the other pods), so one worker that cannot come back (its GPU's memory still held,
say) is not an outage of the rest. Every death counts the same, whatever its exit code: a
child of `duet up` should never exit on its own."""
from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class RestartPolicy:
    limit: int = 5              # restarts in a row; 0: the first death gives up
    backoff_s: float = 1.0      # delay before the first restart of a row
    reset_after_s: float = 60.0  # a run at least this long forgives the earlier deaths
    retry_s: float = 300.0      # a worker past the limit while others serve: tried again this often

    def delay(self, restarts_in_a_row: int) -> float:
        """Seconds to wait before restart number `restarts_in_a_row` (1-based) of a row."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** (restarts_in_a_row - 1))


@dataclass
class Verdict:
    restart: bool
    delay_s: float = 0.0
    attempt: int = 0        # which restart of the row this is (1-based), or the deaths when giving up


@dataclass
class RestartCounter:
    """One child's deaths in a row, judged by a policy."""

    policy: RestartPolicy
    in_a_row: int = 0

    def died(self, ran_s: float) -> Verdict:
        """The child died after running `ran_s` seconds: restart it (after delay_s) or give up."""
        if ran_s >= self.policy.reset_after_s:
            self.in_a_row = 0
        if self.in_a_row >= self.policy.limit:
            return Verdict(restart=False, attempt=self.in_a_row + 1)
        self.in_a_row += 1
        return Verdict(restart=True, delay_s=self.policy.delay(self.in_a_row), attempt=self.in_a_row)
