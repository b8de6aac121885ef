"""What a split of the workers would give under the window's load, by the workers' own step-time
models (shared/perf_model/, the ones the router places by): time to first token, inter-token
latency and KV use, each against its target.

A split is (prefill, decode, both) worker counts. With a prefill and a decode worker, requests
go split: the prefill workers compute every request's uncached tokens and hand the KV over,
and the decode rows spread over the decode (and `both`) workers, whose steps carry no prefill;
except prompts mostly held where they decode (multi-turn chat), which the router prefills
there (local prefill). With `both` workers only, or for those, each worker prefills its share
of the requests beside its decode rows, in the chunks its inter-token budget allows (the
scheduler's, step_budget.py), so the prefill slows its decode steps: the share of its time
spent on prefill chunks stretches every decode step by 1 / (1 - share). A side busier than 90%
of the time is past its capacity: its predictions grow with the square of the excess (below
that, queueing is left to the correction factors: an M/M/1 queue's 1 / (1 - busy) overstates
what a closed loop of clients waits by several times, and would flip the comparison).
Predictions are scaled by how far the current split's predictions were from what the gateways
saw (Dynamo's planner's correction factors), kept by the way a split serves the load
(correction_memory.py).

The score of a split is its worst ratio to a target: TTFT / TTFT target, ITL / ITL target, KV
pages needed / 90% of the pages there are; the planner prefers the lowest (decide.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.planner.load_window import Load
from services.router.config import RoutingWeights
from shared.perf_model.prefill_time import PrefillSite
from shared.perf_model.step_budget import ItlBudget
from shared.perf_model.step_model import StepModel, StepShape
from shared.perf_model.transfer_model import TransferModel
from shared.registry.worker_info import WorkerInfo, kv_bytes_per_token

KV_LIMIT = 0.9           # a pool fuller than this evicts and retracts: a soft ceiling
CORRECTION = (0.25, 4.0)  # how far observed / predicted may move every prediction
SATURATED = 0.9          # busy share past which a worker is overloaded (_overloaded)
LOCAL = RoutingWeights()  # the router's local-prefill bounds, at their defaults


@dataclass(frozen=True, order=True)
class Split:
    prefill: int = 0
    decode: int = 0
    both: int = 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def servable(self) -> bool:
        """Something can serve a request: a prefill and a decode worker, or a `both` one."""
        return bool(self.both or (self.prefill and self.decode))

    def count(self, role: str) -> int:
        return getattr(self, role)

    def __str__(self) -> str:
        parts = [f"{n}{tag}" for n, tag in ((self.prefill, "p"), (self.decode, "d"), (self.both, "b")) if n]
        return "".join(parts) or "0"

    @classmethod
    def of(cls, roles) -> "Split":
        roles = list(roles)
        return cls(roles.count("prefill"), roles.count("decode"), roles.count("both"))


@dataclass(frozen=True)
class Fleet:
    """The workers as the models see them: one step model for all (they run on like hardware),
    their batch and KV sizes, and the targets."""

    model: StepModel
    max_batched_tokens: int
    budget_floor_tokens: int
    pages_per_worker: float
    transfer: TransferModel
    kv_bytes_per_token: float
    ttft_target_s: float
    itl_target_s: float
    budget_ttft_s: float = 0.0  # the first-token target the workers' budgets weigh their queues against
    budget_graph_rows: int = -1  # decode rows beside which the budgets still slice (step_budget.py)
    budget_graph_tokens: int = 0  # tokens a sliced step holds (step_budget.py; 0: any)
    budget_row_tokens: int = 1  # tokens a decode row takes of those (K + 1 where the workers speculate K) ...
    budget_spec_rows: int = 0   # ... beside at most this many rows
    prefill_model: StepModel | None = None  # steps carrying prompts alone (WorkerPerf.prefill_step): a
                                            # split's prefill workers; None: `model`

    @classmethod
    def of(cls, workers: list[WorkerInfo], ttft_target_s: float, itl_target_s: float) -> "Fleet | None":
        """From the registry entries; None while no worker has published a step model. Each
        target given as 0 is the workers' own (their published inter-token target)."""
        modelled = [w for w in workers if w.perf.step is not None]
        if not modelled:
            return None
        ref = max(modelled, key=lambda w: w.perf.step.samples)  # the best-fitted model
        transfers = [w.perf.transfer for w in workers if w.perf.transfer is not None]
        alone = [w.perf.prefill_step for w in workers if w.perf.prefill_step is not None]
        return cls(ref.perf.step, ref.max_batched_tokens or 8192, ref.perf.budget_floor_tokens,
                   sum(w.load.total_pages for w in workers) / len(workers),
                   max(transfers, key=lambda t: t.samples) if transfers else TransferModel(),
                   kv_bytes_per_token(ref), ttft_target_s, itl_target_s or ref.perf.itl_target_s,
                   ref.perf.ttft_target_s, ref.perf.budget_graph_rows, ref.perf.budget_graph_tokens,
                   ref.perf.budget_row_tokens, ref.perf.budget_spec_rows,
                   max(alone, key=lambda m: m.samples) if alone else None)

    @property
    def prefill_alone(self) -> StepModel:
        """The model of a step carrying prompts alone (a prefill worker's)."""
        return self.prefill_model or self.model


