"""Plain-torch attention over the paged pool (the CPU path and the reference).

Decode steps gather every sequence's pages at once and run one masked SDPA over the padded
batch; extend steps loop over sequences with a causal mask offset by the cached prefix. An FP8 cache
stores k / k_scale and v / v_scale (kernels/fp8.py kv_cache_values); its pages are widened to
q's dtype as they are gathered."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import FP8_DTYPE, kv_cache_values

from .base import AttentionBackend
from .metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, layer, meta: AttentionMetadata, scale, kv_stored: bool = False):
        kc, vc = self.kv_cache(layer)
        k_scale, v_scale = self.kv_scales(layer)
        if not kv_stored:
            ps = meta.page_size
            pages, offs = meta.slot_mapping // ps, meta.slot_mapping % ps
            kc[pages, :, offs] = kv_cache_values(k, kc.dtype, k_scale)
            vc[pages, :, offs] = kv_cache_values(v, vc.dtype, v_scale)
        if kc.dtype == FP8_DTYPE:  # FP8 pages: widened as read, k_scale in the softmax scale, v_scale after
            o = self._decode(q, kc, vc, meta, scale * k_scale) if meta.is_decode else \
                self._extend(q, kc, vc, meta, scale * k_scale)
            return o * v_scale
        if meta.is_decode:
            return self._decode(q, kc, vc, meta, scale)
        return self._extend(q, kc, vc, meta, scale)

    @staticmethod
    def _gather(cache, pages):
        """[B, P] page ids -> [B, H, P*ps, D] K or V. Indexing the head-major view copies
        once into [H, B, P, ps, D], whose (P, ps) merge is then a free view (indexing the
        page-major view and reshaping would copy twice)."""
        g = cache.transpose(0, 1)[:, pages]  # [H, B, P, ps, D]
        h, b, p, ps, d = g.shape
        return g.permute(1, 0, 2, 3, 4).reshape(b, h, p * ps, d)

    @staticmethod
    def _widen(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return kv.to(q.dtype) if kv.dtype != q.dtype else kv

    def _decode(self, q, kc, vc, meta, scale):
        table = meta.page_table.long()
        kb, vb = self._widen(self._gather(kc, table), q), self._widen(self._gather(vc, table), q)
        mask = torch.arange(kb.shape[2], device=q.device)[None, :] < meta.seq_lens[:, None]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kb, vb, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def _extend(self, q, kc, vc, meta, scale):
        out = torch.empty_like(q)
        start = 0
        for b, (seq_len, ext) in enumerate(zip(meta.seq_lens_host, meta.extend_lens_host)):
            n = meta.num_pages_host[b]
            idx = meta.page_table[b:b + 1, :n].long()
            kb = self._widen(self._gather(kc, idx)[0, :, :seq_len], q)
            vb = self._widen(self._gather(vc, idx)[0, :, :seq_len], q)
            qb = q[start:start + ext].transpose(0, 1)  # [Hq, ext, D]
            mask = None
            if ext > 1:
                qpos = torch.arange(ext, device=q.device)[:, None] + (seq_len - ext)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + ext] = ob.transpose(0, 1)
            start += ext
        return out
