"""CUDA graphs for steps where every sequence extends by the same q_len tokens: the
target's verify step (q_len = K + 1) and a draft model's catch-up pass (q_len = 2).

As decode graphs (cuda_graph.py) do, it captures a ladder of batch sizes over static
buffers sized for the largest, pads a step up to the next captured size and replays.
Padded sequences get q_len positions over the padding page with slot -1 (nothing is
written), so they read a page that never holds live KV and write nothing. The attention
backend sees `uniform_q` in the metadata and runs its verify kernel, whose grid depends
only on the batch size and the page table's width. capture=False runs the same padded
shapes eagerly (identical numbers either way)."""
from __future__ import annotations

import logging
import time

import torch

from ..attention.metadata import AttentionMetadata
from ..cuda_graph import batch_size_ladder, capture_ladder
from ..kv_pool import PADDING_PAGE

log = logging.getLogger("duet.engine.speculative")


class UniformExtendGraphs:
    def __init__(self, model, backend, device: torch.device, q_len: int, max_bs: int, max_pages: int,
                 capture: bool = True, sizes: list[int] | None = None):
        from ..model_runner import ForwardBatch

        self.model, self.backend, self.device = model, backend, device
        self.q_len = q_len
        self.sizes = sorted(sizes) if sizes else batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        self.max_pages = max_pages
        n = self.max_bs * q_len
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((self.max_bs,), q_len, dtype=torch.int32, device=device)
        self.extend_lens = torch.full((self.max_bs,), q_len, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device) * q_len
        self.page_table = torch.full((self.max_bs, max_pages), PADDING_PAGE, dtype=torch.int32, device=device)
        self._forward_batch = ForwardBatch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture = capture
        if not capture:
            return
        t0 = time.monotonic()
        self.graphs, self.outputs = capture_ladder(device, self.sizes, self._run_model)
        log.info("captured %d CUDA graphs of %d-token extends (batch %d..%d) in %.1fs", len(self.sizes), q_len,
                 self.sizes[0], self.max_bs, time.monotonic() - t0)

    def _meta(self, bs: int) -> AttentionMetadata:
        q = self.q_len
        return AttentionMetadata(
            is_decode=False, page_size=self.backend.pool.layout.page_size, seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs], qo_indptr=self.qo_indptr[:bs + 1], page_table=self.page_table[:bs],
            slot_mapping=self.slots[:bs * q], seq_lens_host=[q] * bs, extend_lens_host=[q] * bs,
            num_pages_host=[1] * bs, uniform_q=q)

    def _run_model(self, bs: int):
        n = bs * self.q_len
        return self.model(self.input_ids[:n], self.positions[:n], self._forward_batch(self.backend, self._meta(bs)))

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def can_run(self, meta) -> bool:
        return (meta.uniform_q == self.q_len and meta.batch_size <= self.max_bs
                and meta.page_table.shape[1] <= self.max_pages)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        n = meta.batch_size
        bs = self.padded_size(n)
        t = n * self.q_len
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.page_table.shape[1]
        self.page_table[:n, :width].copy_(meta.page_table)
        if bs > n:  # padded sequences: see the module note
            self.seq_lens[n:bs].fill_(self.q_len)
            self.page_table[n:bs, 0].fill_(PADDING_PAGE)
            self.slots[t:bs * self.q_len].fill_(-1)
            self.positions[t:bs * self.q_len].zero_()
        if not self.capture:
            return self._run_model(bs)[:t]
        self.graphs[bs].replay()
        return self.outputs[bs][:t]
