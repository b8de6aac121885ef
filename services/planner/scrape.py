"""Reading the figures a decision needs from the processes' Prometheus /metrics pages: the
gateways' (time to first token, inter-token latency, prompt and generated tokens: what clients
see; and the requests that reached them, finished and in flight: the load offered, which under
overload is more than what got a first token) and each worker's (the prompt tokens it computed:
the uncached ones). A gateway URL whose host has several addresses (a Kubernetes headless
Service) is every replica, summed."""
from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("duet.planner")

TIMEOUT_S = 3.0
# what the gateway counts, summed over endpoints (a histogram's _sum and _count, counters' totals)
GATEWAY_SERIES = {
    "duet_time_to_first_token_seconds_count": "ttft_count",
    "duet_time_to_first_token_seconds_sum": "ttft_sum",
    "duet_inter_token_latency_seconds_count": "itl_count",
    "duet_inter_token_latency_seconds_sum": "itl_sum",
    "duet_prompt_tokens_total": "prompt_tokens",
    "duet_generation_tokens_total": "output_tokens",
}


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append((s.name, dict(s.labels), float(s.value)))
    return out


# the requests that reached the gateway: duet_requests_total{service="gateway"} (finished) and
# duet_gateway_inflight_requests (not yet); a planner of one model among several reads the same
# pair by base model (counted once a request's model resolved: a request refused for want of a
# place is no model's, so where the gateway serves this model alone the unlabelled pair counts)
FINISHED, INFLIGHT = "duet_requests_total", "duet_gateway_inflight_requests"
MODEL_FINISHED, MODEL_INFLIGHT = "duet_gateway_model_requests_total", "duet_gateway_model_inflight_requests"
# prompt tokens held in the gateway's admission queue (a burst the prefill budget keeps out of the
# workers' queues): part of the backlog (load_window.py); by base model
WAITING = "duet_gateway_waiting_prompt_tokens"
# a client error other than these was the request's own fault (a bad body, a key refused): no load
OFFERED_CLIENT_STATUSES = ("408", "429", "499")


def gateway_figures(text: str, model: str = "") -> dict[str, float]:
    """The gateway's figures, of one base model's requests when `model` is given (the series'
    `model` label: a gateway may serve several models, each with a pool of its own): also
    `finished` and `inflight`, the requests that reached it, and `waiting_prompt_tokens`, those
    its admission queue holds."""
    totals = dict.fromkeys(GATEWAY_SERIES.values(), 0.0)
    totals.update(finished=0.0, inflight=0.0, waiting_prompt_tokens=0.0)
    samples = parse_samples(text)
    served = {labels.get("model") for name, labels, _ in samples if name == WAITING}  # its admission pools
    by_model = bool(model) and served != {model}
    finished, inflight = (MODEL_FINISHED, MODEL_INFLIGHT) if by_model else (FINISHED, INFLIGHT)
    for name, labels, value in samples:
        key = GATEWAY_SERIES.get(name)
        ours = not model or labels.get("model", model) == model
        if key is not None and ours:
            totals[key] += value
        elif name == finished and ours and labels.get("service", "gateway") == "gateway" and _offered(labels):
            totals["finished"] += value
        elif name == inflight and ours:
            totals["inflight"] += value
        elif name == WAITING and ours:
            totals["waiting_prompt_tokens"] += value
    return totals


def _offered(labels: dict[str, str]) -> bool:
    status = labels.get("status", "")
    return not status.startswith("4") or status in OFFERED_CLIENT_STATUSES


def worker_figures(text: str) -> dict[str, float]:
    """A worker's prompt tokens computed (duet_engine_tokens_computed_total{phase="prefill"})."""
    out = {"prefill_tokens": 0.0, "decode_tokens": 0.0}
    for name, labels, value in parse_samples(text):
        if name == "duet_engine_tokens_computed_total" and labels.get("phase") in ("prefill", "decode"):
            out[labels["phase"] + "_tokens"] += value
    return out


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:  # noqa: S310 - http(s) URLs from settings
        return r.read().decode()


def expand(url: str) -> list[str]:
    """The URL once per address its host resolves to (every replica behind a headless Service)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host, port = parts.hostname or "", parts.port
    path = parts.path or "/metrics"
    try:
        infos = socket.getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
    except OSError:
        return [urlunsplit((parts.scheme, parts.netloc, path, "", ""))]
    addresses = sorted({info[4][0] for info in infos})
    if len(addresses) <= 1:
        return [urlunsplit((parts.scheme, parts.netloc, path, "", ""))]
    return [urlunsplit((parts.scheme, f"[{a}]:{port}" if ":" in a else f"{a}:{port}", path, "", ""))
            for a in addresses]


async def _read_all(urls: dict[str, str], figures) -> dict[str, dict[str, float]]:
    """key -> figures(page) of every /metrics page (key -> URL) that answered."""
    keys = list(urls)
    pages = await asyncio.gather(*(asyncio.to_thread(_fetch, urls[k]) for k in keys), return_exceptions=True)
    out = {}
    for key, page in zip(keys, pages):
        if isinstance(page, BaseException):
            log.debug("metrics %s: %s", urls[key], page)
            continue
        out[key] = figures(page)
    return out


async def read_gateways(urls: list[str], model: str = "") -> dict[str, dict[str, float]]:
    """gateway URL -> figures (of `model`'s requests when given), for every gateway that answered."""
    targets = [u for url in urls for u in await asyncio.to_thread(expand, url)]
    return await _read_all({u: u for u in targets}, lambda page: gateway_figures(page, model))


async def read_workers(addresses: dict[str, str]) -> dict[str, dict[str, float]]:
    """key (worker id and instance nonce) -> figures, for every worker whose /metrics answered."""
    return await _read_all({k: f"http://{a}/metrics" for k, a in addresses.items()}, worker_figures)