@dataclass(frozen=True)
class Prediction:
    split: Split
    ttft_s: float
    itl_s: float
    kv_ratio: float   # KV pages the decode rows need / the pages of the workers holding them
    ratios: tuple[float, float, float]  # ttft, itl, kv against their targets

    @property
    def score(self) -> float:
        """The worst ratio to a target (1: at the target)."""
        return max(self.ratios)

    @property
    def binding(self) -> str:
        """Which target the score comes from: ttft, itl or kv."""
        return ("ttft", "itl", "kv")[self.ratios.index(self.score)]


def _overloaded(busy: float) -> float:
    """How much longer requests wait on workers busy a share `busy` of the time: not at all up to
    SATURATED (a closed loop of clients pipelines its requests; what queueing there is, the
    correction factors take from what the gateways saw), then with the square of the excess:
    past its capacity a queue only grows."""
    return 1.0 if busy <= SATURATED else (busy / SATURATED) ** 2


def _time_shared(share: float) -> float:
    """How much slower a worker's decode steps come when a share of its time goes to prefill
    chunks: 1 / (1 - share), and past SATURATED as overloaded."""
    if share <= SATURATED:
        return 1 / (1 - share)
    return _overloaded(share) / (1 - SATURATED)


def _beside_decode(workers: int, rows: float, context: float, uncached: float, start: int, load: Load,
                   fleet: Fleet) -> tuple[float, float]:
    """(ttft_s, itl_s) when `workers` workers each prefill their share of the requests beside
    their decode rows, in the chunks their inter-token budget allows."""
    model = fleet.model
    budget = ItlBudget(fleet.itl_target_s, fleet.budget_floor_tokens, model, ttft_s=fleet.budget_ttft_s,
                       graph_rows=fleet.budget_graph_rows, graph_tokens=fleet.budget_graph_tokens) \
        if fleet.budget_floor_tokens else None
    site = PrefillSite(model, rows, context, fleet.max_batched_tokens, budget, fleet.budget_row_tokens,
                       fleet.budget_spec_rows)
    # what prefilling one request adds to the steps (a step pays its base anyway while rows run)
    extra_s = model.chunk_s(start, int(round(uncached)))
    if not rows:
        extra_s += model.coef[0] * max(1.0, uncached / fleet.max_batched_tokens)
    stretch = _time_shared(load.offered_per_s / workers * extra_s)
    return site.prefill_s(int(round(uncached)), start) * stretch, site.step_s() * stretch


SPLIT, BESIDE = "split", "beside"  # the two ways a split serves a load (way())
WAYS = (SPLIT, BESIDE)


def prefilled_locally(load: Load) -> bool:
    """Prompts mostly held where they decode (a conversation's next turn) are prefilled there:
    the router's local prefill, within its default bounds (services/router/placement.py)."""
    return (load.uncached_share <= LOCAL.local_prefill_min_share
            and load.uncached_tokens <= LOCAL.local_prefill_max_tokens)


def way(split: Split, load: Load) -> str:
    """How `split` serves the window's load: SPLIT (prefill workers compute the prompts, the decode
    steps carry none) or BESIDE (each prompt prefilled beside decode rows: `both` workers, or a
    split's local prefill of mostly cached turns). The predictions of the two differ in kind,
    and so do their errors (correction_memory.py)."""
    return SPLIT if split.prefill > 0 and split.decode > 0 and not prefilled_locally(load) else BESIDE


