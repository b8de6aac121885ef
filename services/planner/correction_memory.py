"""The correction factors (predict.Corrections: what the gateways saw over what the models
predicted) by the way a split serves the load (predict.way: SPLIT, or BESIDE decode rows).

The factors come from the current split only, and they are worth most for splits that serve the
load the same way: on two `both` workers under long prompts the inter-token latency the gateways
see is the prefill chunks' interference (the workers' budgets fill each step up to the target), a
term a split's decode worker does not have; the same factor on the split's interference-free steps
predicted it as slow, and the planner kept two `both` workers where the split served the load
better (two H200s, 4096-token prompts at 12 req/s: 72.6% goodput against 81-88%; started as a
split, the planner kept the split). So each way keeps the last factors seen while it served, for
MEMORY_S; a way not seen within it takes the current factors halfway (Corrections.halfway):
it shares the models' error and the closed loop's queueing, not the other way's mechanism. Dynamo's
planner keeps its correction factors per pool for the same reason."""
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
