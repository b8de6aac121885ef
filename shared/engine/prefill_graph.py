"""CUDA graphs for small prefill steps and mixed steps: a conversation's next turn, a short
prompt, a prompt's chunk beside the running streams' decode rows.

A step of a few hundred tokens is as host-bound as a decode step: 36 layers of kernels
launched one by one from Python take several times what reading the weights does. A
follow-up turn's first token is mostly that step (docs/performance/multiturn.md), and on a
colocated or decode worker every step that admits a prompt beside the running streams was
such an eager step (two to four times a decode step on an 8B model: the streams' TPOT over
their decode step, docs/performance/serving.md). So, as decode graphs do (cuda_graph.py),
steps of up to `max_seqs` sequences (the decode graphs' rows and a few prompts) and
`max_tokens` tokens replay a graph captured for the next token bucket up.

Every graph has the same max_seqs + 1 sequences over static buffers; a step fills the first
n, gives the unused ones no tokens, and the last one, the padding sequence, takes the
bucket's remaining tokens: positions from 0 over the padding page (zeros, never written),
slot -1 (nothing stored). The extend attention runs over a work list computed inside the
graph from the step's offsets (one program per sequence's block of queries, so unused
sequences cost nothing), and the step's leading decode rows go through the flash-decoding
kernel instead (counted on the device; the work list skips them), so the captured launches
fit any step of the bucket. The padding rows are computed and dropped; the real rows' numbers are those
of an eager step of the same token count (capture=False runs these padded shapes eagerly)."""
from __future__ import annotations

import logging
import time

import torch

from kernels.extend_attention import extend_work_items, leading_decode_rows, work_block_m

from .attention.metadata import AttentionMetadata
from .cuda_graph import capture_ladder
from .kv_pool import PADDING_PAGE

log = logging.getLogger("duet.engine.prefill_graph")

MAX_SEQS = 8  # prompts (sequences beyond the decode rows) a captured step holds


def graph_seqs(max_tokens: int, decode_rows: int) -> int:
    """Sequences a captured step holds: the decode graphs' largest batch and MAX_SEQS prompts
    beside them, at most one a token."""
    return max(1, min(max_tokens, decode_rows + MAX_SEQS))


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 64, then every eighth of the largest power of two up to max_tokens
    (itself the last): 64, 128, 192, ... 512 for 512. A step pads to its bucket and a padded
    token costs what a real one does (a step of a few hundred rows is compute-bound on a large
    model), so the buckets stay fine where mixed steps are (decode rows and a prompt or two)."""
    if max_tokens <= 0:
        return []
    step = max(64, (1 << (max_tokens.bit_length() - 1)) // 8)
    out, t = [], 64
    while t < step and t < max_tokens:
        out.append(t)
        t *= 2
    out += list(range(step, max_tokens, step))
    return out + [max_tokens]


class PrefillGraphs:
    def __init__(self, model, backend, device: torch.device, max_tokens: int, max_pages: int,
                 capture: bool = True, max_seqs: int = MAX_SEQS):
        from .model_runner import ForwardBatch

        self.model, self.backend, self.device = model, backend, device
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = max_seqs
        self.max_pages = max_pages
        # the attention's query blocks, as the kernel cuts them for this model's q (head size, dtype)
        self._block_m = work_block_m(model.cfg.head_dim, model.embed_tokens.weight.dtype, device)
        page = backend.pool.layout.page_size
        if -(-self.max_tokens // page) > max_pages:
            raise ValueError(f"{self.max_tokens} padding tokens need more than the {max_pages} pages a row holds")
        t, s = self.max_tokens, max_seqs + 1  # + the padding sequence
        self.input_ids = torch.zeros(t, dtype=torch.int32, device=device)
        self.positions = torch.zeros(t, dtype=torch.int32, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(s, dtype=torch.int32, device=device)
        self.extend_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.page_table = torch.full((s, max_pages), PADDING_PAGE, dtype=torch.int32, device=device)
        self._pad_positions = torch.arange(t, dtype=torch.int32, device=device)
        self._forward_batch = ForwardBatch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture = capture
        if not capture:
            return
        t0 = time.monotonic()
        self.graphs, self.outputs = capture_ladder(device, self.buckets, self._run_model,
                                                   before=lambda b: self._fill_padding(0, 0, b))
        log.info("captured %d prefill and mixed-step CUDA graphs (%d..%d tokens, up to %d sequences) in %.1fs",
                 len(self.buckets), self.buckets[0], self.max_tokens, max_seqs, time.monotonic() - t0)

    def _meta(self, bucket: int) -> AttentionMetadata:
        s = self.max_seqs + 1
        return AttentionMetadata(
            is_decode=False, page_size=self.backend.pool.layout.page_size, seq_lens=self.seq_lens,
            extend_lens=self.extend_lens, qo_indptr=self.qo_indptr, page_table=self.page_table,
            slot_mapping=self.slots[:bucket], seq_lens_host=[1] * s, extend_lens_host=[bucket] * s,
            num_pages_host=[1] * s)  # the host lists are not read: the work list sizes the attention grid

    def work_items(self, bucket: int) -> int:
        """Work-list length for a bucket: each sequence's blocks, at most one partial block a
        sequence (and the padding sequence) beyond the bucket's full ones."""
        return -(-bucket // self._block_m) + min(bucket, self.max_seqs + 1)

    def _run_model(self, bucket: int):
        meta = self._meta(bucket)
        # the leading decode rows go through flash-decoding, the rest through the work list
        meta.lead_seq_lens, lead = leading_decode_rows(self.extend_lens, self.seq_lens, min(bucket, self.max_seqs))
        meta.work = extend_work_items(self.qo_indptr, self._block_m, self.work_items(bucket), skip_seqs=lead)
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self._forward_batch(self.backend, meta))

    def bucket_for(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (not meta.is_decode and meta.batch_size <= self.max_seqs
                and meta.slot_mapping.shape[0] <= self.max_tokens and meta.page_table.shape[1] <= self.max_pages)

    def _fill_padding(self, n: int, t: int, bucket: int) -> None:
        """Sequences n.. get no tokens; the padding sequence (the last) takes tokens t..bucket."""
        last = self.max_seqs
        self.seq_lens[n:last].fill_(1)
        self.extend_lens[n:last].zero_()
        self.page_table[n:last, 0].fill_(PADDING_PAGE)
        self.qo_indptr[n + 1:last + 1].fill_(t)
        self.qo_indptr[last + 1].fill_(bucket)
        self.seq_lens[last].fill_(max(bucket - t, 1))
        self.extend_lens[last].fill_(bucket - t)
        self.page_table[last].fill_(PADDING_PAGE)
        self.input_ids[t:bucket].zero_()
        self.positions[t:bucket].copy_(self._pad_positions[:bucket - t])
        self.slots[t:bucket].fill_(-1)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [t, hidden] of the step (a view of the graph's output, valid until the next replay)."""
        n, t = meta.batch_size, meta.slot_mapping.shape[0]
        bucket = self.bucket_for(t)
        width = meta.page_table.shape[1]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.extend_lens[:n].copy_(meta.extend_lens)
        self.qo_indptr[:n + 1].copy_(meta.qo_indptr)
        self.page_table[:n, :width].copy_(meta.page_table)
        self._fill_padding(n, t, bucket)
        if not self.capture:
            return self._run_model(bucket)[:t]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:t]
