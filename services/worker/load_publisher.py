"""A worker's load, as the registry heartbeat and /metrics report it.

Runs on the engine-loop thread after every iteration (EngineLoop.after_iteration), so the
gauges and the heartbeat's load change as soon as a reservation, a step or a free does:
a scrape is never older than the last change. Costs a few attribute reads per iteration
plus one pass over the scheduled requests for the queued prefill tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter

from shared.registry.worker_info import WorkerLoad


@dataclass
class LoadPublisher:
    ctx: object      # WorkerContext: engine, book (decode), outgoing (prefill), metrics, recomputes
    info: object     # WorkerInfo whose .load the heartbeat sends
    computed: Counter    # duet_engine_tokens_computed{phase}
    recomputed: Counter  # duet_kv_recomputes
    _load: WorkerLoad | None = None
    _counted: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    _recomputes: int = 0

    def snapshot(self) -> WorkerLoad:
        ctx = self.ctx
        eng, s = ctx.engine, ctx.engine.scheduler
        in_handoff = (len(ctx.book.open) if ctx.book else 0) + (len(ctx.outgoing.active) if ctx.outgoing else 0)
        return WorkerLoad(free_pages=eng.kv.available, total_pages=eng.kv.capacity,
                          queued_prefill_tokens=s.queued_prefill_tokens,
                          running_requests=len(s.running) + in_handoff,
                          waiting_requests=len(s.waiting), kv_usage=eng.kv.usage_ratio)

    def __call__(self) -> None:
        load = self.snapshot()
        if load != self._load:
            self._load = self.info.load = load
            self.ctx.metrics.set_load(kv_usage=load.kv_usage, queued_prefill_tokens=load.queued_prefill_tokens,
                                      running_requests=load.running_requests,
                                      waiting_requests=load.waiting_requests)
        stats = self.ctx.engine.stats
        for phase, total in (("prefill", stats.prefill_tokens_computed), ("decode", stats.decode_tokens_computed)):
            if total != self._counted[phase]:
                self.computed.labels(phase=phase).inc(total - self._counted[phase])
                self._counted[phase] = total
        if self.ctx.recomputes != self._recomputes:
            self.recomputed.inc(self.ctx.recomputes - self._recomputes)
            self._recomputes = self.ctx.recomputes
