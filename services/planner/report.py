"""Every planner decision as a log line, a metric and a span event, each with the figures that
drove it: the load of the window, the current and target splits' predictions, the correction
factors and the targets."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.planner.decide import Decision, PoolStep
from services.planner.predict import Fleet, Prediction

log = logging.getLogger("duet.planner")
ROLES = ("prefill", "decode", "both")


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.decisions = Counter("duet_planner_decisions", "The planner's decisions by action and reason",
                                 ["action", "reason"], registry=registry)
        self.target_workers = Gauge("duet_planner_target_workers", "The split the planner wants, workers per role",
                                    ["role"], registry=registry)
        self.predicted_score = Gauge(
            "duet_planner_predicted_score",
            "Each split's predicted worst ratio to a target (TTFT, ITL, KV) at the last decision; 1 = at a target",
            ["split"], registry=registry)
        self.pool_replicas = Gauge("duet_planner_pool_replicas", "Replicas the planner last set per Kubernetes pool",
                                   ["pool"], registry=registry)


def _pred(p: Prediction | None) -> str:
    if p is None:
        return "-"
    return f"score {p.score:.2f} (ttft {p.ttft_s:.3f}s itl {p.itl_s * 1000:.0f}ms kv {p.kv_ratio:.2f}; {p.binding})"


def figures(decision: Decision, fleet: Fleet | None) -> dict[str, object]:
    """The decision's inputs and predictions, flat (span event attributes, and the log line)."""
    load, c = decision.load, decision.corrections
    out: dict[str, object] = {
        "action": decision.action, "reason": decision.reason,
        "current": str(decision.current), "target": str(decision.target),
        "load.window_s": round(load.seconds, 1), "load.requests": round(load.requests, 1),
        "load.requests_per_s": round(load.requests_per_s, 3), "load.arrivals_per_s": round(load.arrivals_per_s, 3),
        "load.offered_beside_burst_per_s": round(load.offered_beside_burst_per_s, 3),
        "load.prompt_tokens": round(load.prompt_tokens, 1), "load.uncached_share": round(load.uncached_share, 3),
        "load.output_tokens": round(load.output_tokens, 1), "load.decode_streams": round(load.decode_streams, 2),
        "load.kv_live_pages": round(load.kv_live_pages, 1), "load.queued_prefill_tokens": load.queued_prefill_tokens,
        "load.backlog_tokens": load.backlog_tokens,
        "correction.ttft": round(c.ttft, 3), "correction.itl": round(c.itl, 3),
    }
    for way, wc in sorted(decision.by_way.items()):  # what each way's splits were predicted by
        out[f"correction.{way}.ttft"], out[f"correction.{way}.itl"] = round(wc.ttft, 3), round(wc.itl, 3)
    if decision.backlog is not None:
        out["backlog.clear_s"] = round(decision.backlog.clear_s, 3)
        out["backlog.busy"] = round(decision.backlog.busy, 3)
    if load.ttft_s is not None:
        out["observed.ttft_s"] = round(load.ttft_s, 4)
    if load.itl_s is not None:
        out["observed.itl_s"] = round(load.itl_s, 4)
    if fleet is not None:
        out["target.ttft_s"] = fleet.ttft_target_s
        out["target.itl_s"] = fleet.itl_target_s
    for split, p in sorted(decision.predictions.items()):
        out[f"predicted.{split}.score"] = round(p.score, 4)
        out[f"predicted.{split}.ttft_s"] = round(p.ttft_s, 4)
        out[f"predicted.{split}.itl_s"] = round(p.itl_s, 4)
    return out


def report(decision: Decision, fleet: Fleet | None, metrics: PlannerMetrics, span) -> None:
    metrics.decisions.labels(action=decision.action, reason=decision.reason).inc()
    for role in ROLES:
        metrics.target_workers.labels(role=role).set(decision.target.count(role))
    for split, p in decision.predictions.items():
        metrics.predicted_score.labels(split=str(split)).set(p.score if p.score != float("inf") else 1e9)
    attrs = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in figures(decision, fleet).items()}
    span.add_event("decision", attrs)
    load = decision.load
    seen = (f"; observed ttft {load.ttft_s:.3f}s" if load.ttft_s is not None else "") + \
        (f" itl {load.itl_s * 1000:.0f}ms" if load.itl_s is not None else "")
    b = decision.backlog
    queued = (f"; backlog {b.tokens:.0f} tokens, cleared in {b.clear_s:.1f}s at prefill busy {b.busy:.2f}"
              if b is not None and b.tokens > 0 else "")
    targets = f"; targets ttft {fleet.ttft_target_s:.3f}s itl {fleet.itl_target_s * 1000:.0f}ms" if fleet else ""
    if decision.by_way:
        seen += "; corrections " + ", ".join(f"{way} ttft {c.ttft:.2f} itl {c.itl:.2f}"
                                             for way, c in sorted(decision.by_way.items()))
    log.info("planner %s (%s): %s -> %s; now %s; target %s%s; load %.1f requests in %.0fs (%.2f/s offered), "
             "%.0f prompt tokens (%.0f%% uncached), %.0f out, %.1f decode streams%s%s%s", decision.action,
             decision.reason, decision.current, decision.target, _pred(decision.prediction(decision.current)),
             _pred(decision.prediction(decision.target)), _runner_up(decision), load.requests, load.seconds,
             load.offered_per_s, load.prompt_tokens,
             100 * load.uncached_share, load.output_tokens, load.decode_streams, queued, seen, targets)


def _runner_up(decision: Decision) -> str:
    """Where the current split is kept as the best, the next best and its prediction (what it won by)."""
    if decision.target != decision.current:
        return ""
    others = [p for s, p in decision.predictions.items() if s != decision.current]
    if not others:
        return ""
    best = min(others, key=lambda p: (p.score, p.split))
    return f"; next {best.split} {_pred(best)}"


def report_pool(step: PoolStep, pool: str, replicas: int, metrics: PlannerMetrics, span) -> None:
    metrics.decisions.labels(action="scale", reason=step.reason).inc()
    metrics.pool_replicas.labels(pool=pool).set(replicas)
    span.add_event("scale", {"pool": pool, "delta": step.delta, "replicas": replicas, "reason": step.reason,
                             "predicted.split": str(step.prediction.split),
                             "predicted.score": round(step.prediction.score, 4)})
    log.info("planner scale (%s): pool %s %+d -> %d replicas; best split then %s, %s", step.reason, pool,
             step.delta, replicas, step.prediction.split, _pred(step.prediction))
