"""Multi-turn result files: turn records and conversation outcomes are the source of truth;
the summary is for readers and is recomputed on loading (compare, report)."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from loadtest.arrivals import rate_from_json
from loadtest.multiturn.turn_metrics import MultiTurnSummary, summarize_multiturn
from loadtest.multiturn.turn_record import DialogOutcome, TurnRecord
from loadtest.records import RequestRecord
from loadtest.results_io import read_doc, write_doc

FORMAT = "duet-loadtest-multiturn/1"


@dataclass
class MultiTurnResult:
    path: pathlib.Path | None
    meta: dict  # label, title, model, config, requests_sent, ...
    turns: list[TurnRecord]
    outcomes: list[DialogOutcome]
    warmup: list[RequestRecord] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.meta.get("label") or (self.path.parent.name if self.path else "run")

    @property
    def rate(self) -> float:
        return rate_from_json(self.meta.get("conversation_rate"))

    def summary(self) -> MultiTurnSummary:
        return summarize_multiturn(self.name, self.rate, self.turns, self.outcomes, len(self.warmup))


def write_result(path: pathlib.Path, result: MultiTurnResult, summary: MultiTurnSummary) -> None:
    write_doc(path, FORMAT, {**result.meta, "summary": summary.to_json(),
                             "conversations": [o.to_json() for o in result.outcomes],
                             "records": [t.to_json() for t in result.turns],
                             "warmup": [r.to_json() for r in result.warmup]})


def read_result(path: str | pathlib.Path) -> MultiTurnResult:
    p, doc = read_doc(path, FORMAT, "duet loadtest multiturn")
    meta = {k: v for k, v in doc.items() if k not in ("summary", "conversations", "records", "warmup")}
    return MultiTurnResult(p, meta, [TurnRecord.from_json(d) for d in doc["records"]],
                           [DialogOutcome(**d) for d in doc["conversations"]],
                           [RequestRecord.from_json(d) for d in doc.get("warmup", [])])
