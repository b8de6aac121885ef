"""Prefill on a decode worker within an inter-token budget that also weighs the queue's first
tokens (stall-free batching, with both SLOs in view).

A step carries every decode row first; prefill chunks then ride along only as far as the
worker's step model (step_model.py) predicts the step stays under the inter-token latency
target, so a burst of prefills on a decode worker does not push its running streams past the
target (Sarathi-Serve's token budget, derived per step from the target and the rows running
now instead of profiled once). At least `floor_tokens` go each step, so prefill always
progresses.

That room alone starves a queue of long prompts on a busy worker: its steps clear a few hundred
prompt tokens each while the queue grows without bound and every request misses its first-token
target. So the budget also weighs the prefill queued on this worker (ttft_pressure.py): when the
queue, served in order at the ITL room, cannot meet its time-to-first-token target, the step
takes as many prefill tokens as the step model says it must for the queue to meet it (at most
the step's token budget) -- DistServe's view that a request counts only if it meets both
targets, so letting the queue's TTFT go to keep the ITL is no gain. Each step's allowance says
which target set it (`slo`: itl or ttft). With no TTFT pressure the ITL room is the rule.

Slicing pays only where the slices are cheap. On a GPU a step replays a CUDA graph when it is
decode rows alone, or a prefill or mixed step of up to the decode graphs' rows and a few
prompts (shared/engine/prefill_graph.py); a step carrying a chunk beside more rows than that
runs eagerly, and an eager step of a large model costs its kernel launches from Python
(several times a graph's decode step) whatever the chunk's size. There, slicing a prompt into
the room the target leaves turns every step into an eager one: the streams' steps run several
times the target and prefill crawls (two colocated 8B workers served a quarter of what they did
without the budget when mixed steps held 8 sequences, docs/performance/serving.md). So beside
more than `graph_rows` decode rows (or rows whose tokens leave the graphs less than the floor)
the budget does not slice: the token budget rules, one eager step takes as much of the prompt
as it can, and the steps after it replay graphs again.
Beside fewer, a slice stays within the tokens the graphs hold (`graph_tokens`, less the decode
rows' tokens: K + 1 a row while speculation drafts K, the drafts attached after the slice is
cut), so the slices it cuts are the graph steps its model prices; only the queue's
first-token target widens a step past that. Without graphs (a CPU worker, `graph_rows` -1,
`graph_tokens` 0) every step is eager alike and the budget slices at any row count.

The scheduler (shared/engine/scheduler.py) asks `begin()` once per step with decode rows and its
queue, then `allow()` before and `charge()` after each chunk; the router and the planner
simulate the same budget to predict a local prefill's time (prefill_time.py), without the
queue's ages they do not see, so without the widening."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shared.perf_model.step_model import StepModel, StepShape
from shared.perf_model.ttft_pressure import QueuedPrefill, needed_rate, tokens_for_rate


@dataclass
class StepAllowance:
    """One step's prefill room: the time left under the target after its decode rows, and the
    prefill tokens the queue's first-token target asks of the step (0: none beyond that room)."""

    model: StepModel
    time_left_s: float
    floor_tokens: int
    need_tokens: int = 0
    slo: str = "itl"            # which target set the room: itl, or ttft where the queue widened it
    granted: int = 0
    first: int | None = None   # the step's budget as the first chunk saw it (the gauge)
    graph_room: int = 0        # prefill tokens the step holds and still replays a graph (0: no such limit)

    def allow(self, start: int) -> int:
        """Tokens the next chunk (after `start` held tokens) may have."""
        n = self.model.largest_chunk(self.time_left_s, start)
        if self.graph_room > 0:
            n = min(n, self.graph_room - self.granted)
        n = max(n, self.need_tokens - self.granted)
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
    """The worker's budget: its current model (swapped at each refit), the inter-token target
    and the time-to-first-token target its queue is weighed against (0: not weighed)."""

    target_s: float
    floor_tokens: int = 32
    model: StepModel | None = None
    ttft_s: float = 0.0
    graph_rows: int = -1  # beside more decode rows a step with prefill runs eagerly: not sliced (-1: no limit)
    graph_tokens: int = 0  # tokens (decode rows and prefill) a step holds and still replays a graph (0: any)

    @property
    def weighs_queue(self) -> bool:
        """Whether begin() looks at the queue (the scheduler builds it only then)."""
        return self.ttft_s > 0

    def begin(self, decode_rows: int, decode_context: int, queue: Iterable[QueuedPrefill] = (),
              token_budget: int | None = None, row_tokens: int = 1) -> StepAllowance | None:
        """The room of a step with these decode rows and this prefill queue (in the order the
        scheduler serves it, read lazily); None when nothing limits it (no rows, no model yet,
        no target). token_budget: the prefill tokens the step can carry at most (what widening
        stops at); row_tokens: the tokens a decode row may carry in the graph (K + 1 when
        speculation drafts K: the drafts are attached after the chunks are cut)."""
        if decode_rows <= 0 or self.model is None or self.target_s <= 0:
            return None
        graph_room = self.graph_tokens - decode_rows * row_tokens
        if 0 <= self.graph_rows < decode_rows or 0 < self.graph_tokens and graph_room < self.floor_tokens:
            return None  # the step runs eagerly anyway: one wide chunk, not many eager steps
        base = self.model.step_s(StepShape(decode_rows=decode_rows, decode_context=decode_context))
        room = StepAllowance(self.model, self.target_s - base, self.floor_tokens,
                             graph_room=graph_room if self.graph_tokens > 0 else 0)
        if self.ttft_s > 0:
            itl_room = max(self.model.largest_chunk(room.time_left_s, 0), self.floor_tokens)
            cap = max(token_budget if token_budget is not None else 1 << 30, itl_room)
            widest_s = base + self.model.chunk_s(0, cap)
            most = cap / widest_s if widest_s > 0 else math.inf  # prompt tokens a second at the token budget
            need = tokens_for_rate(self.model, base, needed_rate(queue, self.ttft_s, most), cap)
            if need > itl_room:
                room.need_tokens, room.slo = need, "ttft"
        return room
