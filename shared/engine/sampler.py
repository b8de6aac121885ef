"""Token selection for a batch: penalties, temperature, top-k/top-p/min-p, and seeded
sampling that depends only on (seed, position).

Random draws come from a counter-based hash of (seed, position, token id) rather than a
stateful generator, so a request samples the same tokens whatever batch it shares, on
whichever worker (prefill or decode) makes a given position, split or colocated."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gumbel_noise import gumbel_noise

from . import logit_constraints

_M32 = 0xFFFFFFFF


def _mix64(x: int) -> int:
    """splitmix64 finaliser (host side, per request and position)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    return _mix64(_mix64(seed & 0xFFFFFFFFFFFFFFFF) ^ position) & _M32


@dataclass
class SampleRow:
    """What the sampler needs of one request for one draw."""
    params: object  # SamplingParams
    seed: int
    position: int  # index of the token being generated
    prompt_ids: list[int]
    output_ids: list[int]
    suppress_ids: list[int]  # e.g. EOS while min_tokens is not reached
    grammar: object = None  # GrammarState of a constrained request (grammar.py)
    logit_bias: dict[int, float] | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen token, under the model's distribution
    top_logprobs: list[list[tuple[int, float]]] | None


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), device=logits.device)
            vals = logits[i, ids]
            # a penalty below float32's smallest normal divides by zero: keep the logits finite,
            # or softmax turns the row into NaN and the sampler picks token 0 whatever a grammar allows
            big = torch.finfo(logits.dtype).max
            logits[i, ids] = torch.where(vals > 0, vals / p.repetition_penalty,
                                         vals * p.repetition_penalty).clamp(-big, big)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            ids = torch.tensor(r.output_ids, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                0, ids, torch.ones(len(r.output_ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k / nucleus / min-p set."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def edit_logits(logits: torch.Tensor, rows: list[SampleRow], constraints=None) -> torch.Tensor:
    """float32 logits after penalties, suppressed ids, logit bias and the grammar mask (a
    copy when anything is edited: the model's logits are an inference tensor)."""
    logits = logits.float()
    edit = logit_constraints.needs_edit(rows, constraints)
    penalize = any(r.params.uses_penalties or r.suppress_ids for r in rows)
    if edit or penalize:
        logits = logits.clone()
    if penalize:
        apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        if r.suppress_ids:
            logits[i, r.suppress_ids] = float("-inf")
    if edit:  # last: nothing after it may let a token outside the grammar back in
        logit_constraints.apply(logits, rows, constraints)
    return logits


def sampling_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Edited logits -> the log-probabilities the rows draw from: temperature, then the
    top-k / top-p / min-p filters (speculative decoding's rejection test uses them too)."""
    dev, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([max(r.params.temperature, 1e-6) for r in rows], device=dev)
    scaled = logits / temps[:, None]
    if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows):
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        scaled = filter_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    return scaled.log_softmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SampleRow], constraints=None) -> SampleResult:
    """logits [n, V] (any float dtype) -> one token per row. constraints: the rows' grammar
    bitmask (logit_constraints.prepare, filled before this is called)."""
    logits = logits.float()
    n, vocab = logits.shape
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits.log_softmax(dim=-1) if want_lp else None
    logits = edit_logits(logits, rows, constraints)
    greedy = [r.params.greedy for r in rows]
    out = logits.argmax(dim=-1)
    if not all(greedy):
        dev = logits.device
        keys = torch.tensor([draw_key(r.seed, r.position) for r in rows], dtype=torch.int64, device=dev)
        drawn = (sampling_logprobs(logits, rows) + gumbel_noise(keys, vocab)).argmax(dim=-1)
        mask = torch.tensor(greedy, device=dev)
        out = torch.where(mask, out, drawn)
    tokens = out.tolist()
    lps = tops = None
    if want_lp:
        chosen = raw_logprobs.gather(1, out[:, None]).squeeze(1).tolist()
        lps, tops = [], []
        max_n = max((r.params.logprobs or 0) for r in rows)
        top_v, top_i = raw_logprobs.topk(max(max_n, 1), dim=-1) if max_n else (None, None)
        for i, r in enumerate(rows):
            lps.append(chosen[i] if r.params.logprobs is not None else None)
            k = r.params.logprobs or 0
            tops.append(list(zip(top_i[i, :k].tolist(), top_v[i, :k].tolist())) if k else [])
    return SampleResult(tokens, lps, tops)
