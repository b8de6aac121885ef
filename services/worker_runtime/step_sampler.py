"""Which batch a timed `engine.step()` call paid for, and how long it took.

Without overlap scheduling (and on CPU, where a forward runs before it returns) a step call
computes the batch it schedules: its duration is that batch's time. With overlap on a GPU a
call launches batch N+1 and then waits for batch N: the time from one call's end to the next
call's end is batch N's time (while the device is the bottleneck, which is when it matters),
so a batch is timed one call later. Speculative steps (drafts verified) are not sampled: their
cost is a different model."""
from __future__ import annotations

from shared.perf_model.step_model import StepShape


class StepSampler:
    def __init__(self, scheduler, lagged: bool):
        self.scheduler = scheduler
        self.lagged = lagged
        self._seen = scheduler.num_batches
        self._pending = None     # lagged: the batch launched by the previous call
        self._last_end: float | None = None

    def _new_batch(self):
        s = self.scheduler
        batch = s.last_batch if s.num_batches != self._seen else None
        self._seen = s.num_batches
        return batch

    def sample(self, t0: float, t1: float) -> tuple[StepShape, float] | None:
        """(the timed batch's shape, seconds), or None when this call timed no whole batch."""
        batch = self._new_batch()
        if self.lagged:
            timed, seconds = self._pending, (t1 - self._last_end if self._last_end is not None else 0.0)
            self._pending, self._last_end = batch, t1
        else:
            timed, seconds = batch, t1 - t0
        if timed is None or any(it.draft for it in timed.items):
            return None
        return StepShape.of_batch(timed.items), seconds
