"""The speculative step: draft, verify K + 1 positions per sequence in one forward, append
what stands.

Engine.step hands a step here when speculation is on and the policy (policy.py) wants it.
The step is synchronous: a draft needs the tokens accepted by the step before (n-gram
lookups read them, a draft model extends from them) and the next step's positions depend
on how many were accepted, so it cannot be built while the device still runs the last one.
Overlap scheduling therefore steps aside for speculating batches (the engine settles the
launched step first); it returns when speculation does (large batches, low acceptance).

KV: a verified request's pages grow to cover its draft positions; the forward writes K/V
for all of them; `num_computed` then advances only over the accepted ones, so rejected
slots are scratch that the next step overwrites, and the radix tree (which caches up to
num_computed) never sees them. Requests that get no draft this step (none proposed, or
stepped aside) and prefill chunks ride in the same forward as plain rows."""
from __future__ import annotations

import contextlib
import logging

import torch

from ..batch import Batch
from ..outputs import StepOutput
from ..request import ReqStatus
from .grammar_drafts import truncate_to_grammar
from .policy import DEFAULT_MAX_BATCH, StepAsidePolicy
from .state import Draft, SpecState
from .stats import SpecStats
from .verify import VerifyItem, verify

log = logging.getLogger("duet.engine.speculative")

METHODS = ("ngram", "draft", "eagle3")
MAX_TOKENS = 16


