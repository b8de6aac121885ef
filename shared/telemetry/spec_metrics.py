"""duet_spec_* metrics: speculative decoding's draft, accepted and verify counters by
method, and the acceptance by draft position, from the engine's SpecStats (read on the
engine-loop thread after each iteration, as the load gauges are)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class SpecMetrics:
    stats: object  # shared.engine.speculative.stats.SpecStats
    registry: CollectorRegistry
    _seen: dict = field(default_factory=dict)

    def __post_init__(self):
        r, m = self.registry, self.stats.method
        self.draft = Counter("duet_spec_draft_tokens", "Draft tokens proposed for verification",
                             ["method"], registry=r).labels(method=m)
        self.accepted = Counter("duet_spec_accepted_tokens", "Draft tokens the target accepted",
                                ["method"], registry=r).labels(method=m)
        self.steps = Counter("duet_spec_verify_steps", "Sequence-steps that verified a draft",
                             ["method"], registry=r).labels(method=m)
        self.aside = Counter("duet_spec_stepped_aside_steps",
                             "Engine steps decoded plainly while speculation was on (batch too large, or paused)",
                             ["method"], registry=r).labels(method=m)
        self.mean_len = Gauge("duet_spec_mean_accepted_length",
                              "Tokens a verify step appends per sequence, on average since start",
                              ["method"], registry=r).labels(method=m)
        self.by_position = Gauge("duet_spec_acceptance_by_position",
                                 "Share of draft tokens at a position that were accepted, since start",
                                 ["method", "position"], registry=r)

    def __call__(self) -> None:
        s = self.stats
        for name, counter, total in (("draft", self.draft, s.draft_tokens), ("accepted", self.accepted, s.accepted_tokens),
                                     ("steps", self.steps, s.verify_steps), ("aside", self.aside, s.stepped_aside)):
            if total != self._seen.get(name, 0):
                counter.inc(total - self._seen.get(name, 0))
                self._seen[name] = total
        if s.verify_steps != self._seen.get("gauges"):
            self._seen["gauges"] = s.verify_steps
            self.mean_len.set(s.mean_accepted_length)
            for i, a in enumerate(s.acceptance_by_position):
                self.by_position.labels(method=s.method, position=str(i)).set(a)
