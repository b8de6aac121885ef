"""Draft-model speculation: a smaller checkpoint with the target's tokenizer (any
architecture the engine loads) proposes K tokens autoregressively.

Per step: one extend pass brings the draft's KV up to the request's last token (the token
the target chose after the last verify, and the last accepted draft when all were
accepted; the position before it is recomputed so every sequence extends by exactly two
positions and the pass has one shape for CUDA graphs), then K - 1 decode passes. Draft
tokens stay on the device between passes: each pass's chosen tokens go into a ring and the
next pass's inputs are placeholders resolved there (ModelRunner.future_tokens, the overlap
scheduler's mechanism), so the K passes launch back to back and the host reads all K
tokens once at the end.

Greedy requests get the draft's argmax (a point mass: verification then reproduces the
plain output exactly); sampling requests draw from the draft's distribution with the
request's temperature and filters (keyed on (seed, position), apart from the target's
draws) and are verified by rejection sampling (rejection.py).

The draft's KV for the prompt is made here, on the decode side, by the first extend pass
(in chunks of at most `catch_up_tokens` a step; a request gets drafts once caught up).
Transferring it from prefill would cost as many bytes per token as the draft's KV and
make prefill workers run the draft; a draft is small by design, so computing it here is
the cheaper side and keeps prefill workers unaware of speculation."""
from __future__ import annotations

import logging

import torch

from ..batch import Batch, ScheduledReq
from ..model_config import ModelConfig
from ..model_runner import ModelRunner
from ..parallel.context import TPContext
from ..sampler import SampleRow, gumbel_noise, sampling_logprobs
from .draft_kv import DraftKV, DraftSeq, TokenView
from .rejection import draft_key
from .state import Draft

log = logging.getLogger("duet.engine.speculative")


def load_draft(engine, model_dir: str, extra_positions: int):
    """(ModelConfig, model) of a draft checkpoint on the engine's device and dtype."""
    from ..models.loader import load_model
    mc = ModelConfig.from_dir(model_dir)
    target = engine.model_config
    if mc.vocab_size < target.vocab_size:
        raise ValueError(f"draft model vocabulary ({mc.vocab_size}) is smaller than the target's "
                         f"({target.vocab_size}); the draft must share the target's tokenizer")
    if mc.is_moe:
        log.warning("draft model %s is a mixture of experts; a dense draft is usually cheaper", model_dir)
    model = load_model(mc, TPContext(), engine.dtype, engine.device, engine.max_model_len + extra_positions,
                       fused=engine.plan.kernels.value, load_format=engine.config.load_format)
    return mc, model


