"""How long a worker takes to prefill some tokens, chunk by chunk, by its step model: what
the router predicts a placement's time to first token from (services/router/placement.py).

Each step carries the decode rows running there plus one chunk: at most the token budget
(`max_batched_tokens` less the rows) and, beside decode rows, at most what the worker's
inter-token budget allows (step_budget.py, the same arithmetic its scheduler runs), so a
prefill on a busy decode worker is predicted as the many small steps it will really take.

The worker's budget also widens those chunks when its own queue would miss the first-token
target (ttft_pressure.py). The simulation weighs the same: the tokens it still has to compute as
one request that has waited the simulated time so far (plus whatever wait the caller gives:
the queue ahead of it). The registry carries no queued request's own wait, so a queue that
has already waited long on the worker is seen as fresh: where that matters the simulation
widens less, and predicts slower, than the worker runs."""
from __future__ import annotations

from dataclasses import dataclass

from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.step_model import StepModel, StepShape, attended_pairs
from shared.perf_model.ttft_pressure import QueuedPrefill

_MAX_SIMULATED_STEPS = 64  # past this, the rest goes at the last step's rate


@dataclass(frozen=True)
class PrefillSite:
    """A worker as a place to prefill: its model, the decode rows running there, its budgets."""

    model: StepModel
    decode_rows: int = 0
    decode_context: int = 0
    max_batched_tokens: int = 8192
    budget: ItlBudget | None = None  # the worker's inter-token budget (None: it runs none)
    row_tokens: int = 1  # tokens a decode row takes of a graph's where the worker speculates K: K + 1 ...
    spec_rows: int = 0   # ... beside at most this many rows (above, its rows decode plainly); 0: it does not

    def chunk(self, tokens: int, start: int, waited_s: float = 0.0) -> int:
        """The chunk of `tokens` (after `start` held ones, one request that has waited
        `waited_s`) the next step would take."""
        cap = max(1, self.max_batched_tokens - self.decode_rows)
        n = min(tokens, cap)
        if self.budget is None:
            return n
        queue = (QueuedPrefill(tokens, waited_s),) if self.budget.weighs_queue else ()
        # a speculating worker's rows carry K + 1 tokens in its graphs, as its scheduler counts them
        # (a pause after draftless steps aside: it lasts a few steps)
        row_tokens = self.row_tokens if self.decode_rows <= self.spec_rows else 1
        room = self.budget.begin(self.decode_rows, self.decode_context, queue, token_budget=cap,
                                 row_tokens=row_tokens)
        return max(1, min(n, room.allow(start))) if room is not None else n

    def step_s(self, chunk: int = 0, start: int = 0) -> float:
        """One step's time with these decode rows and a chunk of `chunk` tokens after `start`."""
        return self.model.step_s(StepShape(chunk, attended_pairs(start, chunk) if chunk else 0.0,
                                           self.decode_rows, self.decode_context))

    def prefill_s(self, tokens: int, start: int = 0, waited_s: float = 0.0) -> float:
        """Seconds to compute `tokens` prompt tokens after `start` held ones, for a request that
        has waited `waited_s` already (the first-token target's share of the budget weighs it)."""
        total, done, n, step = 0.0, 0, 1, 0.0
        for _ in range(_MAX_SIMULATED_STEPS):
            if done >= tokens:
                return total
            n = self.chunk(tokens - done, start + done, waited_s + total)
            step = self.step_s(n, start + done)
            total += step
            done += n
        return total + step * (tokens - done) / n if done < tokens else total
