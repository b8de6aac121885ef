"""Result files: the records are the source of truth, the summaries are for readers.

Loading recomputes summaries from records, so a file can be re-judged against other
SLOs later (`compare --slo-ttft-ms ...`)."""
from __future__ import annotations

import datetime as _dt
import json
import pathlib
from dataclasses import dataclass

from loadtest.arrivals import rate_from_json, rate_to_json
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


def write_results(path: pathlib.Path, meta: dict, runs: list[RunResult], summaries: list[RunSummary]) -> None:
    runs_json = [{"label": run.label, "request_rate": rate_to_json(run.request_rate), "started_unix": run.started_unix,
                  "summary": summary.to_json(), "records": [r.to_json() for r in run.records],
                  "warmup": [r.to_json() for r in run.warmup]} for run, summary in zip(runs, summaries)]
    write_doc(path, FORMAT, {**meta, "runs": runs_json})


def write_doc(path: pathlib.Path, doc_format: str, body: dict) -> None:
    """A result file: its format and when it was written, then the body."""
    doc = {"format": doc_format, "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), **body}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def read_doc(path: str | pathlib.Path, doc_format: str, what: str) -> tuple[pathlib.Path, dict]:
    p = pathlib.Path(path)
    doc = json.loads(p.read_text())
    if doc.get("format") != doc_format:
        raise SystemExit(f"{p}: not a {what} result file (format {doc.get('format')!r})")
    return p, doc


def read_results(path: str | pathlib.Path) -> ResultFile:
    p, doc = read_doc(path, FORMAT, "duet loadtest")
    runs = [RunResult(r["label"], rate_from_json(r["request_rate"]), [RequestRecord.from_json(x) for x in r["records"]],
                      r.get("started_unix", 0.0), [RequestRecord.from_json(x) for x in r.get("warmup", [])])
            for r in doc["runs"]]
    slo = SLO(**(doc.get("config", {}).get("slo") or {}))
    meta = {k: v for k, v in doc.items() if k != "runs"}
    return ResultFile(p, meta, runs, slo)
