"""How much prefill a worker's steps must carry for its queue to meet the time-to-first-token
target: the other half of the step budget (step_budget.py).

The queue is the prefill work on this worker, in the order the scheduler serves it: the
admitted requests still computing their prompts, then the waiting ones. A request's first token
comes once its own prompt and every one ahead of it are computed, so it asks for (tokens ahead
and its own) / (time left to its target) prompt tokens a second; the queue needs the largest of
those (the earliest-deadline feasibility test, for a queue served in order). A request near or
past its target is given a quarter of the target still: asking for its tokens within the next
instant would widen one step to the whole token budget and stall every stream for what is lost
anyway, while a quarter of the target lets the queue catch up within a few steps. A request
whose first token came already (one retracted and recomputed, a migrated stream) sets no
deadline, though its tokens still go ahead of those behind it."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shared.perf_model.step_model import StepModel

MIN_HORIZON = 0.25  # share of the TTFT target a request near or past it is still given


@dataclass(slots=True)
class QueuedPrefill:
    """One request's prefill still to run on this worker (made for every queued request each
    step: slots, not frozen, keep that cheap)."""

    tokens: int                  # prompt tokens not yet computed
    waited_s: float              # since it reached this worker
    first_token_due: bool = True  # False: its first token came already (no TTFT deadline)


def needed_rate(queue: Iterable[QueuedPrefill], ttft_s: float, enough: float = math.inf) -> float:
    """Prompt tokens a second the worker must compute for every request of the queue (served in
    order) to get its first token within `ttft_s` of reaching the worker. Read no further than
    a need of `enough` (what the step can give at most: more changes nothing), so a long queue
    is read only as far as it matters."""
    need, ahead = 0.0, 0
    floor = MIN_HORIZON * ttft_s
    for q in queue:
        ahead += q.tokens
        if q.first_token_due and q.tokens > 0:
            need = max(need, ahead / max(ttft_s - q.waited_s, floor))
            if need >= enough:
                break
    return need


def tokens_for_rate(model: StepModel, base_s: float, rate: float, cap: int) -> int:
    """The fewest prefill tokens a step of `base_s` without them must carry so the step computes
    `rate` prompt tokens a second (tokens / step time, by the model); `cap` when not even that
    many do. The chunk's attention is priced as a prompt's first chunk (start 0)."""
    if rate <= 0 or cap <= 0:
        return 0

    def enough(c: int) -> bool:
        return c >= rate * (base_s + model.chunk_s(0, c))

    if not enough(cap):
        return cap
    # c - rate * step(c) is concave in c and negative at 0: below cap it turns non-negative
    # once, so the test is monotone over [0, cap]
    lo, hi = 0, cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi
