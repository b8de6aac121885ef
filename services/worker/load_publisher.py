"""A worker's load, as the registry heartbeat and /metrics report it.

Runs on the engine-loop thread after each iteration (EngineLoop.after_iteration), at most
every `min_interval_s`: a snapshot walks every scheduled request for the queued prefill
tokens and sets several Prometheus series (~54 us at 128 running requests on a slow CPU), too
much for every decode step. An idle loop still wakes every 20 ms, so a scrape or heartbeat
is at most a few tens of milliseconds behind the last change (it was up to 250 ms behind a
timer before, which let a reservation made and filled within one tick read as 0)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import Counter

from shared.registry.worker_info import WorkerAdapters, WorkerLoad


def load_counters(metrics) -> tuple[Counter, Counter]:
    """The counters a LoadPublisher advances, on the worker's DuetMetrics registry."""
    computed = Counter("duet_engine_tokens_computed", "Tokens whose KV this worker computed",
                       ["phase"], registry=metrics.registry)
    recomputed = Counter("duet_kv_recomputes", "Requests decode recomputed because their KV never arrived",
                         registry=metrics.registry)
    return computed, recomputed


@dataclass
class LoadPublisher:
    ctx: object      # WorkerContext: engine, book (decode), outgoing (prefill), metrics, recomputes
    info: object     # WorkerInfo whose .load the heartbeat sends
    computed: Counter    # duet_engine_tokens_computed{phase}
    recomputed: Counter  # duet_kv_recomputes
    min_interval_s: float = 0.005
    _last: float = float("-inf")
    _load: WorkerLoad | None = None
    _counted: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    _recomputes: int = 0
    _tiers: dict[str, int] = field(default_factory=dict)  # tier counters already published

    def snapshot(self) -> WorkerLoad:
        ctx = self.ctx
        eng, s = ctx.engine, ctx.engine.scheduler
        in_handoff = (len(ctx.book.open) if ctx.book else 0) + (len(ctx.outgoing.active) if ctx.outgoing else 0)
        return WorkerLoad(free_pages=eng.kv.available, total_pages=eng.kv.capacity,
                          queued_prefill_tokens=s.queued_prefill_tokens,
                          running_requests=len(s.running) + in_handoff,
                          waiting_requests=len(s.waiting), kv_usage=eng.kv.usage_ratio,
                          # what the decode rows attend to: the router predicts their step from it
                          decode_context_tokens=sum(r.num_computed + 1 for r in s.running if r.is_decoding))

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
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
        self._publish_tiers()
        if self.ctx.engine.lora is not None:  # what the router picks by: the adapters served, those in a slot
            adapters = WorkerAdapters.of(self.ctx.engine.lora)
            if adapters != self.info.adapters:
                self.info.adapters = adapters

    def _publish_tiers(self) -> None:
        """Per-tier reuse, copies and evictions from the radix cache's counters, and what the
        tenant quotas did."""
        eng, m = self.ctx.engine, self.ctx.metrics
        kv, st = eng.kv, eng.kv.cache.stats
        host = kv.host_tier
        page_bytes = host.bytes_per_page if host is not None else 0
        series = {
            # counted once per request, at its first token (engine.stats)
            "hit:device": (m.kv_cache_hit_tokens.labels(tier="device"),
                           eng.stats.cached_tokens - eng.stats.host_cached_tokens),
            "hit:host": (m.kv_cache_hit_tokens.labels(tier="host"), eng.stats.host_cached_tokens),
            "copy:offload": (m.kv_tier_copy_bytes.labels(direction="offload"), host.bytes_saved if host else 0),
            "copy:load": (m.kv_tier_copy_bytes.labels(direction="load"), host.bytes_loaded if host else 0),
            "evict:device": (m.kv_evicted_pages.labels(tier="device"), st.device_evicted_pages),
            "evict:host": (m.kv_evicted_pages.labels(tier="host"), st.host_evicted_pages),
            "evict:quota": (m.kv_tenant_evicted_pages, st.quota_evicted_pages),
            "passed:admission": (m.kv_tenant_passed_over.labels(stage="admission"), eng.scheduler.num_passed_over),
            "passed:reserve": (m.kv_tenant_passed_over.labels(stage="reserve"),
                               self.ctx.book.num_passed_over if self.ctx.book is not None else 0),
        }
        writer = kv.cache.writer
        for (decision, reason), pages in (writer.stats.pages.items() if writer is not None else ()):
            labels = {"decision": decision, "reason": reason}
            series[f"writeback:{decision}:{reason}"] = (m.kv_host_writeback_pages.labels(**labels), pages)
            series[f"writeback-bytes:{decision}:{reason}"] = (m.kv_host_writeback_bytes.labels(**labels),
                                                              pages * page_bytes)
        for key, (counter, total) in series.items():
            if total != self._tiers.get(key, 0):
                counter.inc(total - self._tiers.get(key, 0))
                self._tiers[key] = total
        m.kv_host_pages.set(kv.cache.num_host_pages)
        if writer is not None and writer.prompts is not None:  # counted under `reused` only
            m.kv_host_continued_share.set(writer.continued_share.share)
        if host is not None:
            m.kv_host_tier_pages.labels(state="allocated").set(host.buffer.shape[0])
            m.kv_host_tier_pages.labels(state="usable").set(host.usable_pages)
        ctx = self.ctx
        idle = not eng.requests and not eng.has_work and not kv.reserved and not eng.groups.live \
            and not (ctx.book and ctx.book.open) and not (ctx.outgoing and ctx.outgoing.active)
        if idle:  # every page must be free or cached now
            m.kv_unaccounted_pages.labels(tier="device").set(
                kv.capacity - kv.allocator.num_free - kv.cache.num_cached_pages)
            if host is not None:  # copies given up wait for their copy to land: not a leak
                m.kv_unaccounted_pages.labels(tier="host").set(
                    host.capacity - host.allocator.num_free - kv.cache.num_host_pages - writer.orphan_pages)
