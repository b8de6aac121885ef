"""From turn records to numbers by turn index: TTFT percentiles, prompt growth, the share of
the prompt the server served from cache, and errors by kind."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from loadtest.config import SLO
from loadtest.metrics import Distribution, RunSummary, summarize
from loadtest.multiturn.turn_record import DialogOutcome, TurnRecord
from loadtest.records import RequestRecord


@dataclass
class CacheUse:
    """Over finished requests whose server reported cached_tokens."""

    reported: int = 0  # requests that carried usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @classmethod
    def of(cls, records: list[RequestRecord]) -> "CacheUse":
        c = cls()
        for r in records:
            if r.ok and r.usage_cached_tokens is not None:
                c.reported += 1
                c.prompt_tokens += r.input_tokens
                c.cached_tokens += r.usage_cached_tokens
        return c

    def to_json(self) -> dict:
        return {**asdict(self), "share": self.share}


@dataclass
class TurnSummary:
    turn: int
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # by kind: http_<status>, timeout, stream_error, ...
    prompt_tokens_mean: float | None  # finished requests: the server's count, else ours
    output_tokens_mean: float | None
    cache: CacheUse
    ttft: Distribution
    tpot: Distribution
    e2e: Distribution

    @property
    def http_429(self) -> int:
        return self.errors.get("http_429", 0)

    def to_json(self) -> dict:
        return {**asdict(self), "cache": self.cache.to_json(), "http_429": self.http_429}


@dataclass
class MultiTurnSummary:
    overall: RunSummary  # throughput, latency, token check over every turn
    all_turns: TurnSummary  # the by-turn numbers over every turn (turn -1)
    by_turn: list[TurnSummary]
    conversations: dict[str, int]  # how many ended how: finished, context_limit, error, ...
    turns_per_conversation: float | None

    def to_json(self) -> dict:
        return {"overall": self.overall.to_json(), "all_turns": self.all_turns.to_json(),
                "by_turn": [t.to_json() for t in self.by_turn], "conversations": self.conversations,
                "turns_per_conversation": self.turns_per_conversation}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_turn(turn: int, records: list[RequestRecord]) -> TurnSummary:
    done = [r for r in records if r.ok]
    return TurnSummary(
        turn=turn, requests=len(records), completed=len(done), failed=len(records) - len(done),
        errors=dict(Counter(r.error_kind for r in records if not r.ok)),
        prompt_tokens_mean=_mean([r.input_tokens for r in done]),
        output_tokens_mean=_mean([r.output_tokens for r in done]), cache=CacheUse.of(records),
        ttft=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        tpot=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        e2e=Distribution.of_seconds([r.e2e for r in done if r.e2e is not None]),
    )


def summarize_multiturn(label: str, rate: float, turns: list[TurnRecord], outcomes: list[DialogOutcome],
                        warmup: int = 0) -> MultiTurnSummary:
    requests = [t.request for t in turns]
    by_index: dict[int, list[RequestRecord]] = {}
    for t in turns:
        by_index.setdefault(t.turn, []).append(t.request)
    return MultiTurnSummary(
        overall=summarize(label, rate, requests, SLO(), warmup),
        all_turns=summarize_turn(-1, requests),
        by_turn=[summarize_turn(i, by_index[i]) for i in sorted(by_index)],
        conversations=dict(Counter(o.ended for o in outcomes)),
        turns_per_conversation=_mean([o.turns_sent for o in outcomes]),
    )