def raw_figures(split: Split, load: Load, fleet: Fleet) -> tuple[float, float, float]:
    """(ttft_s, itl_s, kv_ratio) of `split` by the models alone."""
    if not split.servable:
        return math.inf, math.inf, math.inf
    uncached, held = load.uncached_tokens, max(0.0, load.prompt_tokens - load.uncached_tokens)
    start = int(held)
    splitting = split.prefill > 0 and split.decode > 0
    decoders = split.decode + split.both if splitting else split.both
    rows = load.decode_streams / decoders
    context = rows * load.decode_context
    kv_ratio = load.kv_live_pages / (decoders * fleet.pages_per_worker) if fleet.pages_per_worker else 0.0
    if way(split, load) == BESIDE:
        return (*_beside_decode(decoders, rows, context, uncached, start, load, fleet), kv_ratio)
    model = fleet.model
    site = PrefillSite(fleet.prefill_alone, 0, 0, fleet.max_batched_tokens, None)  # no decode rows there
    tail = min(uncached, fleet.max_batched_tokens) * fleet.kv_bytes_per_token
    prefill_s = site.prefill_s(int(round(uncached)), start) + fleet.transfer.seconds(tail)
    ttft = prefill_s * _overloaded(load.offered_per_s * prefill_s / split.prefill)
    itl = model.step_s(StepShape(decode_rows=rows, decode_context=context))
    return ttft, itl, kv_ratio


@dataclass(frozen=True)
class Backlog:
    """The window's peak of queued prompt tokens, as the split's prefill would work it off."""

    tokens: float   # the peak (a burst of new conversations, or a rate past capacity)
    clear_s: float  # seconds its prefill takes to compute them, in full chunks
    busy: float     # share of its prefill time the rate beside the burst takes (Load.offered_beside_burst_per_s)


def backlog(split: Split, load: Load, fleet: Fleet) -> Backlog:
    """How `split` works off the window's backlog: in full chunks (a backlog widens a `both`
    worker's chunks past its inter-token budget, ttft_pressure.py) over the requests' held
    context, on the workers that prefill (the prefill workers; the decoders beside their rows
    where they prefill, as in raw_figures)."""
    if not split.servable:
        return Backlog(load.backlog_tokens, math.inf, math.inf)
    uncached, start = load.uncached_tokens, int(max(0.0, load.prompt_tokens - load.uncached_tokens))
    splitting = split.prefill > 0 and split.decode > 0
    alone = way(split, load) == SPLIT
    if alone:
        workers, rows, context = split.prefill, 0.0, 0.0
    else:
        workers = split.decode + split.both if splitting else split.both
        rows = load.decode_streams / workers
        context = rows * load.decode_context
    site = PrefillSite(fleet.prefill_alone if alone else fleet.model, int(round(rows)), int(round(context)),
                       fleet.max_batched_tokens, None)
    chunk = max(1, fleet.max_batched_tokens - int(round(rows)))
    tokens_per_s = workers * chunk / site.step_s(chunk, start)
    # busy: the rate that keeps coming beside the burst, not the burst's own arrivals (in the
    # window's offered rate they would count twice, as backlog and as rate)
    return Backlog(load.backlog_tokens, load.backlog_tokens / tokens_per_s,
                   load.offered_beside_burst_per_s * uncached / tokens_per_s)


@dataclass(frozen=True)
class Corrections:
    """observed / predicted for the current split (1 where nothing was observed)."""

    ttft: float = 1.0
    itl: float = 1.0

    @classmethod
    def of(cls, current: Split, load: Load, fleet: Fleet) -> "Corrections":
        ttft, itl, _ = raw_figures(current, load, fleet)
        lo, hi = CORRECTION

        def factor(seen, predicted):
            if seen is None or not math.isfinite(predicted) or predicted <= 0:
                return 1.0
            return min(hi, max(lo, seen / predicted))
        return cls(factor(load.ttft_s, ttft), factor(load.itl_s, itl))

    def halfway(self) -> "Corrections":
        """Half of each factor's distance from 1, in ratio (its square root): for a way of
        serving not seen lately, whose own error the current one's says only part of."""
        return Corrections(math.sqrt(self.ttft), math.sqrt(self.itl))


def predict(split: Split, load: Load, fleet: Fleet, corrections: Corrections = Corrections()) -> Prediction:
    ttft, itl, kv = raw_figures(split, load, fleet)
    ttft, itl = ttft * corrections.ttft, itl * corrections.itl
    ratios = (ttft / fleet.ttft_target_s, itl / fleet.itl_target_s if fleet.itl_target_s else 0.0, kv / KV_LIMIT)
    return Prediction(split, ttft, itl, kv, ratios)


def candidates(workers: int, fixed: Split = Split()) -> list[Split]:
    """The splits of `workers` the planner weighs: every worker `both`, or p prefill and the
    rest decode (p from 1 to workers - 1); with workers that cannot switch (`fixed`), only
    splits that keep them in their roles."""
    if workers < 1:
        return []
    out = [Split(0, 0, workers)] + [Split(p, workers - p, 0) for p in range(1, workers)]
    return [s for s in out if s.prefill >= fixed.prefill and s.decode >= fixed.decode and s.both >= fixed.both]
