"""Where a request's prefill runs, by predicted latency (conditional disaggregation).

For each request the router weighs, with the chosen decode worker D:
- `split`: a prefill worker P computes what it does not hold and hands D the KV;
- `local_prefill`: D computes the rest of a prompt it mostly holds, beside its decode rows;
- `colocated`: a `both` worker, where one is live, does the whole request.

Each option gets a predicted time to first token: the prefill queued ahead on that worker
plus this prompt's uncached tokens, step by step through the worker's published step-time
model (shared/perf_model/prefill_time.py, which runs the worker's own inter-token budget beside
its decode rows), plus for `split` the KV handoff tail by P's transfer model. And its cost to
the decode rows running where the prefill runs: how much their step grows. An option whose
step would pass the inter-token target (the router's `--slo-itl-ms`, else the worker's)
while it has rows running is held back. The lowest predicted TTFT among the rest wins;
predictions closer than their models' error are a tie, won by the option without a transfer
(local prefill, then colocated). So a
decode worker holding 97% of a conversation prefills the rest while its batch is light, and
hands it to an idle prefill worker once its batch is heavy (DistServe's and Dynamo's planner's
latency models; Dynamo's and llm-d's deciders use fixed thresholds instead).

`--local-prefill-min-share` / `--local-prefill-max-tokens` bound `local_prefill`, with one
exception, overflow (`--placement-overflow`: off for a router alone, on where the planner runs:
`duet up`, the k8s planner component). When prefill queued on P, with the
prompts the gateway's admission holds back for the prefill workers (the route request's
`admission_waiting_tokens`: the admission lets only a couple of prefill steps' worth reach the
workers, so on two H200s P's own queue never looked past the target and overflow did not engage),
puts the split past the first-token target (a long-prompt rate past what the prefill workers keep
up with; not a prompt that is long alone, which D would not serve sooner either) and D would give
the first token sooner than the split or within the target, D takes the prompt whatever it holds,
as long as the prefill queued on D
(this prompt included) leaves its decode rows' mean step within the inter-token target: over the
first-token target's span T, q seconds of prefill stretch the steps by 1 / (1 - q / T), so q may
reach T x (1 - step / target). A single step may pass the target (a GPU worker beside more rows
than its graphs hold takes a prompt in one eager step, step_budget.py); what a stream's time per
output token sees is the mean. So the decode GPU's spare time would serve prompts the prefill
GPU cannot, instead of the queue growing on one side while the other has room (on two H200s one
prefill GPU saturates near 9 req/s of 4096-token prompts while decode's steps sit at half the
target). `--placement threshold` keeps the older rule (policy.local_prefill_reason: within those
bounds, always local), which is also the fallback while a worker has published no model."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.router.config import RoutingWeights
from services.router.inflight import WorkerInflight
from services.router.policy import DecodeChoice, PrefillChoice, local_prefill_reason
from shared.perf_model.prefill_time import PrefillSite
from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.transfer_model import TransferModel
from shared.registry.worker_info import WorkerInfo, kv_bytes_per_token

_NO_LOAD = WorkerInflight()
KINDS = ("local_prefill", "colocated", "split")  # preference on equal predictions: no transfer first
MAX_TIE_MARGIN = 0.25  # predictions within this much (or their models' error, if less) are equal


@dataclass(frozen=True)
class Option:
    kind: str            # split | local_prefill | colocated
    worker_id: str       # where the prefill runs
    ttft_s: float        # predicted time to first token
    step_s: float        # predicted step of the worker running the decode rows, with this option
    itl_impact_s: float  # how much that step grows because of this option
    allowed: bool        # within the inter-token target (or no decode rows to slow down)
    error: float = 0.0   # the relative error of the model(s) behind ttft_s


@dataclass(frozen=True)
class Placement:
    kind: str                 # split | local_prefill | colocated
    code: str                 # why, a label: threshold no_model bounds lowest_ttft itl_target overflow
    detail: str               # the route reply's reason, figures included
    chosen: Option | None = None   # None: by the threshold rule
    options: list[Option] = field(default_factory=list)
    target_s: float = 0.0


def _site(worker: WorkerInfo, inflight: WorkerInflight, alone: bool = False) -> PrefillSite | None:
    """The worker as its registry entry and this router's in-flight count describe it now;
    alone: a prefill worker computing prompts alone, by its model of such steps where it
    published one (a switchable worker's whole model may be fitted to its mixed steps as `both`)."""
    model = (worker.perf.prefill_step or worker.perf.step) if alone else worker.perf.step
    if model is None:
        return None
    counted = worker.load.running_requests + worker.load.waiting_requests
    # what the last heartbeat counted, less what ended since (this router's releases), or what
    # this router has routed there and not released, whichever is more
    reported = max(0, counted - inflight.released_since_report)
    rows = max(reported, inflight.decode_requests) if worker.role != "prefill" else 0
    context = worker.load.decode_context_tokens * reported // counted if counted else 0
    if reported and rows > reported:  # routed here since the last heartbeat: at the mean context
        context += (rows - reported) * context // reported
    # the worker's budget as it runs it (step_budget.py), its first-token target included; the
    # queued requests' own waits are not in the registry entry: prefill_time.py says what that skews
    budget = ItlBudget(worker.perf.itl_target_s, worker.perf.budget_floor_tokens, model,
                       ttft_s=worker.perf.ttft_target_s, graph_rows=worker.perf.budget_graph_rows,
                       graph_tokens=worker.perf.budget_graph_tokens) \
        if worker.perf.budget_floor_tokens > 0 else None
    return PrefillSite(model, rows, context, worker.max_batched_tokens or 8192, budget, worker.perf.budget_row_tokens,
                       worker.perf.budget_spec_rows)


def _queued(worker: WorkerInfo, inflight: WorkerInflight) -> int:
    return max(worker.load.queued_prefill_tokens, inflight.prefill_tokens)


def predict_here(kind: str, worker: WorkerInfo, cached: int, prompt_tokens: int,
                 inflight: dict[str, WorkerInflight], target_s: float) -> Option | None:
    """The prefill of the prompt's uncached rest on the worker that will also decode it."""
    local = inflight.get(worker.worker_id, _NO_LOAD)
    site = _site(worker, local)
    if site is None:
        return None
    rest = prompt_tokens - cached
    ahead = site.prefill_s(_queued(worker, local))
    ttft = ahead + site.prefill_s(rest, cached, waited_s=ahead)
    base = site.step_s()
    step = site.step_s(site.chunk(rest, cached, ahead), cached)
    allowed = site.decode_rows == 0 or step <= target_s
    return Option(kind, worker.worker_id, ttft, step, step - base if site.decode_rows else 0.0, allowed,
                  site.model.rel_error)


def predict_split(prefill: PrefillChoice, decode: DecodeChoice, prompt_tokens: int,
                  inflight: dict[str, WorkerInflight]) -> Option | None:
    """Prefill on a prefill worker, then the handoff of the last chunk's KV to decode."""
    p_load = inflight.get(prefill.worker.worker_id, _NO_LOAD)
    p_site = _site(prefill.worker, p_load, alone=True)
    if p_site is None:
        return None
    ttft = p_site.prefill_s(_queued(prefill.worker, p_load)) + p_site.prefill_s(prefill.uncached_tokens,
                                                                                prefill.cached_tokens)
    # pages stream out as chunks finish: the first token waits for the last chunk's pages
    tail = min(prompt_tokens - decode.cached_tokens, p_site.max_batched_tokens)
    transfer = prefill.worker.perf.transfer or TransferModel()
    ttft += transfer.seconds(tail * kv_bytes_per_token(decode.worker))
    d_site = _site(decode.worker, inflight.get(decode.worker.worker_id, _NO_LOAD))
    step = impact = 0.0
    if d_site is not None:  # the request joins decode's batch as one more row
        joined = PrefillSite(d_site.model, d_site.decode_rows + 1, d_site.decode_context + prompt_tokens)
        step = joined.step_s()
        impact = step - d_site.step_s()
    return Option("split", prefill.worker.worker_id, ttft, step, impact, True, p_site.model.rel_error)


def overflow_option(prefill: PrefillChoice, decode: DecodeChoice, split: Option, prompt_tokens: int,
                    inflight: dict[str, WorkerInflight], target_s: float, backlog_tokens: int = 0) -> Option | None:
    """Local prefill beyond the bounds (the module's overflow rule), or None: prefill queued on P,
    with the prompts waiting for it in the gateway's admission (backlog_tokens), puts the split
    past the first-token target, D gives this prompt's first token sooner than the split or
    within the target, and D's queued prefill keeps its rows' mean step within target_s."""
    horizon = decode.worker.perf.ttft_target_s
    p_load = inflight.get(prefill.worker.worker_id, _NO_LOAD)
    queued = _queued(prefill.worker, p_load)
    if horizon <= 0 or queued + backlog_tokens <= 0:
        return None
    behind = split.ttft_s  # when P would clear what is queued for it, this prompt's share included
    if backlog_tokens > 0:
        p_site = _site(prefill.worker, p_load, alone=True)
        behind += p_site.prefill_s(queued + backlog_tokens) - p_site.prefill_s(queued)
    if behind <= horizon:
        return None
    here = predict_here("local_prefill", decode.worker, decode.cached_tokens, prompt_tokens, inflight, target_s)
    if here is None or (here.ttft_s >= split.ttft_s and here.ttft_s > horizon):
        return None
    load = inflight.get(decode.worker.worker_id, _NO_LOAD)
    site = _site(decode.worker, load)
    if site.decode_rows:
        queued_s = site.model.chunk_s(0, _queued(decode.worker, load)) + site.model.chunk_s(
            decode.cached_tokens, prompt_tokens - decode.cached_tokens)
        if queued_s >= horizon or site.step_s() / (1 - queued_s / horizon) > target_s:
            return None
    return replace(here, allowed=True)


def within_bounds(decode: DecodeChoice, prompt_tokens: int, weights: RoutingWeights) -> bool:
    return bool(local_prefill_reason(decode, prompt_tokens, weights))


def place(decode: DecodeChoice, prefill: PrefillChoice, prompt_tokens: int, *,
          inflight: dict[str, WorkerInflight], weights: RoutingWeights, target_s: float = 0.0,
          colocated: PrefillChoice | None = None, backlog_tokens: int = 0) -> Placement:
    """Split, local prefill on `decode`, or `colocated` (the best `both` worker, with the
    prompt tokens it holds); target_s > 0 overrides the workers' published targets;
    backlog_tokens: prompt tokens waiting in the sending gateway's admission (overflow)."""
    threshold = local_prefill_reason(decode, prompt_tokens, weights)
    split_detail = (f"split: decode {decode.worker.worker_id} holds {decode.cached_tokens} of {prompt_tokens} "
                    f"prompt tokens, prefill {prefill.worker.worker_id} {prefill.cached_tokens}")
    if weights.placement == "threshold":
        return Placement("local_prefill" if threshold else "split", "threshold", threshold or split_detail)
    target = target_s or decode.worker.perf.itl_target_s
    split = predict_split(prefill, decode, prompt_tokens, inflight)
    if threshold:
        local = predict_here("local_prefill", decode.worker, decode.cached_tokens, prompt_tokens, inflight, target)
    else:  # beyond the bounds: an option only as overflow
        local = overflow_option(prefill, decode, split, prompt_tokens, inflight, target, backlog_tokens) \
            if weights.overflow and split is not None else None
    overflow = local is not None and not threshold
    options = [o for o in (
        split, local,
        predict_here("colocated", colocated.worker, colocated.cached_tokens, prompt_tokens, inflight,
                     target_s or colocated.worker.perf.itl_target_s) if colocated is not None else None,
    ) if o is not None]
    kinds = {o.kind for o in options}
    if threshold and not {"split", "local_prefill"} <= kinds:  # a worker has no model yet
        return Placement("local_prefill", "no_model", threshold + " (no step-time model yet: by threshold)",
                         options=options, target_s=target)
    allowed = [o for o in options if o.allowed]
    if not allowed or (not threshold and not overflow and "colocated" not in kinds):
        chosen = next((o for o in options if o.kind == "split"), None)
        return Placement("split", "bounds" if not threshold else "itl_target", split_detail + _figures(options, target),
                         chosen, options, target)
    chosen, fastest = _fastest(allowed), _fastest(options)
    code = "lowest_ttft" if chosen.kind == fastest.kind else "itl_target"
    if chosen.kind == "local_prefill" and not threshold:
        code = "overflow"
        waiting = f" ({backlog_tokens} prompt tokens waiting at the gateway)" if backlog_tokens else ""
        head = (f"overflow: the split misses the first-token target{waiting}; decode {decode.worker.worker_id} "
                f"prefills {prompt_tokens - decode.cached_tokens} of {prompt_tokens} prompt tokens itself")
    elif chosen.kind == "local_prefill":
        head = threshold
    elif chosen.kind == "colocated":
        head = (f"colocated: {chosen.worker_id} holds {colocated.cached_tokens} of {prompt_tokens} "
                f"prompt tokens")
    else:
        head = split_detail
    return Placement(chosen.kind, code, head + _figures(options, target), chosen, options, target)


def _fastest(options: list[Option]) -> Option:
    """The lowest predicted TTFT; predictions closer than their models' error are a tie,
    which goes to the option without a transfer (KINDS' order): two workers' models fitted
    apart differ by that much even where the workers are alike."""
    best = min(options, key=lambda o: (o.ttft_s, KINDS.index(o.kind)))
    margin = min(MAX_TIE_MARGIN, max(o.error for o in options))
    return min((o for o in options if o.ttft_s <= best.ttft_s * (1 + margin)), key=lambda o: KINDS.index(o.kind))


def _figures(options: list[Option], target_s: float) -> str:
    if not options:
        return ""
    parts = [f"{o.kind} {o.ttft_s * 1000:.1f} ms" + ("" if o.allowed else " (over the target)") for o in options]
    steps = "; ".join(f"{o.kind} step {o.step_s * 1000:.1f} ms (+{o.itl_impact_s * 1000:.1f})" for o in options
                      if o.step_s)
    return f"; predicted TTFT {', '.join(parts)}" + (f"; {steps}" if steps else "") + \
        f"; inter-token target {target_s * 1000:.0f} ms"
