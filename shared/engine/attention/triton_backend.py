"""Attention through the Triton kernels in `kernels/` (the GPU default).

Each layer: store_kv writes this step's K/V at their slots (unless the model's fused
prologue already did: kv_stored), then flash-decoding (decode
steps) or the paged extend kernel (prefill chunks with a cached prefix) reads the pool.

CUDA graphs of decode steps: init_graph_state makes static metadata buffers sized for the
largest captured batch; a graph of batch size bs is captured over the first bs rows, and
replay_metadata copies a step's metadata into them. Padded rows (beyond the real batch)
get seq_len 1 over the padding page and slot -1, which store_kv skips: they read a page
that is never written and write nothing. (Prefill and mixed steps' graphs keep their own
buffers: shared/engine/prefill_graph.py.)"""
from __future__ import annotations

import torch

from ..kv_pool import PADDING_PAGE
from .base import AttentionBackend
from .metadata import AttentionMetadata, DecodeLead

# a mixed step's decode rows: the launch's splits are chosen as for this many rows (_mixed)
MIXED_DECODE_ROWS = 8


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, pool):
        super().__init__(pool)
        self._g: dict[str, torch.Tensor] | None = None
        self.pdl = None  # kernels.pdl.Pdl for the decode kernels (set by the engine)

    def forward(self, q, k, v, layer, meta: AttentionMetadata, scale, kv_stored: bool = False):
        from kernels.decode_attention import decode_attention
        from kernels.extend_attention import extend_attention
        from kernels.store_kv import store_kv

        kc, vc = self.kv_cache(layer)
        k_scale, v_scale = self.kv_scales(layer)
        if not kv_stored:
            store_kv(kc, vc, k, v, meta.slot_mapping, k_scale, v_scale)
        if meta.is_decode:
            return decode_attention(q, kc, vc, meta.page_table, meta.seq_lens, scale, pdl=self.pdl,
                                    k_scale=k_scale, v_scale=v_scale)
        if meta.uniform_q and kc.element_size() > 1:  # a verify step (FP8 pages: the extend kernel widens them)
            from kernels.verify_attention import verify_attention
            return verify_attention(q, kc, vc, meta.page_table, meta.seq_lens, scale, meta.uniform_q)
        return self._mixed(q, kc, vc, meta, scale, k_scale, v_scale)

    def prepare(self, meta: AttentionMetadata) -> None:
        """An eager mixed step's split, once for every layer: its leading one-token rows (the
        decode rows the scheduler puts first) and the offsets of the sequences after them."""
        if meta.is_decode or meta.work is not None:
            return
        ext = meta.extend_lens_host
        d = next((i for i, e in enumerate(ext) if e != 1), len(ext))
        if d:
            rest = d < len(ext)
            meta.decode_lead = DecodeLead(d, meta.qo_indptr[d:] - d if rest else None, max(ext[d:]) if rest else 0)

    def _mixed(self, q, kc, vc, meta: AttentionMetadata, scale, k_scale, v_scale):
        """Prefill chunks, and the decode rows a step runs beside them (the scheduler puts those
        first): the decode rows through flash-decoding, as in a decode step, the chunks through the
        extend kernel. The extend kernel would give each one-token row a whole query block and
        one program per query head, reading its context once a head without splitting it: several
        times a decode step's reads beside long conversations. The decode launch is sized as for
        MIXED_DECODE_ROWS rows over the graphs' page-table capacity whatever the rows: one kernel
        variant for every mixed step, compiled with the graphs, and splits for a few long rows
        (a graph's rows are counted on the device only; most are empty and exit at once)."""
        from kernels.decode_attention import decode_attention
        from kernels.extend_attention import extend_attention

        scales = dict(k_scale=k_scale, v_scale=v_scale)
        pages = self._max_pages if self._g is not None else meta.page_table.shape[1]
        sized = dict(sized_as=(MIXED_DECODE_ROWS, pages * meta.page_size), **scales)
        if meta.work is not None:  # a captured step
            lead = meta.lead_seq_lens
            out = torch.empty_like(q)
            if lead is not None:  # rows past the decode rows get zeros here, then the extend kernel's
                r = lead.shape[0]
                decode_attention(q[:r], kc, vc, meta.page_table[:r], lead, scale, out=out[:r], **sized)
            return extend_attention(q, kc, vc, meta.page_table, meta.qo_indptr, meta.seq_lens, scale, out=out,
                                    work=meta.work, **scales)
        lead = meta.decode_lead
        if lead is None:
            return extend_attention(q, kc, vc, meta.page_table, meta.qo_indptr, meta.seq_lens, scale,
                                    max_extend_len=max(meta.extend_lens_host), **scales)
        d, out = lead.rows, torch.empty_like(q)
        decode_attention(q[:d], kc, vc, meta.page_table[:d], meta.seq_lens[:d], scale, out=out[:d], **sized)
        if lead.rest_qo_indptr is not None:
            extend_attention(q[d:], kc, vc, meta.page_table[d:], lead.rest_qo_indptr, meta.seq_lens[d:], scale,
                             max_extend_len=lead.rest_max_extend, out=out[d:], **scales)
        return out

    # -- CUDA graph hooks -----------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        dev = self.pool.device
        self._g = {
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "extend_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "qo_indptr": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "page_table": torch.full((max_bs, max_pages), PADDING_PAGE, dtype=torch.int32, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int32, device=dev),
        }
        self._max_pages = max_pages

    def capture_metadata(self, bs: int) -> AttentionMetadata:
        g = self._g
        return AttentionMetadata(
            is_decode=True, page_size=self.pool.layout.page_size,
            seq_lens=g["seq_lens"][:bs], extend_lens=g["extend_lens"][:bs], qo_indptr=g["qo_indptr"][:bs + 1],
            page_table=g["page_table"][:bs], slot_mapping=g["slot_mapping"][:bs],
            seq_lens_host=[1] * bs, extend_lens_host=[1] * bs, num_pages_host=[1] * bs)

    def replay_metadata(self, meta: AttentionMetadata, bs: int) -> None:
        g = self._g
        n = meta.batch_size
        width = meta.page_table.shape[1]
        if width > self._max_pages:
            raise ValueError(f"page table of {width} pages exceeds the captured {self._max_pages}")
        g["seq_lens"][:n].copy_(meta.seq_lens)
        g["page_table"][:n, :width].copy_(meta.page_table)
        g["slot_mapping"][:n].copy_(meta.slot_mapping)
        if bs > n:  # padded rows: harmless values (see the module note)
            g["seq_lens"][n:bs].fill_(1)
            g["page_table"][n:bs, 0].fill_(PADDING_PAGE)
            g["slot_mapping"][n:bs].fill_(-1)
