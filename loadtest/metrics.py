"""From request records to the numbers a run is judged by."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from loadtest.arrivals import rate_to_json
from loadtest.config import SLO
from loadtest.records import RequestRecord


@dataclass
class Distribution:
    """Milliseconds."""

    count: int = 0
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of_seconds(cls, values: list[float]) -> "Distribution":
        if not values:
            return cls()
        ms = np.asarray(values, dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(len(ms), float(ms.mean()), float(ms.std()), float(ms.min()), float(p50), float(p90),
                   float(p99), float(ms.max()))


@dataclass
class Goodput:
    slo: SLO
    good: int = 0
    share: float | None = None  # of all measured requests, failures included
    rate: float | None = None  # good requests per second


@dataclass
class TokenCheck:
    """Server usage counts against our tokenizer's, over finished requests."""

    checked: int = 0
    missing_usage: int = 0
    prompt_usage_total: int = 0
    prompt_tokenizer_total: int = 0
    prompt_mismatches: int = 0
    prompt_max_abs_diff: int = 0
    output_usage_total: int = 0
    output_tokenizer_total: int = 0
    output_mismatches: int = 0
    output_max_abs_diff: int = 0


@dataclass
class RunSummary:
    label: str
    request_rate: float
    duration_s: float
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_concurrency: float
    max_send_lag_ms: float  # how far sends fell behind the arrival schedule (client or concurrency cap)
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    goodput: Goodput
    token_check: TokenCheck
    warmup_requests: int = 0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "request_rate": rate_to_json(self.request_rate)}


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    if not rec.ok:
        return False
    if slo.ttft_ms is not None and (rec.ttft is None or rec.ttft * 1000 > slo.ttft_ms):
        return False
    # A one-token answer has no TPOT; it cannot miss a per-token target.
    if slo.tpot_ms is not None and rec.tpot is not None and rec.tpot * 1000 > slo.tpot_ms:
        return False
    if slo.e2e_ms is not None and (rec.e2e is None or rec.e2e * 1000 > slo.e2e_ms):
        return False
    return True


def check_tokens(records: list[RequestRecord]) -> TokenCheck:
    tc = TokenCheck()
    for r in records:
        if not r.ok:
            continue
        tc.checked += 1
        if r.usage_prompt_tokens is None or r.usage_completion_tokens is None:
            tc.missing_usage += 1
            continue
        tc.prompt_usage_total += r.usage_prompt_tokens
        tc.prompt_tokenizer_total += r.prompt_len
        d = abs(r.usage_prompt_tokens - r.prompt_len)
        tc.prompt_mismatches += d != 0
        tc.prompt_max_abs_diff = max(tc.prompt_max_abs_diff, d)
        if r.output_tokens_tokenizer is not None:
            tc.output_usage_total += r.usage_completion_tokens
            tc.output_tokenizer_total += r.output_tokens_tokenizer
            d = abs(r.usage_completion_tokens - r.output_tokens_tokenizer)
            tc.output_mismatches += d != 0
            tc.output_max_abs_diff = max(tc.output_max_abs_diff, d)
    return tc


def summarize(label: str, request_rate: float, records: list[RequestRecord], slo: SLO,
              warmup: int = 0) -> RunSummary:
    done = [r for r in records if r.ok]
    starts = [r.sent_at for r in records]
    ends = [r.done_at for r in records if r.done_at is not None]
    duration = (max(ends) - min(starts)) if records and ends else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    in_tok = sum(r.input_tokens for r in done)
    out_tok = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo) for r in records) if slo.any else len(done)
    busy = sum((r.done_at - r.sent_at) for r in records if r.done_at is not None)
    lags = [r.sent_at - r.scheduled_at for r in records]
    return RunSummary(
        label=label, request_rate=request_rate, duration_s=duration, requests=len(records), completed=len(done),
        failed=len(records) - len(done), errors=dict(Counter(r.error_kind for r in records if not r.ok)),
        input_tokens=in_tok, output_tokens=out_tok, request_throughput=per_s(len(done)),
        input_throughput=per_s(in_tok), output_throughput=per_s(out_tok), total_token_throughput=per_s(in_tok + out_tok),
        mean_concurrency=per_s(busy), max_send_lag_ms=max(lags) * 1000 if lags else 0.0,
        ttft=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        itl=Distribution.of_seconds([g for r in done for g in r.itls]),
        tpot=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        e2e=Distribution.of_seconds([r.e2e for r in done if r.e2e is not None]),
        goodput=Goodput(slo=slo, good=good, share=(good / len(records)) if records else None, rate=per_s(good)),
        token_check=check_tokens(records), warmup_requests=warmup,
    )
