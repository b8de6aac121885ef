"""The gateway admission's Prometheus figures (admission.py), read at scrape time: requests and
sequences running and waiting, each model pool's waiting prompt tokens, the budgets in force,
what the routes found cached, and the requests refused."""
from __future__ import annotations

from services.gateway.http_edge.admission import AdmissionQueue


def register_admission_metrics(registry, queue: AdmissionQueue) -> None:
    """Gauges read at scrape time: requests and sequences running and waiting, KV tokens
    admitted, the budget in force, and requests refused so far."""
    from prometheus_client import Gauge

    Gauge("duet_gateway_admitted_requests", "Requests admitted (their first prompt running) and not yet ended",
          registry=registry).set_function(lambda: queue.active)
    Gauge("duet_gateway_queued_requests", "Requests waiting to be admitted",
          registry=registry).set_function(lambda: queue.queued)
    Gauge("duet_gateway_refused_requests", "Requests refused by admission (429) since start",
          registry=registry).set_function(lambda: queue.refused)
    Gauge("duet_gateway_running_sequences", "Sequences (prompts x n) admitted and running",
          registry=registry).set_function(lambda: queue.running.sequences)
    Gauge("duet_gateway_waiting_sequences", "Sequences waiting for admission (queued requests and the "
          "later prompts of admitted ones)", registry=registry).set_function(lambda: queue.waiting_sequences)
    registry.register(_WaitingPromptTokens(queue))
    Gauge("duet_gateway_running_tokens", "KV tokens the running sequences can fill (prompt + n x max_tokens)",
          registry=registry).set_function(lambda: queue.running.tokens)
    Gauge("duet_gateway_prefilling_tokens", "Prompt tokens admitted and not yet past their first token, less "
          "those the route found cached", registry=registry).set_function(lambda: queue.running.prefill_tokens)
    registry.register(_CachedPromptTokens(queue))
    Gauge("duet_gateway_prefill_budget", "Prompt tokens that may be admitted and not yet prefilled (0: no bound)",
          registry=registry).set_function(lambda: queue.budget_total().prefill_tokens)
    Gauge("duet_gateway_sequence_budget", "Sequences that may run at once (0: no bound)",
          registry=registry).set_function(lambda: queue.budget_total().sequences)
    Gauge("duet_gateway_token_budget", "KV tokens that may run at once (0: no bound)",
          registry=registry).set_function(lambda: queue.budget_total().tokens)


class _WaitingPromptTokens:
    """duet_gateway_waiting_prompt_tokens{model}, each pool's, read at scrape time (the planner
    of one model's pool weighs its own as part of its backlog)."""

    def __init__(self, queue: AdmissionQueue):
        self.queue = queue

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("duet_gateway_waiting_prompt_tokens",
                                   "Prompt tokens of the sequences waiting for admission, by base model", labels=["model"])
        for pool in self.queue.pools():
            family.add_metric([pool], self.queue.waiting_prompt_tokens_of(pool))
        yield family


class _CachedPromptTokens:
    """duet_gateway_admission_cached_prompt_tokens_total and ..._local_prefill_prompt_tokens_total,
    read at scrape time."""

    def __init__(self, queue: AdmissionQueue):
        self.queue = queue

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("duet_gateway_admission_cached_prompt_tokens",
                                  "Prompt tokens the routes found cached on the chosen worker, taken off the "
                                  "prefill budget before their first token", value=self.queue.cached_prompt_tokens)
        yield CounterMetricFamily("duet_gateway_admission_local_prefill_prompt_tokens",
                                  "Prompt tokens a decode worker prefilled (local or overflow placement; the part "
                                  "it did not hold), taken off the prefill budget at routing, counted at the first "
                                  "token",
                                  value=self.queue.local_prefill_prompt_tokens)