class Speculator:
    def __init__(self, engine, config):
        method = config.speculative_method
        if method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {method!r}")
        k = int(config.speculative_tokens)
        if not (1 <= k <= MAX_TOKENS):
            raise ValueError(f"speculative tokens must be in [1, {MAX_TOKENS}], got {k}")
        self.engine = engine
        self.method = method
        self.k = k
        self.accept_all = bool(config.speculative_accept_all)
        if self.accept_all:
            log.warning("speculative_accept_all is on: every draft token is accepted unchecked "
                        "(benchmarks only; the output is NOT the model's)")
        self.policy = StepAsidePolicy(
            max_batch=config.speculative_max_batch if config.speculative_max_batch is not None else DEFAULT_MAX_BATCH,
            min_acceptance=config.speculative_min_acceptance)
        self.stats = SpecStats(method)
        self.rejection_fn = None  # the Triton kernel on GPUs (set by attach)
        if method == "ngram":
            from .ngram import NgramProposer
            self.proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
        elif method == "draft":
            if not config.speculative_draft_model:
                raise ValueError("speculative method 'draft' needs a draft model folder (speculative_draft_model)")
            from .draft_model import DraftModelProposer
            self.proposer = DraftModelProposer(engine, config.speculative_draft_model, k, self.policy.max_batch)
        else:
            if not config.speculative_draft_model:
                raise ValueError("speculative method 'eagle3' needs an EAGLE-3 head folder (speculative_draft_model)")
            if engine.tp.size > 1:  # its feature capture would all-reduce on rank 0 alone
                raise ValueError("speculative method 'eagle3' runs with tensor parallelism 1 only; "
                                 "use ngram or draft with --tp > 1")
            from .eagle3_proposer import Eagle3Proposer
            self.proposer = Eagle3Proposer(engine, config.speculative_draft_model, k, self.policy.max_batch)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes the proposer keeps per token (taken out of the target's KV budget)."""
        return getattr(self.proposer, "kv_bytes_per_token", 0)

    def attach(self) -> None:
        """Once the engine has its pool and runner: the proposer's own state, GPU kernels."""
        e = self.engine
        if hasattr(self.proposer, "attach"):
            self.proposer.attach()
        graphs = e.runner.graphs
        # with TP the other ranks run the same verify steps eagerly (they replay no graphs of
        # their own), so rank 0 does too: every rank launches the same collectives
        if graphs is not None and e.backend.supports_cuda_graph and e.tp.size == 1:
            from .uniform_graph import UniformExtendGraphs
            e.runner.extend_graphs = UniformExtendGraphs(
                e.model, e.backend, e.device, q_len=self.k + 1, max_bs=min(graphs.max_bs, max(1, self.policy.max_batch)),
                max_pages=graphs.max_pages, capture=graphs.capture)
        if e.plan.kernels.value:
            from kernels.rejection_sample import rejection_sample
            self.rejection_fn = rejection_sample
        log.info("speculative decoding: %s, %d draft tokens, steps aside above batch %d or below "
                 "acceptance %.2f", self.method, self.k, self.policy.max_batch, self.policy.min_acceptance)

    @contextlib.contextmanager
    def warming(self):
        """Warm-up: every decoding sequence drafts (n-gram lookups that find nothing propose
        their last token), so the verify shapes compile and capture before serving; the
        step-aside state starts fresh afterwards."""
        fill = hasattr(self.proposer, "fill_when_empty")
        if fill:
            self.proposer.fill_when_empty = True
        max_batch, min_acc = self.policy.max_batch, self.policy.min_acceptance
        self.policy.min_acceptance = 0.0
        try:
            yield
        finally:
            if fill:
                self.proposer.fill_when_empty = False
            self.policy = StepAsidePolicy(max_batch=max_batch, min_acceptance=min_acc)

    def reset_stats(self) -> None:
        """Counters from zero (after the warm-up: metrics count served work only)."""
        self.stats = SpecStats(self.method)

    def detach(self) -> None:
        """Stop speculating on this engine (benchmarks swap methods on one loaded target)."""
        e = self.engine
        e.runner.extend_graphs = None
        if getattr(e.model, "aux_capture", None) is getattr(self.proposer, "aux", None):
            e.model.aux_capture = None
        e.spec = None

    # -- the engine's entry points ---------------------------------------------------------
    def wants_step(self) -> bool:
        running = self.engine.scheduler.running
        n = sum(1 for r in running if r.is_decoding)
        if self.policy.engine_wants(n):
            return True
        if n:
            self.stats.stepped_aside += 1
        return False

    def release(self, req) -> None:
        """A request finished: free what the proposer holds for it."""
        if req.spec is not None:
            self.proposer.release(req)

    def step(self) -> list[StepOutput]:
        e = self.engine
        outs = e.overlap.flush() if e.overlap is not None else []
        batch = e.scheduler.schedule(decode_row_tokens=self.k + 1)  # a prompt's slice leaves the drafts room
        if not batch.items:
            return outs
        items = self._attach_drafts(batch)
        self.policy.observe_step(bool(items))
        after_step = getattr(self.proposer, "after_step", None)
        if not items and (after_step is None or any(it.all_rows for it in batch.items)):
            return outs + e._run_batch(batch)
        sampled = {id(it) for it in batch.items if it.samples}  # before any token is appended
        logits = e.runner.forward(batch)
        e.track_kv_written(batch)
        e.stats.steps += 1
        plain = [it for it in batch.items if not it.draft]
        e.count_computed(Batch(plain))
        by_item = {id(vi.item): vi for vi in items}
        plain_rows, row = [], 0
        for it in batch.items:
            if it.draft:
                by_item[id(it)].row0 = row
                row += it.length
            elif it.samples:
                plain_rows.append(row)
                row += 1
        plain_reqs = [it.req for it in plain if it.samples]
        if plain_reqs:
            sel = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
            outs += e._sample_and_append(sel, plain_reqs)
        results = verify(e, logits, items, accept_all=self.accept_all, rejection_fn=self.rejection_fn) if items else []
        if hasattr(self.proposer, "after_verify"):
            self.proposer.after_verify(items, results)
        for vi, res in zip(items, results):
            out = self._append(vi, res)
            if out is not None:
                outs.append(out)
        if after_step is not None:  # EAGLE-3: the verified positions' features
            after_step(batch, sampled, {id(vi.item): res for vi, res in zip(items, results)})
        return outs

    # -- drafting --------------------------------------------------------------------------
    def _attach_drafts(self, batch) -> list[VerifyItem]:
        e = self.engine
        if any(it.all_rows for it in batch.items):
            return []  # prompt logprobs keep the plain row layout this step
        decoding = [it for it in batch.items
                    if it.length == 1 and it.samples and it.req.num_output > 0 and not it.req.prefill_only]
        cands, ks = [], []
        for it in decoding:
            r = it.req
            if r.spec is None:
                r.spec = SpecState(method=self.method)
            if not self.policy.request_eligible(r.spec):
                continue
            k = min(self.k, r.max_new_tokens - r.num_output - 1, e.max_model_len - len(r.token_ids) - 1)
            if k > 0:
                cands.append(it)
                ks.append(k)
        if not cands:
            return []
        drafts = self.proposer.propose([it.req for it in cands], ks)
        items = []
        for it, k, d in zip(cands, ks, drafts):
            r = it.req
            toks = list(d.tokens[:k])
            if toks and r.grammar is not None:
                toks = truncate_to_grammar(r.grammar, toks)
            if not toks or not e.kv.grow(r, it.start + 1 + len(toks)):
                continue
            probs = d.probs[:len(toks)] if d.probs is not None else None
            it.draft = toks
            it.length = 1 + len(toks)
            items.append(VerifyItem(it, Draft(toks, probs)))
        if items and e.runner.extend_graphs is not None and len(decoding) == len(batch.items):
            self._pad_to_uniform(decoding, items)
        return items

    def _pad_to_uniform(self, decoding, items) -> None:
        """GPU: give every sequence K draft slots (fillers past its real draft, verified as
        nothing) so the step has one shape and replays the captured verify graph."""
        e = self.engine
        have = {id(vi.item) for vi in items}
        for it in decoding:
            r = it.req
            if it.start + 1 + self.k >= e.max_model_len or not e.kv.grow(r, it.start + 1 + self.k):
                return  # no room for the fillers: this step runs eagerly, unpadded
            real = it.draft or []
            it.draft = real + [r.token_ids[-1]] * (self.k - len(real))
            it.length = 1 + self.k
            if id(it) not in have:
                items.append(VerifyItem(it, Draft([])))

    # -- results ---------------------------------------------------------------------------
    def _append(self, vi: VerifyItem, res) -> StepOutput | None:
        """Append the tokens that stand, one by one (each stop rule sees each token), and
        merge them into one output."""
        e, r = self.engine, vi.req
        k, a = vi.k, res.accepted
        if k:
            self.stats.record(k, a)
            r.spec.stats.record(k, a)
            self.policy.observe(r.spec, k, a)
        r.num_computed = vi.item.start + 1  # the last real token's KV; drafts' below
        e.stats.decode_tokens_computed += vi.item.length
        merged = None
        for j, tok in enumerate(res.tokens):
            if j < a:
                r.num_computed += 1  # draft j stands: its KV (position start + 1 + j) is valid
            out = e._append(r, tok, res.logprobs[j], res.top_logprobs[j])
            if merged is None:
                merged = out
            else:
                merged.token_ids += out.token_ids
                merged.logprobs += out.logprobs
                merged.top_logprobs += out.top_logprobs
                for f in ("finished", "finish_reason", "stop_reason", "error", "text", "request_finished", "spec"):
                    setattr(merged, f, getattr(out, f))
            if r.status is ReqStatus.FINISHED:
                break
        return merged


def attach_speculator(engine, draft_pool_pages: int | None = None, **options) -> Speculator:
    """Start speculating on an engine built without it (benchmarks: one loaded target, several
    methods in turn). options: EngineConfig's speculative_* fields. The draft's KV pool gets
    draft_pool_pages pages (default: as many as the target's)."""
    from dataclasses import replace
    if engine.spec is not None:
        engine.spec.detach()
    spec = Speculator(engine, replace(engine.config, **options))
    if draft_pool_pages is not None and hasattr(spec.proposer, "pool_pages"):
        spec.proposer.pool_pages = draft_pool_pages
    spec.attach()
    engine.spec = spec
    return spec
