"""Which batches a timed `engine.step()` call paid for, and how long they took.

Without overlap scheduling (and on CPU, where a forward runs before it returns) a step call
computes the batch it schedules: its duration is that batch's time.

With overlap on a GPU a call launches a batch and returns without waiting for it; the host
learns that the device finished a batch only where it waits for one (the overlap scheduler's
settle points: a sampled batch's tokens read back, shared/engine/overlap.py). So the timer
measures windows between settle points: the batches launched since the last one, summed as
one sample (the step model is linear, so a window of several batches fits as their sum), timed
from the last settle point, or from the window's first launch when the loop was idle before
it. In steady decoding every call settles the previous call's batch, and a window is one
batch; a chunk mid-prompt samples nothing, so its call settles nothing and its time lands in
the next window rather than on a neighbour's batch. Windows with speculative steps (drafts
verified) are not sampled: their cost is a different model."""
from __future__ import annotations

from dataclasses import dataclass

from shared.perf_model.step_model import StepShape


@dataclass
class _Launched:
    batch_no: int
    shape: StepShape | None  # None: a speculative step
    launched_at: float


class StepSampler:
    def __init__(self, scheduler, lagged: bool, overlap=None):
        """lagged: time by the overlap scheduler's settle points (`overlap`, required then)."""
        if lagged and overlap is None:
            raise ValueError("a lagged step timer needs the overlap scheduler's settle points")
        self.scheduler = scheduler
        self.lagged = lagged
        self.overlap = overlap
        self._seen = scheduler.num_batches
        self._open: list[_Launched] = []  # lagged: launched, not yet seen settled
        self._settled = overlap.settled_batch if overlap is not None else 0
        self._settled_at: float | None = None

    def _new_batch(self):
        s = self.scheduler
        batch = s.last_batch if s.num_batches != self._seen else None
        self._seen = s.num_batches
        return batch

    def sample(self, t0: float, t1: float) -> tuple[StepShape, float] | None:
        """(the timed batches' shape, seconds), or None when this call closed no window."""
        batch = self._new_batch()
        shape = None
        if batch is not None and not any(it.draft for it in batch.items):
            shape = StepShape.of_batch(batch.items)
        if not self.lagged:
            return (shape, t1 - t0) if shape is not None else None
        if batch is not None:
            self._open.append(_Launched(self.scheduler.num_batches, shape, t0))
        settled, at = self.overlap.settled_batch, self.overlap.settled_at
        if settled <= self._settled:
            return None
        done = [x for x in self._open if x.batch_no <= settled]
        self._open = [x for x in self._open if x.batch_no > settled]
        started = done[0].launched_at if done else at
        if self._settled_at is not None:
            started = max(started, self._settled_at)  # the device was busy with the last window until then
        self._settled, self._settled_at = settled, at
        if not done or any(x.shape is None for x in done):
            return None
        total = done[0].shape
        for x in done[1:]:
            total = total + x.shape
        return total, at - started
