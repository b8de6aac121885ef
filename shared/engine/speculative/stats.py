"""Engine-wide speculation counters (the worker exports them as duet_spec_* metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    method: str
    verify_steps: int = 0  # sequence-steps that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [i]: verify steps with a draft token i
    accepted_at: list[int] = field(default_factory=list)  # [i]: ... whose draft token i was accepted
    stepped_aside: int = 0  # engine steps that decoded plainly with speculation on

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for arr, n in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            if len(arr) < n:
                arr.extend([0] * (n - len(arr)))
            for i in range(n):
                arr[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step appends per sequence: accepted drafts + the target's own."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of draft tokens at position i that were accepted (given one was drafted)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def add(self, other: "SpecStats") -> None:
        self.verify_steps += other.verify_steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def span_attributes(self) -> dict:
        """What a request's decode span records (OpenTelemetry attribute values)."""
        return {"spec.method": self.method, "spec.verify_steps": self.verify_steps,
                "spec.draft_tokens": self.draft_tokens, "spec.accepted_tokens": self.accepted_tokens,
                "spec.mean_accepted_length": round(self.mean_accepted_length, 4),
                "spec.acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position]}

    def as_dict(self) -> dict:
        return dict(method=self.method, verify_steps=self.verify_steps, draft_tokens=self.draft_tokens,
                    accepted_tokens=self.accepted_tokens, mean_accepted_length=self.mean_accepted_length,
                    acceptance_by_position=self.acceptance_by_position, stepped_aside=self.stepped_aside)
