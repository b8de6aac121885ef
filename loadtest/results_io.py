"""Result files: the records are the source of truth, the summaries are for readers.

Loading recomputes summaries from records, so a file can be re-judged against other
SLOs later (`compare --slo-ttft-ms ...`)."""
from __future__ import annotations

import datetime as _dt
import json
import math
import pathlib
from dataclasses import dataclass

from loadtest.config import SLO
from loadtest.metrics import RunSummary, summarize
from loadtest.records import RequestRecord
from loadtest.runner import RunResult

FORMAT = "duet-loadtest-results/1"


@dataclass
class ResultFile:
    path: pathlib.Path | None
    meta: dict  # config, endpoint, model, tokenizer, created
    runs: list[RunResult]
    slo: SLO

    def summaries(self, slo: SLO | None = None) -> list[RunSummary]:
        use = slo if slo is not None and slo.any else self.slo
        return [summarize(r.label, r.request_rate, r.records, use, len(r.warmup)) for r in self.runs]

    @property
    def name(self) -> str:
        return self.meta.get("label") or (self.path.parent.name if self.path else "run")


def _rate_to_json(rate: float):
    return "inf" if math.isinf(rate) else (None if math.isnan(rate) else rate)


def _rate_from_json(v) -> float:
    return math.inf if v == "inf" else (math.nan if v is None else float(v))


def write_results(path: pathlib.Path, meta: dict, runs: list[RunResult], summaries: list[RunSummary]) -> None:
    doc = {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **meta,
        "runs": [
            {
                "label": run.label,
                "request_rate": _rate_to_json(run.request_rate),
                "started_unix": run.started_unix,
                "summary": summary.to_json(),
                "records": [r.to_json() for r in run.records],
                "warmup": [r.to_json() for r in run.warmup],
            }
            for run, summary in zip(runs, summaries)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def read_results(path: str | pathlib.Path) -> ResultFile:
    p = pathlib.Path(path)
    doc = json.loads(p.read_text())
    if doc.get("format") != FORMAT:
        raise SystemExit(f"{p}: not a duet loadtest result file (format {doc.get('format')!r})")
    runs = [
        RunResult(
            label=r["label"],
            request_rate=_rate_from_json(r["request_rate"]),
            records=[RequestRecord.from_json(x) for x in r["records"]],
            started_unix=r.get("started_unix", 0.0),
            warmup=[RequestRecord.from_json(x) for x in r.get("warmup", [])],
        )
        for r in doc["runs"]
    ]
    slo = SLO(**(doc.get("config", {}).get("slo") or {}))
    meta = {k: v for k, v in doc.items() if k != "runs"}
    return ResultFile(p, meta, runs, slo)
