"""Verification: the target's logits at the K + 1 positions of each drafted request decide
how many draft tokens stand and which token follows them.

Row j of a request is scored exactly as the plain sampler would score the token at that
position had drafts 0..j-1 already been appended: penalties count them, min_tokens
suppresses EOS by the output length they make, the grammar mask is the state they lead to
(grammar_drafts.py), and the draw uses the key of that position. Point-mass drafts are
then accepted while the target's own draw equals them, so the output is token for token
what the request gets without speculation (greedy and seeded sampling alike); sampled
drafts go through rejection sampling (rejection.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rejection_sample import rejection_sample_reference

from ..batch import ScheduledReq
from ..sampler import SampleRow, draw_key, edit_logits, gumbel_noise, sampling_logprobs
from .grammar_drafts import draft_constraints
from .rejection import accept_key, uniform
from .state import Draft


@dataclass
class VerifyItem:
    item: ScheduledReq  # item.draft holds the tokens fed (maybe padded past the real draft)
    draft: Draft  # the real draft
    row0: int = 0  # first of its rows in the step's logits

    @property
    def req(self):
        return self.item.req

    @property
    def k(self) -> int:
        return len(self.draft.tokens)


@dataclass
class VerifyResult:
    accepted: int  # draft tokens that stand
    tokens: list[int]  # the accepted drafts, then the token the target chose after them
    logprobs: list  # per token (None entries when the request asked for none)
    top_logprobs: list


def draft_rows(engine, req, tokens: list[int]) -> list[SampleRow]:
    """The sampler's rows for positions len(token_ids) + j, j = 0..len(tokens)."""
    p = req.params
    base, out = len(req.token_ids), req.output_ids
    eos = engine.model_config.eos_token_ids + p.stop_token_ids
    rows = []
    for j in range(len(tokens) + 1):
        outs = out + tokens[:j] if j else out
        rows.append(SampleRow(params=p, seed=req.seed, position=base + j, prompt_ids=req.prompt_ids,
                              output_ids=outs, suppress_ids=eos if req.num_output + j < p.min_tokens else [],
                              grammar=None, logit_bias=p.logit_bias))
    return rows


def verify(engine, logits: torch.Tensor, items: list[VerifyItem], accept_all: bool = False,
           rejection_fn=None) -> list[VerifyResult]:
    """logits: the step's sampling rows; each item owns rows row0 .. row0 + k."""
    rows, idx, offsets = [], [], []
    for vi in items:
        offsets.append(len(rows))
        rows += draft_rows(engine, vi.req, vi.draft.tokens)
        idx += range(vi.row0, vi.row0 + vi.k + 1)
    dev = logits.device
    if idx != list(range(logits.shape[0])):
        logits = logits.index_select(0, torch.tensor(idx, device=dev))
    lg = logits.float()
    vocab = lg.shape[1]
    constraints = draft_constraints(engine._grammars, [(vi.req.grammar, vi.draft.tokens) for vi in items],
                                    pin=dev.type == "cuda")
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw = lg.log_softmax(dim=-1) if want_lp else None
    edited = edit_logits(lg, rows, constraints)
    greedy = [r.params.greedy for r in rows]
    tok = edited.argmax(dim=-1)
    logp = None
    if not all(greedy):
        logp = sampling_logprobs(edited, rows)
        keys = torch.tensor([draw_key(r.seed, r.position) for r in rows], dtype=torch.int64, device=dev)
        drawn = (logp + gumbel_noise(keys, vocab)).argmax(dim=-1)
        tok = torch.where(torch.tensor(greedy, device=dev), tok, drawn)
    tok_host = tok.tolist()

    accepted, finals = [], []
    rejected_items = []
    for i, vi in enumerate(items):
        off, k = offsets[i], vi.k
        if accept_all:
            a = k
        elif vi.draft.probs is not None and not vi.req.params.greedy:
            rejected_items.append(i)
            a = -1
        else:
            a = 0
            while a < k and tok_host[off + a] == vi.draft.tokens[a]:
                a += 1
        accepted.append(a)
        finals.append(tok_host[off + a] if a >= 0 else -1)
    if rejected_items:
        acc, fin = _rejection(items, rejected_items, offsets, rows, logp, rejection_fn)
        for i, a, f in zip(rejected_items, acc, fin):
            accepted[i], finals[i] = a, f

    results = []
    max_top = max((r.params.logprobs or 0) for r in rows)
    for i, vi in enumerate(items):
        a = accepted[i]
        tokens = vi.draft.tokens[:a] + [finals[i]]
        lps, tops = [None] * len(tokens), [[] for _ in tokens]
        if vi.req.params.logprobs is not None:
            r0 = offsets[i]
            sel = torch.arange(r0, r0 + len(tokens), device=dev)
            chosen = raw[sel].gather(1, torch.tensor(tokens, device=dev)[:, None]).squeeze(1).tolist()
            lps = chosen
            n_top = vi.req.params.logprobs
            if n_top:
                v, ix = raw[sel].topk(max(max_top, 1), dim=-1)
                tops = [list(zip(ix[j, :n_top].tolist(), v[j, :n_top].tolist())) for j in range(len(tokens))]
        results.append(VerifyResult(a, tokens, lps, tops))
    return results


def _rejection(items, which, offsets, rows, logp, rejection_fn):
    """Batch the sampled-draft requests for the rejection sampler (kernel or reference)."""
    dev = logp.device
    K = max(items[i].k for i in which)
    V = logp.shape[1]
    B = len(which)
    tl = torch.full((B, K + 1, V), float("-inf"), device=dev)
    dp = torch.zeros((B, K, V), device=dev)
    dt = torch.zeros((B, K), dtype=torch.int64, device=dev)
    u = torch.ones((B, K), dtype=torch.float64, device=dev)
    keys = torch.zeros((B, K + 1), dtype=torch.int64, device=dev)
    nd = []
    for b, i in enumerate(which):
        vi, off, k = items[i], offsets[i], items[i].k
        tl[b, :k + 1] = logp[off:off + k + 1]
        dp[b, :k] = vi.draft.probs[:k].to(dev, torch.float32)
        dt[b, :k] = torch.tensor(vi.draft.tokens, device=dev)
        ak = [accept_key(rows[off + j].seed, rows[off + j].position) for j in range(k)]
        u[b, :k] = uniform(torch.tensor(ak, dtype=torch.int64)).to(dev)
        keys[b, :k + 1] = torch.tensor([draw_key(rows[off + j].seed, rows[off + j].position)
                                        for j in range(k + 1)], device=dev)
        nd.append(k)
    fn = rejection_fn or rejection_sample_reference
    acc, fin = fn(tl, dp, dt, torch.tensor(nd, device=dev), u, keys)
    return acc.tolist(), fin.tolist()
