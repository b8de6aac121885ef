"""The correction factors (predict.Corrections: what the gateways saw over what the models
predicted) by the way a split serves the load (predict.way: SPLIT, or BESIDE decode rows).

The factors come from the current split only, and they say most about splits that serve the
load the same way: on two `both` workers the inter-token latency the gateways see holds the
prefill chunks' interference (the workers' budgets fill each step up to the target), and their
first-token wait the queueing of prompts prefilled beside decode rows; a split's decode steps
carry neither. One factor for every split scaled the split's predictions by both. So each way
keeps the last factors seen while it served, for MEMORY_S; a way not seen within it takes the
current factors halfway (Corrections.halfway): it shares the models' error and the closed loop's
queueing, not the other way's mechanism. (Dynamo's planner keeps one factor per metric: TTFT for
its prefill pool, ITL for its decode pool; its pools always serve one way.) A burst's readings are
not kept (decide.py). (Measured on two H200s, 4096-token prompts at 12 req/s on two `both`
workers: the first-token factor sat at its 4x ceiling and, halved, still left the split predicted
at 11-23 s; the larger error was the split's own model, fixed by perf_prefill_step:
docs/performance/serving.md.)"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.planner.predict import Corrections

MEMORY_S = 600.0  # how long a way's factors stand for it once it stops serving


@dataclass
class CorrectionMemory:
    memory_s: float = MEMORY_S
    seen: dict[str, tuple[float, Corrections]] = field(default_factory=dict)  # way -> (when, factors)

    def note(self, way: str, corrections: Corrections, now: float) -> None:
        """The factors of the way the current split serves the load, from a window worth judging."""
        self.seen[way] = (now, corrections)

    def for_way(self, way: str, current_way: str, current: Corrections, now: float) -> Corrections:
        """The factors to predict a split serving the load `way` by, the current split serving it
        `current_way` with factors `current`."""
        if way == current_way:
            return current
        last = self.seen.get(way)
        if last is not None and now - last[0] <= self.memory_s:
            return last[1]
        return current.halfway()
