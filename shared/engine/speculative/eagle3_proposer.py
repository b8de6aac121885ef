"""EAGLE-3 speculation: a one-layer head drafts from the target's own hidden states.

The head keeps KV of its own, one entry per target position p it has seen: built from the
target's features at p (three layers' residual stream, captured during the target's
forward) and the token at p + 1. After every speculative step the verified positions of
each decoding sequence (the accepted ones; on GPU all K + 1 rows, so the next pass has
one shape, of which only the accepted count stands) become pending entries; the next
step's first pass extends the head over them and its last valid row drafts token 0; K - 1
decode passes then feed the head its own output as the feature. Those decode entries are
scratch: the next first pass overwrites them with entries built from the target's
features. Tokens stay on the device between passes (the draft model's ring,
draft_model.py).

Entry positions are compacted (the head's own count, for both its KV slot and its rotary
position): attention scores depend only on position differences, so a head that missed
some target positions (steps run with speculation stepped aside, the prompt) just has
less context. The prompt's features stay where the prompt was computed: the head starts
from the first decode step, on a decode worker and colocated alike (so both draft the
same tokens). Shipping them with the handoff would cost three hidden rows per prompt
token on the link and make prefill workers capture them; recomputing the last prompt
position on decode would cost a row in the first verify step for one entry of context.
Nothing of the head travels with the KV handoff, and the answer is the target's either
way."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..batch import Batch, ScheduledReq
from ..model_runner import ModelRunner
from .draft_kv import DraftKV, DraftSeq, TokenView
from .draft_model import DraftModelProposer
from .eagle3 import AuxHiddenCapture, aux_layers, load_head
from .state import Draft

log = logging.getLogger("duet.engine.speculative")


@dataclass(eq=False)
class EagleSeq(DraftSeq):
    entries: list[int] = field(default_factory=list)  # token of each head entry (p + 1's token)
    pending_tokens: list[int] = field(default_factory=list)
    pending_aux: torch.Tensor | None = None  # [n, 3 x target hidden] target features
    pending_valid: int = 0  # leading pending entries that stand (the rest pad the shape)
    pending_last: int = -1  # target position of the last valid pending entry


class Eagle3Proposer(DraftModelProposer):
    name = "eagle3"

    def __init__(self, engine, head_dir: str, k: int, max_batch: int):  # noqa: no draft model to load here
        self.engine = engine
        self.k = k
        self.max_batch = max_batch
        cfg = engine.config
        fused = engine.plan.kernels.value
        # the static feature buffers cover the target's decode graphs, every verify step and the
        # prefill and mixed steps' graphs (a replay writes the buffer captured, never a new one)
        rows = max(min(cfg.cuda_graph_max_bs, cfg.max_running_requests), max(1, max_batch) * (k + 1), 64,
                   engine.plan.prefill_graphs.value or 0)
        self.raw, self.model = load_head(head_dir, engine.model, engine.dtype, engine.device,
                                         engine.max_model_len + k + 2, fused, rows,
                                         dummy=cfg.load_format == "dummy")
        layers = aux_layers(self.raw, engine.model_config.num_layers)
        if max(layers) > engine.model_config.num_layers or min(layers) < 0:
            raise ValueError(f"EAGLE-3 head reads target layers {layers}; the target has "
                             f"{engine.model_config.num_layers}")
        if self.model.target_hidden != engine.model_config.hidden_size:
            raise ValueError(f"EAGLE-3 head expects target hidden size {self.model.target_hidden}, "
                             f"the target has {engine.model_config.hidden_size}")
        self.aux = AuxHiddenCapture(layers, engine.model_config.hidden_size, rows, engine.dtype, engine.device,
                                    engine.tp)
        engine.model.aux_capture = self.aux  # before the target's graphs are captured
        c = self.model.cfg
        self.kv = DraftKV(1, c.num_kv_heads, c.head_dim, cfg.page_size, engine.dtype, engine.device)
        self.runner: ModelRunner | None = None
        self.catch_up_tokens = 0
        self._cursor = 0
        self.pool_pages: int | None = None
        log.info("EAGLE-3 head: hidden %d, draft vocabulary %d, target layers %s", self.model.hidden,
                 self.model.draft_vocab, layers)

    @property
    def first_pass_len(self) -> int:
        return self.k + 1  # the verified rows of a padded (GPU) verify step

    def release(self, req) -> None:
        seq = req.spec.draft
        if seq is not None:
            self.kv.release(seq)
            req.spec.draft = None

    # -- proposing -------------------------------------------------------------------------
    def propose(self, reqs, ks) -> list[Draft]:
        drafts = [Draft([]) for _ in reqs]
        first, live, feats = [], [], []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            seq = req.spec.draft
            # the last entry must be the one before the request's last token
            if seq is None or seq.pending_aux is None or seq.pending_last != len(req.token_ids) - 2:
                continue
            n = len(seq.pending_tokens)
            if not self.kv.grow(seq, seq.num_computed + n + k):
                continue
            nc = seq.num_computed
            del seq.entries[nc:]
            seq.entries += seq.pending_tokens
            seq.token_ids = TokenView(seq.entries)
            first.append(ScheduledReq(seq, nc, n, draft=seq.entries[nc + 1:nc + n] or None))
            feats.append(seq.pending_aux)
            live.append((i, req, seq, k))
        if not first:
            return drafts
        t = sum(it.length for it in first)
        self.model.aux_in[:t].copy_(torch.cat(feats) if len(feats) > 1 else feats[0])
        logits, pre = self.runner.forward(Batch(first))
        # each sequence's last valid row drafts token 0
        rows, row = [], 0
        for it, (_, _, seq, _) in zip(first, live):
            rows.append(row + seq.pending_valid - 1)
            row += it.length if it.draft else 1
        sel = torch.tensor(rows, device=logits.device)
        logits, pre = logits.index_select(0, sel), pre.index_select(0, sel)
        chosen: dict[int, list] = {i: [] for i, *_ in live}
        probs: dict[int, list] = {i: [] for i, req, *_ in live if not req.params.greedy}
        for _, _, seq, _ in live:  # the valid entries stand; decode passes start after them
            seq.num_computed += seq.pending_valid
            del seq.entries[seq.num_computed:]
            seq.token_ids = TokenView(seq.entries)
            seq.pending_aux, seq.pending_tokens = None, []
        sampled = list(live)
        steps = max(k for *_, k in live)
        for step in range(steps):
            if step > 0:
                keep = [j for j, x in enumerate(sampled) if x[3] > step]
                pre = pre.index_select(0, torch.tensor(keep, device=pre.device)) if len(keep) < len(sampled) else pre
                sampled = [sampled[j] for j in keep]
                self.model.own_in[:len(sampled)].copy_(pre)
                items = [ScheduledReq(seq, seq.num_computed - 1 + step, 1) for _, _, seq, _ in sampled]
                logits, pre = self.runner.forward(Batch(items))
            self._choose(logits, sampled, step, chosen, probs)
        slots = [s for i, *_ in live for s in chosen[i]]
        tokens = self.future[torch.tensor(slots, device=self.future.device)].tolist()
        pos = 0
        for i, req, seq, k in live:
            drafts[i] = Draft(tokens[pos:pos + k], torch.stack(probs[i]) if i in probs else None)
            pos += k
        return drafts

    # -- after the target's forward --------------------------------------------------------
    def after_step(self, batch, sampled: set, results_by_item: dict) -> None:
        """Capture each sequence's verified positions (features + next tokens) as pending
        entries. sampled: ids of the items that sampled; results_by_item: id(item) ->
        VerifyResult of the drafted items."""
        from .state import SpecState
        row = 0
        for it in batch.items:
            r = it.req
            start_row = row
            row += it.length
            if id(it) not in sampled or r.prefill_only or r.status.value == "finished":
                continue
            res = results_by_item.get(id(it))
            if it.draft and res is not None:
                valid = res.accepted + 1
                first_pos = it.start
            elif it.draft:  # a padded row without a real draft: its first row stands
                valid, first_pos = 1, it.start
            elif it.length == 1 and r.num_output > 1:  # a plain decode row
                valid, first_pos = 1, it.start
            else:  # a prompt chunk: the head starts from decode rows (the same split or colocated)
                continue
            n = it.length if it.draft else 1
            tokens = r.token_ids
            if first_pos + valid >= len(tokens):
                continue
            if r.spec is None:
                r.spec = SpecState(method=self.name)
            seq = r.spec.draft
            if seq is None:
                seq = r.spec.draft = EagleSeq(TokenView([]))
            pend = [tokens[p + 1] if p + 1 < len(tokens) else tokens[-1] for p in range(first_pos, first_pos + n)]
            idx = torch.arange(start_row, start_row + n, device=self.aux.buffer.device)
            seq.pending_tokens = pend
            seq.pending_aux = self.aux.rows(idx, batch.num_tokens)
            seq.pending_valid = valid
            seq.pending_last = first_pos + valid - 1

    def after_verify(self, items, results) -> None:
        pass  # after_step does the bookkeeping
