"""What the load was over the last window: rates of requests and tokens, the uncached share of
the prompts, the decode streams and their context, KV use and the prefill queue, and the TTFT
and ITL clients saw, from the planner's readings (scrape.py and the registry).

The request rate the predictions load the workers with is the offered one: the requests that
reached the gateways (finished in the window plus the growth of those in flight), or those that
got a first token where more did (a prompt list is one request, several first tokens). Under
overload first tokens come only as fast as the workers manage, so counting them alone would
never show a split past its capacity. The per-request sizes (prompt, uncached and output
tokens) stay those of the requests served.

Beside it, the arrivals outside the window's busiest reading interval: a burst (lockstep chats'
first turns all arrive within one) is weighed as a backlog to work off, and what keeps coming
beside it as the rate (decide.py's backlog hold).

A counter is read as its growth between the window's first and last reading, per process
(gateway URL, worker id and instance nonce): a process that restarted or joined counts from its
first reading in the window. The window restarts when the split changes, so a decision weighs
only what the current split served."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from shared.registry.worker_info import WorkerInfo


@dataclass(frozen=True)
class Reading:
    at: float                                  # monotonic seconds
    gateways: dict[str, dict[str, float]]      # gateway URL -> scrape.gateway_figures
    workers: dict[str, dict[str, float]]       # worker key -> scrape.worker_figures
    fleet: tuple[WorkerInfo, ...]              # the registry's live workers


@dataclass(frozen=True)
class Load:
    seconds: float = 0.0            # the window's span
    requests: float = 0.0           # requests that got their first token in it (served)
    requests_per_s: float = 0.0
    arrivals_per_s: float = 0.0     # requests that reached the gateways (0: they did not tell)
    arrivals_beside_burst_per_s: float | None = None  # the same outside a burst's interval (None: none stood out)
    prompt_tokens_per_s: float = 0.0
    computed_prompt_tokens_per_s: float = 0.0  # what the workers computed: the uncached part
    output_tokens_per_s: float = 0.0
    decode_streams: float = 0.0     # mean decode rows running (decode and `both` workers)
    decode_context: float = 0.0     # mean positions a decode row attends to
    kv_live_pages: float = 0.0      # mean pages held by live work, all workers
    queued_prefill_tokens: float = 0.0  # mean over the window's readings: all workers, and the gateways' held back
    backlog_tokens: float = 0.0         # the most queued in one reading of the window (a burst's peak)
    ttft_s: float | None = None     # mean time to first token the gateways saw
    itl_s: float | None = None      # mean inter-token latency the gateways saw

    @property
    def offered_per_s(self) -> float:
        """The request rate the workers are asked to serve (what the predictions load them with)."""
        return max(self.requests_per_s, self.arrivals_per_s)

    @property
    def offered_beside_burst_per_s(self) -> float:
        """The rate that keeps coming beside a burst: the arrivals outside the window's busiest
        reading interval where it stands out (lockstep chats' first turns all arrive within one;
        LoadWindow._arrivals_beside_burst), as a share of the offered rate; else the offered rate."""
        if self.arrivals_beside_burst_per_s is None or not self.arrivals_per_s:
            return self.offered_per_s
        # the share of the offered rate that is not the burst: the offered rate counts first tokens
        # where more came than arrivals (a prompt list is one arrival, several first tokens)
        return self.offered_per_s * min(1.0, self.arrivals_beside_burst_per_s / self.arrivals_per_s)

    @property
    def prompt_tokens(self) -> float:
        """Mean prompt tokens a request."""
        return self.prompt_tokens_per_s / self.requests_per_s if self.requests_per_s else 0.0

    @property
    def uncached_tokens(self) -> float:
        """Mean prompt tokens a request computed (not found in a prefix cache)."""
        if not self.requests_per_s:
            return 0.0
        return min(self.prompt_tokens, self.computed_prompt_tokens_per_s / self.requests_per_s)

    @property
    def uncached_share(self) -> float:
        return self.uncached_tokens / self.prompt_tokens if self.prompt_tokens else 1.0

    @property
    def output_tokens(self) -> float:
        return self.output_tokens_per_s / self.requests_per_s if self.requests_per_s else 0.0


def _growth(first: dict[str, dict[str, float]], last: dict[str, dict[str, float]], key: str) -> float:
    """Summed growth of one counter over the processes in the last reading (a process absent
    from the first, or whose counter went back, restarted: its whole value counts)."""
    total = 0.0
    for proc, figures in last.items():
        now = figures.get(key, 0.0)
        before = first.get(proc, {}).get(key, 0.0)
        total += now - before if now >= before else now
    return total


def _arrivals(first: dict[str, dict[str, float]], last: dict[str, dict[str, float]]) -> float:
    """Requests that reached the gateways in the window: per gateway, the growth of its finished
    requests plus that of its requests in flight (a gauge); one that joined or restarted counts
    everything it holds. 0 where no gateway tells (an older gateway without a model's series)."""
    total = 0.0
    for proc, figures in last.items():
        if "finished" not in figures:
            continue
        before = first.get(proc, {})
        if "finished" in before and figures["finished"] >= before["finished"]:
            total += figures["finished"] - before["finished"] + figures["inflight"] - before["inflight"]
        else:
            total += figures["finished"] + figures["inflight"]
    return max(total, 0.0)


@dataclass
class LoadWindow:
    seconds: float
    readings: deque = field(default_factory=deque)

    def add(self, reading: Reading) -> None:
        self.readings.append(reading)
        while len(self.readings) > 2 and reading.at - self.readings[1].at >= self.seconds:
            self.readings.popleft()

    def reset(self) -> None:
        """Keep only the last reading: the next window starts from it."""
        while len(self.readings) > 1:
            self.readings.popleft()

    def load(self) -> Load:
        if len(self.readings) < 2:
            return Load()
        first, last = self.readings[0], self.readings[-1]
        span = max(last.at - first.at, 1e-9)
        g = lambda key: _growth(first.gateways, last.gateways, key)  # noqa: E731
        requests, itl_count = g("ttft_count"), g("itl_count")
        prompt, computed = g("prompt_tokens"), _growth(first.workers, last.workers, "prefill_tokens")
        rows = context = pages = queued = peak = 0.0
        for r in self.readings:
            # the workers' queues, and what the gateways' admission holds back: its uncached part,
            # by the share of the prompts admitted up to that reading that the workers computed
            held = sum(f.get("waiting_prompt_tokens", 0.0) for f in r.gateways.values())
            if held:
                admitted = _growth(first.gateways, r.gateways, "prompt_tokens")
                share = min(1.0, _growth(first.workers, r.workers, "prefill_tokens") / admitted) if admitted else 1.0
                held *= share
            queued_now = float(sum(w.load.queued_prefill_tokens for w in r.fleet)) + held
            queued, peak = queued + queued_now, max(peak, queued_now)
            for w in r.fleet:
                pages += w.load.kv_usage * w.load.total_pages
                if w.role != "prefill":
                    rows += w.load.running_requests
                    context += w.load.decode_context_tokens
        n = len(self.readings)
        return Load(
            seconds=span, requests=requests, requests_per_s=requests / span,
            arrivals_per_s=_arrivals(first.gateways, last.gateways) / span,
            arrivals_beside_burst_per_s=self._arrivals_beside_burst(),
            prompt_tokens_per_s=prompt / span, computed_prompt_tokens_per_s=computed / span,
            output_tokens_per_s=g("output_tokens") / span,
            decode_streams=rows / n, decode_context=context / rows if rows else 0.0, kv_live_pages=pages / n,
            queued_prefill_tokens=queued / n, backlog_tokens=peak,
            ttft_s=g("ttft_sum") / requests if requests else None,
            itl_s=g("itl_sum") / itl_count if itl_count else None)

    def _arrivals_beside_burst(self) -> float | None:
        """Arrivals a second outside the reading interval that had the most, where that interval
        stands out as a burst; else None (the window's offered rate stands: fewer than three
        intervals, no gateway tells arrivals, or no interval past what the rest's rate explains).

        Stands out: more than twice what the other intervals' rate would bring in its time, and
        past that by three standard deviations of a Poisson count (random arrivals always have a
        busiest interval; setting it aside would read a steady overload as lighter than it is).
        An interval ends only at a reading every gateway of the last one answered in: a missed
        scrape joins the intervals on both sides of it, so its arrivals are neither lost nor
        counted in half the time."""
        gateways = set(self.readings[-1].gateways)
        if not any("finished" in f for f in self.readings[-1].gateways.values()):
            return None
        ends = [r for r in self.readings if gateways <= set(r.gateways)]
        if len(ends) < 4:
            return None
        counts = [(_arrivals(a.gateways, b.gateways), b.at - a.at) for a, b in zip(ends, ends[1:])]
        if any(s <= 0 for _, s in counts):
            return None
        burst = max(range(len(counts)), key=lambda i: counts[i][0] / counts[i][1])
        rest = [c for i, c in enumerate(counts) if i != burst]
        rate = sum(n for n, _ in rest) / sum(s for _, s in rest)
        expected = rate * counts[burst][1]
        if counts[burst][0] <= max(2 * expected, expected + 3 * math.sqrt(expected)):
            return None
        return rate
