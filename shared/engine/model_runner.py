"""Turns a scheduled Batch into tensors, runs the model, and returns logits for the rows
that sample. Owns the model, the KV pool and the attention backend."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.base import AttentionBackend
from .attention.metadata import AttentionMetadata
from .batch import Batch
from .kv_pool import PADDING_PAGE, KVPool


@dataclass
class ForwardBatch:
    """What the model's layers see: the backend and this step's metadata."""
    attn_backend: AttentionBackend
    attn: AttentionMetadata


class ModelRunner:
    def __init__(self, model, pool: KVPool, backend: AttentionBackend, device: torch.device):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.page_size = pool.layout.page_size
        self.graphs = None  # CudaGraphRunner, set by the engine on GPU

    def build(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ps = self.page_size
        ids, pos, slots = [], [], []
        seq_lens, ext_lens, npages, sample_rows = [], [], [], []
        max_pages = 0
        row = 0
        for it in batch.items:
            r = it.req
            ids.extend(r.token_ids[it.start:it.end])
            rng = range(it.start, it.end)
            pos.extend(rng)
            pages = r.page_ids
            slots.extend(pages[p // ps] * ps + p % ps for p in rng)
            seq_lens.append(it.end)
            ext_lens.append(it.length)
            n = -(-it.end // ps)
            npages.append(n)
            max_pages = max(max_pages, n)
            row += it.length
            if it.samples:
                sample_rows.append(row - 1)
        table = torch.full((len(batch.items), max(max_pages, 1)), PADDING_PAGE, dtype=torch.int32)
        for b, it in enumerate(batch.items):
            n = npages[b]
            table[b, :n] = torch.tensor(it.req.page_ids[:n], dtype=torch.int32)
        qo = [0]
        for e in ext_lens:
            qo.append(qo[-1] + e)
        dev = self.device
        meta = AttentionMetadata(
            is_decode=batch.is_decode, page_size=ps,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            extend_lens=torch.tensor(ext_lens, dtype=torch.int32, device=dev),
            qo_indptr=torch.tensor(qo, dtype=torch.int32, device=dev),
            page_table=table.to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            seq_lens_host=seq_lens, extend_lens_host=ext_lens, num_pages_host=npages)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [n_sampling_rows, vocab] (None when no sequence samples this step)."""
        input_ids, positions, meta, rows = self.build(batch)
        if self.graphs is not None and self.graphs.can_run(batch, meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            self.backend.prepare(meta)
            hidden = self.model(input_ids, positions, ForwardBatch(self.backend, meta))
        if not rows:
            return None
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))
