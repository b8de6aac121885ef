"""duet_spec_* metrics follow the engine's speculation counters, and a request's stats sum
onto its decode span (services/decode/service.spec_totals)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from shared.engine.speculative.stats import SpecStats
from shared.telemetry.spec_metrics import SpecMetrics


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_counters_follow_the_stats():
    stats = SpecStats("ngram")
    reg = CollectorRegistry()
    m = SpecMetrics(stats, reg)
    m()
    assert _value(reg, "duet_spec_verify_steps_total", method="ngram") == 0
    stats.record(4, 4)
    stats.record(4, 1)
    stats.record(2, 0)
    stats.stepped_aside += 3
    m()
    m()  # idempotent between changes
    assert _value(reg, "duet_spec_draft_tokens_total", method="ngram") == 10
    assert _value(reg, "duet_spec_accepted_tokens_total", method="ngram") == 5
    assert _value(reg, "duet_spec_verify_steps_total", method="ngram") == 3
    assert _value(reg, "duet_spec_stepped_aside_steps_total", method="ngram") == 3
    assert _value(reg, "duet_spec_mean_accepted_length", method="ngram") == (5 + 3) / 3
    # position 0 drafted 3 times, accepted twice; position 3 drafted twice, accepted once
    assert _value(reg, "duet_spec_acceptance_by_position", method="ngram", position="0") == 2 / 3
    assert _value(reg, "duet_spec_acceptance_by_position", method="ngram", position="3") == 1 / 2
    assert b"duet_spec_draft_tokens_total" in generate_latest(reg)


def test_span_totals_sum_sequences():
    from services.decode.service import spec_totals
    a, b = SpecStats("draft"), SpecStats("draft")
    a.record(4, 3)
    b.record(4, 4)
    b.record(2, 1)
    total = spec_totals(spec_totals(None, a), b)
    attrs = total.span_attributes()
    assert attrs["spec.method"] == "draft" and attrs["spec.verify_steps"] == 3
    assert attrs["spec.draft_tokens"] == 10 and attrs["spec.accepted_tokens"] == 8
    assert attrs["spec.acceptance_by_position"] == [1.0, 0.6667, 1.0, 0.5]  # drafted 3,3,2,2; accepted 3,2,2,1
    assert a.verify_steps == 1  # the sequences' own stats are untouched
