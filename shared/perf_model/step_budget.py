"""Prefill on a decode worker within an inter-token budget (stall-free batching).

A step carries every decode row first; prefill chunks then ride along only as far as the
worker's step model (step_model.py) predicts the step stays under the inter-token latency
target, so a burst of prefills on a decode worker can never push its running streams past
the target (Sarathi-Serve's token budget, derived per step from the target and the rows
running now instead of profiled once). At least `floor_tokens` go each step, so prefill always
progresses. The scheduler (shared/engine/scheduler.py) asks `begin()` once per step with
decode rows, then `allow()` before and `charge()` after each chunk; the router simulates
the same budget to predict a local prefill's time (services/router/placement.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.perf_model.step_model import StepModel, StepShape


@dataclass
class StepAllowance:
    """One step's prefill room: the time left under the target after its decode rows."""

    model: StepModel
    time_left_s: float
    floor_tokens: int
    granted: int = 0
    first: int | None = None   # the step's budget as the first chunk saw it (the gauge)

    def allow(self, start: int) -> int:
        """Tokens the next chunk (after `start` held tokens) may have."""
        n = self.model.largest_chunk(self.time_left_s, start)
        if self.granted == 0:
            n = max(n, self.floor_tokens)
        if self.first is None:
            self.first = n
        return n

    def charge(self, start: int, length: int) -> None:
        self.granted += length
        self.time_left_s -= self.model.chunk_s(start, length)


@dataclass
class ItlBudget:
    """The worker's budget: its current model (swapped at each refit) and the target."""

    target_s: float
    floor_tokens: int = 32
    model: StepModel | None = None

    def begin(self, decode_rows: int, decode_context: int) -> StepAllowance | None:
        """The room of a step with these decode rows; None when nothing limits it (no rows,
        no model yet, no target)."""
        if decode_rows <= 0 or self.model is None or self.target_s <= 0:
            return None
        base = self.model.step_s(StepShape(decode_rows=decode_rows, decode_context=decode_context))
        return StepAllowance(self.model, self.target_s - base, self.floor_tokens)