class DraftModelProposer:
    name = "draft"
    deterministic = False
    first_pass_len = 2  # tokens every sequence extends by in the first pass (its graph's shape)

    def __init__(self, engine, model_dir: str, k: int, max_batch: int):
        self.engine = engine
        self.k = k
        self.max_batch = max_batch  # no speculation above it: no graphs either
        self.mc, self.model = load_draft(engine, model_dir, k + 2)
        mc = self.mc
        self.kv = DraftKV(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.config.page_size, engine.dtype,
                          engine.device)
        self.runner: ModelRunner | None = None
        self.catch_up_tokens = 0
        self._cursor = 0
        self.pool_pages: int | None = None  # None: as many pages as the target's pool

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    def attach(self) -> None:
        """After the engine sized its own pool: the draft's pool (as many tokens), runner, graphs."""
        from ..attention.select import make_attention_backend
        e = self.engine
        self.kv.allocate_pool(self.pool_pages or e.layout.num_pages)
        backend = make_attention_backend(e.plan.attention.value, self.kv.pool)
        self.runner = ModelRunner(self.model, self.kv.pool, backend, e.device)
        if e.small_batch_workspace is not None:
            from ..models.layers import enable_small_batch_linears
            enable_small_batch_linears(self.model, e.small_batch_workspace, mode="auto")
        most = max(1, min(e.config.max_running_requests, self.max_batch))  # sequences a proposal drafts for
        self.capacity = most * (self.k + 1) * 2  # two proposals' tokens: one never overwrites itself
        max_bs = min(e.config.cuda_graph_max_bs, most)
        self.future = torch.zeros(self.capacity, dtype=torch.int64, device=e.device)
        self.runner.future_tokens = self.future
        self.catch_up_tokens = e.scheduler.max_batched_tokens
        graphs = e.runner.graphs
        if graphs is not None and backend.supports_cuda_graph:
            from ..cuda_graph import CudaGraphRunner
            from .uniform_graph import UniformExtendGraphs
            max_pages = -(-(e.max_model_len + self.k + 2) // e.layout.page_size)
            bs = min(graphs.max_bs, max_bs)
            self.runner.graphs = CudaGraphRunner(self.model, backend, self.kv.pool, e.device,
                                                 max_bs=bs, max_pages=max_pages, capture=graphs.capture)
            self.runner.extend_graphs = UniformExtendGraphs(self.model, backend, e.device, q_len=self.first_pass_len,
                                                            max_bs=bs, max_pages=max_pages, capture=graphs.capture)
        log.info("%s proposer: KV %d pages of %d bytes", self.name, e.layout.num_pages,
                 self.kv.bytes_per_token * e.layout.page_size)

    def release(self, req) -> None:
        seq = req.spec.draft
        if seq is not None:
            self.kv.release(seq)
            req.spec.draft = None

    # -- proposing -------------------------------------------------------------------------
    def propose(self, reqs, ks) -> list[Draft]:
        drafts = [Draft([]) for _ in reqs]
        budget = self.catch_up_tokens
        first, live = [], []  # extend items; (index, req, seq, k) that draft this step
        for i, (req, k) in enumerate(zip(reqs, ks)):
            seq = req.spec.draft
            if seq is None:
                seq = req.spec.draft = DraftSeq(TokenView(req.token_ids))
            seq.token_ids.base, seq.token_ids.tail = req.token_ids, []
            length = len(req.token_ids)
            start = min(seq.num_computed, max(length - 2, 0))
            if length - start > budget:  # catching up on a long prompt: a chunk, no draft yet
                if budget > 0 and self.kv.grow(seq, start + budget):
                    first.append(ScheduledReq(seq, start, budget))
                    seq.num_computed = start + budget
                    budget = 0
                continue
            if not self.kv.grow(seq, length + k):
                continue  # the draft pool is full: this request decodes plainly this step
            budget -= length - start
            first.append(ScheduledReq(seq, start, length - start))
            live.append((i, req, seq, k))
        if not first:
            return drafts
        chosen: dict[int, list] = {i: [] for i, *_ in live}  # ring slots per request
        probs: dict[int, list] = {i: [] for i, req, *_ in live if not req.params.greedy}
        logits = self.runner.forward(Batch(first))
        sampled = [x for x in live]  # the extend pass samples every live request (last row)
        steps = max((k for *_, k in live), default=0)
        for step in range(steps):
            if step > 0:
                sampled = [x for x in live if x[3] > step]
                items = [ScheduledReq(seq, len(req.token_ids) - 1 + step, 1) for _, req, seq, _ in sampled]
                logits = self.runner.forward(Batch(items))
            self._choose(logits, sampled, step, chosen, probs)
        for _, req, seq, k in live:
            length = len(req.token_ids)
            seq.base, seq.tentative = length, length + k - 1
            seq.num_computed = length  # until the verify says how many of its drafts stand
        slots = [s for i, *_ in live for s in chosen[i]]
        tokens = self.future[torch.tensor(slots, device=self.future.device)].tolist() if slots else []
        pos = 0
        for i, req, seq, k in live:
            drafts[i] = Draft(tokens[pos:pos + k], torch.stack(probs[i]) if i in probs else None)
            pos += k
        return drafts

    def _choose(self, logits, sampled, step, chosen, probs) -> None:
        """Pick each row's draft token on the device, put it in the ring, and append its
        placeholder to the sequence's tail (the next pass's input)."""
        vocab = self.engine.model_config.vocab_size
        logits = logits[:, :vocab].float()
        tok = logits.argmax(dim=-1)
        rows = [j for j, (_, req, _, _) in enumerate(sampled) if not req.params.greedy]
        if rows:
            dev = logits.device
            srows = [SampleRow(params=sampled[j][1].params, seed=0, position=0, prompt_ids=[], output_ids=[],
                               suppress_ids=[]) for j in rows]
            lp = sampling_logprobs(logits[rows], srows)
            keys = torch.tensor([draft_key(sampled[j][1].seed, len(sampled[j][1].token_ids) + step) for j in rows],
                                dtype=torch.int64, device=dev)
            drawn = (lp + gumbel_noise(keys, vocab)).argmax(dim=-1)
            tok = tok.index_copy(0, torch.tensor(rows, device=dev), drawn)
            for r, j in enumerate(rows):
                probs[sampled[j][0]].append(lp[r].exp())
        n = len(sampled)
        if self._cursor + n > self.capacity:
            self._cursor = 0
        start = self._cursor
        self._cursor += n
        self.future[start:start + n].copy_(tok)
        for j, (i, _, seq, _) in enumerate(sampled):
            chosen[i].append(start + j)
            seq.token_ids.tail.append(-(start + j + 1))

    def after_verify(self, items, results) -> None:
        """The draft's KV stands as far as its tokens were accepted."""
        for vi, res in zip(items, results):
            seq = vi.req.spec.draft
            if seq is not None and seq.base == vi.item.start + 1:
                seq.num_computed = min(seq.base + res.accepted, seq.tentative)
