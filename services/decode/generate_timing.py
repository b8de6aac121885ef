"""One Generate call timed from this worker's side: the token latencies of its phase (decode
after a KV handoff, or both: the prompt computed here too) as its messages are sent, and its
queue and compute spans when it ends. Everything here runs on the handler's event loop; the
engine thread only stamps the Req (when it arrived, when a step first computed for it)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.worker_runtime.phase_spans import EpochClock, PhaseTimes, queue_and_compute
from shared.telemetry.token_latency import TokenLatency


@dataclass
class GenerateTiming:
    latency: TokenLatency
    req: object = None  # the engine's Req once the request joined (set on the engine loop)
    recomputed: bool = False  # after a handoff whose KV never came: the prompt computed here
    outputs: dict[int, int] = field(default_factory=dict)  # engine outputs with tokens, by sequence

    @classmethod
    def start(cls, metrics, split: bool) -> "GenerateTiming":
        """metrics: the worker's DuetMetrics; the call arrives now."""
        return cls(TokenLatency(metrics.latency("decode" if split else "both"), time.monotonic()))

    def output(self, out) -> None:
        """An engine output (a StepOutput) going into the next message."""
        if out.token_ids:
            self.outputs[out.index] = self.outputs.get(out.index, 0) + 1

    def sent(self, tokens: int) -> None:
        """A message with `tokens` tokens is being sent."""
        self.latency.observe(tokens)

    def finished(self) -> None:
        """The request ended normally: arrival to its last token."""
        self.latency.finish()

    def spans(self, tracer, parent, rid: str) -> None:
        """queue and compute under `parent` (the `decode` span), compute to the last token sent."""
        if self.req is None:  # it never joined the engine (refused, or ended at its first token)
            return
        req = self.req
        end = self.latency.last_at if self.latency.last_at is not None else time.monotonic()
        queue_and_compute(tracer, parent, PhaseTimes.of(req, end), EpochClock(), {
            "duet.request_id": rid, "duet.prompt_tokens": req.num_prompt, "duet.cached_tokens": req.num_cached_tokens,
            "duet.output_tokens": self.latency.tokens, "duet.steps": max(self.outputs.values(), default=0),
            "duet.recomputed": self.recomputed})
