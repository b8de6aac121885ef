"""When speculation steps aside.

A verify step computes K + 1 positions a sequence where a plain step computes one. At
batch 1 the step is memory-bound (weights read once either way) and the extra positions
are nearly free; as the batch grows the step turns compute-bound and the extra positions
cost their share, while each sequence still gains only its accepted tokens. So:
- above `max_batch` decoding sequences the engine decodes plainly (the default stays inside the
  batches where a verify step still paid, docs/performance/speculative.md);
- a request whose recent drafts are mostly rejected (exponential average of accepted per
  drafted token below `min_acceptance`) sits out `cooldown` steps, then tries again;
- when whole steps find no draft at all (free writing under n-gram lookup), speculation
  pauses so the overlapped plain loop runs; it looks again after `cooldown` steps."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH = 32  # inside the crossover: docs/performance/speculative.md


@dataclass
class StepAsidePolicy:
    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = 0.2
    decay: float = 0.7  # weight of the past in the acceptance average
    cooldown: int = 16  # steps a low-acceptance request (or an empty-handed engine) sits out
    empty_steps_to_pause: int = 4
    _empty_streak: int = 0
    _paused: int = 0

    def engine_wants(self, num_decoding: int) -> bool:
        """Whether this step should try to speculate at all."""
        if num_decoding == 0 or num_decoding > self.max_batch:
            return False
        if self._paused > 0:
            self._paused -= 1
            return False
        return True

    def request_eligible(self, st) -> bool:
        if st.cooldown > 0:
            st.cooldown -= 1
            if st.cooldown == 0:
                st.acceptance = 1.0  # a fresh chance
            return False
        return True

    def observe(self, st, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        st.acceptance = self.decay * st.acceptance + (1 - self.decay) * (accepted / drafted)
        if st.acceptance < self.min_acceptance:
            st.cooldown = self.cooldown

    def observe_step(self, any_draft: bool) -> None:
        """After a step that tried to speculate: pause after several empty-handed ones."""
        if any_draft:
            self._empty_streak = 0
            return
        self._empty_streak += 1
        if self._empty_streak >= self.empty_steps_to_pause:
            self._empty_streak = 0
            self._paused = self.cooldown
